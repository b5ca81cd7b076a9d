"""Turn-N time to first token of a multi-turn conversation: recomputed, from the session's pinned pages, and from
the host tier after the device cache was forced out.

Run from the repository root:

    python -m benchmarks.bench_sessions --out sessions.json          # SmolLM2 preset, 8 turns, CPU-sized
    python -m benchmarks.bench_sessions --turns 16 --message-len 64  # longer conversations
    python -m benchmarks.bench_sessions --quick                      # seconds, random tiny model (the smoke test)

A conversation is token ids: each turn appends a user message of `--message-len` random tokens to the previous
prompt and reply, and the engine replies with `--reply-len` greedy tokens. Three modes run the same conversations:
- `recompute`: no session and no prefix cache: every turn prefills its whole prompt (what a server does when other
  traffic has taken the prefix cache, or without one);
- `session`: the request names a session id: the previous turn's pages are pinned, the turn prefills its new
  message (plus the previous reply's last token);
- `host`: a session id and the host tier on, but before every turn the device cache is forced out (the session is
  released and every free page is taken and given back, so each cached page is copied to the host tier); the turn
  copies its prefix back from host memory and prefills the rest.
TTFT is the wall time from `add_request` to the step that returns the turn's first token (overlap scheduling on,
as served), after every step bucket and page-copy size was compiled. Medians over `--repeats` conversations.
The replies must be the same tokens in every mode (`tokens_identical`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.common import SHAPES, fill_defaults, format_table, metadata, random_params, shape_config

MODES = ("recompute", "session", "host")
FULL_DEFAULTS: dict[str, Any] = dict(turns=8, message_len=32, reply_len=32, repeats=3, max_num_batched_tokens=256)
QUICK_DEFAULTS: dict[str, Any] = dict(turns=4, message_len=8, reply_len=4, repeats=1, max_num_batched_tokens=32)
HOST_BYTES = 2**30


def build_engine(args: argparse.Namespace, mode: str) -> Any:
    from jaxinfer.engine.config import CacheConfig
    from jaxinfer.engine.engine import Engine

    if args.shape:
        cfg = shape_config(args.shape, args.dtype or "float32")
        params = random_params(cfg, seed=args.seed)
    else:
        from jaxinfer.weights import load_weights

        cfg, params, _ = load_weights(args.model, dtype=args.dtype or "float32")
    context = args.turns * (args.message_len + args.reply_len)
    page = args.block_size
    max_len = -(-(context + 1) // page) * page
    cache = CacheConfig(
        block_size=page, num_pages=3 * (max_len // page) + 4, max_model_len=max_len, max_num_seqs=4,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=mode != "recompute",
        session_cache_pages=0 if mode == "recompute" else max_len // page,  # room for the whole conversation
        host_kv_cache_memory=HOST_BYTES if mode == "host" else 0,
    )  # fmt: skip
    return Engine(cfg, params, cache, (), None, args.seed)


def force_device_eviction(engine: Any) -> None:
    """Every cached page leaves the device: the session is released, then the whole pool is taken and given back
    (the allocator evicts each cached page, which a tiny request's step then copies to the host tier)."""
    from jaxinfer.types import SamplingParams

    engine.release_sessions()
    alloc = engine.allocator
    alloc.free(alloc.allocate(alloc.num_free))
    engine.generate([[1]], SamplingParams(max_tokens=1, temperature=0))
    assert alloc.num_free == alloc.num_pages


def timed_turn(engine: Any, prompt: list[int], params: Any) -> tuple[float, list[int], int]:
    """(TTFT seconds, reply tokens, prompt tokens computed) of one request run to completion."""
    before = engine.num_prefilled_tokens
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, params)
    ttft = None
    tokens: list[int] = []
    while engine.has_unfinished():
        for u in engine.step():
            if u.request_id == rid:
                if ttft is None and u.new_token_ids:
                    ttft = time.perf_counter() - t0
                tokens += u.new_token_ids
    return ttft, tokens, engine.num_prefilled_tokens - before


def converse(engine: Any, mode: str, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    from jaxinfer.types import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.cfg.vocab_size
    params = SamplingParams(max_tokens=args.reply_len, temperature=0, ignore_eos=True,
                            session_id=None if mode == "recompute" else f"conv-{seed}")  # fmt: skip
    prompt: list[int] = []
    turns = []
    for turn in range(1, args.turns + 1):
        prompt = prompt + rng.integers(3, vocab, args.message_len).tolist()
        if mode == "host" and turn > 1:
            force_device_eviction(engine)
        hits = engine.cache_stats()["host_kv_hits"]
        ttft, reply, prefilled = timed_turn(engine, prompt, params)
        turns.append(dict(turn=turn, context=len(prompt), prefilled=prefilled, ttft_s=ttft, reply=reply,
                          host_hit_pages=engine.cache_stats()["host_kv_hits"] - hits))  # fmt: skip
        prompt = prompt + reply
    engine.release_sessions()
    return turns


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_sessions", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path (ignored with --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="random weights at this shape instead of --model")
    p.add_argument("--dtype", help="weights/KV dtype (default float32)")
    for flag, text in [("--turns", "turns per conversation; the table reports the last"),
                       ("--message-len", "tokens of each user message"), ("--reply-len", "tokens of each reply"),
                       ("--repeats", "conversations per mode; medians are reported")]:  # fmt: skip
        name = flag[2:].replace("-", "_")
        p.add_argument(flag, type=int, help=f"{text} (default {FULL_DEFAULTS[name]}; --quick {QUICK_DEFAULTS[name]})")
    p.add_argument("--block-size", type=int, default=16, help="KV page size")
    p.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step (default 256; --quick 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="random tiny model, short conversations: a seconds-long run")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    fill_defaults(args, QUICK_DEFAULTS, FULL_DEFAULTS)
    if args.quick and not args.shape:
        args.shape = "tiny"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    meta = metadata("benchmarks.bench_sessions", args, argv)
    print(f"device: {meta['device_kind']} ({meta['platform']}), jax {meta['jax_version']}, {meta['date']}, "
          f"load average {meta['load_avg_start']}; {args.shape or args.model}", flush=True)  # fmt: skip
    from jaxinfer.engine.runner import compile_count

    runs: dict[str, list[list[dict[str, Any]]]] = {}
    compiles: dict[str, int] = {}
    for mode in MODES:
        engine = build_engine(args, mode)
        # Every step bucket of greedy requests and, with the host tier, every page-copy size.
        engine.runner.warmup(advanced=False)
        before = compile_count()
        runs[mode] = [converse(engine, mode, args, args.seed + r) for r in range(args.repeats)]
        compiles[mode] = compile_count() - before
        print(f"{mode}: done ({compiles[mode]} compilations while timed)", flush=True)
    replies = {m: [[t["reply"] for t in conv] for conv in runs[m]] for m in MODES}
    identical = all(replies[m] == replies["recompute"] for m in MODES)
    rows = []
    for turn in range(args.turns):
        row: dict[str, Any] = {"turn": turn + 1, "context": runs["recompute"][0][turn]["context"]}
        for m in MODES:
            row[f"{m}_ttft_s"] = statistics.median(conv[turn]["ttft_s"] for conv in runs[m])
            row[f"{m}_prefilled"] = statistics.median(conv[turn]["prefilled"] for conv in runs[m])
        row["host_hit_pages"] = statistics.median(conv[turn]["host_hit_pages"] for conv in runs["host"])
        row["session_speedup"] = row["recompute_ttft_s"] / row["session_ttft_s"]
        row["host_speedup"] = row["recompute_ttft_s"] / row["host_ttft_s"]
        rows.append(row)
    headers = ["turn", "context", "prefill re/se/ho", "recompute_ms", "session_ms", "host_ms", "host_pages",
               "session_x", "host_x"]  # fmt: skip
    body = [[str(r["turn"]), str(r["context"]),
             "/".join(f"{r[f'{m}_prefilled']:.0f}" for m in MODES),
             *(f"{r[f'{m}_ttft_s'] * 1e3:.1f}" for m in MODES), f"{r['host_hit_pages']:.0f}",
             f"{r['session_speedup']:.2f}", f"{r['host_speedup']:.2f}"] for r in rows]  # fmt: skip
    print(format_table(headers, body))
    last = rows[-1]
    print(f"turn {last['turn']}: session {last['session_speedup']:.2f}x, host tier {last['host_speedup']:.2f}x "
          f"faster TTFT than recompute; replies identical in every mode: {identical}")  # fmt: skip
    if args.out:
        meta["load_avg_end"] = metadata("benchmarks.bench_sessions", args, argv)["load_avg_start"]
        result = {"meta": meta, "turns": rows, "tokens_identical": identical, "compiles_while_timed": compiles,
                  "runs": {m: [[{k: v for k, v in t.items() if k != "reply"} for t in conv] for conv in runs[m]]
                           for m in MODES}}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
