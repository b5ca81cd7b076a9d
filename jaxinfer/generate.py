"""The simple, correct generation path: a contiguous KV cache per sequence, greedy or temperature sampling.

This is the foundation's reference generator (the paged engine must produce the same greedy tokens) and the
`python -m jaxinfer.generate` CLI on the default model.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.errors import user_errors
from jaxinfer.model.attention import contiguous_attend, init_contiguous_cache
from jaxinfer.model.functional import ModelDef, split_model
from jaxinfer.model.transformer import Params
from jaxinfer.sampling import RowSampling, build_sampling_tensors, sample


def bucket(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= n (and >= minimum): bounds the number of compiled shapes."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@partial(jax.jit, static_argnames=("model_def", "cfg", "all_logits"), donate_argnames=("cache",))
def _step(
    model_def: ModelDef,
    weights: list[jax.Array],
    cfg: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    cache: list,
    all_logits: bool,
) -> tuple[jax.Array, list]:
    model = model_def.merge(weights)
    hidden, cache = model(tokens, positions, cache, contiguous_attend(cfg, positions, valid))
    if not all_logits:
        last = jnp.maximum(valid.sum(axis=1) - 1, 0)
        hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    return model.logits(hidden), cache


def run_step(
    params: Params | nnx.Module,
    cfg: ModelConfig,
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T]
    valid: jax.Array,  # bool[B, T]; invalid tokens are padding: not written to the cache
    cache: list,
    all_logits: bool = False,
) -> tuple[jax.Array, list]:
    """One forward over a right-padded token block of a family's state or any protocol module. Returns f32 logits
    for every token [B, T, V] when `all_logits`, else for each row's last valid token [B, V]; and the updated
    (donated) cache."""
    model_def, weights = split_model(cfg, params)
    return _step(model_def, weights, cfg, tokens, positions, valid, cache, all_logits)


_sample = jax.jit(partial(sample, advanced=False, num_logprobs=None))


def generate_tokens(
    params: Params | nnx.Module,
    cfg: ModelConfig,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...] = (),
    temperature: float = 0.0,
    seed: int = 0,
) -> list[list[int]]:
    """Generates for a batch of token-id prompts with `params` (a family's state, or any module following
    jaxinfer.model.protocol); returns the new tokens of each (EOS included when hit). Sampling is the engine's
    (`jaxinfer.sampling.sample`): greedy at temperature 0, else row i draws from seed + i."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: every prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    lens = np.array([len(p) for p in prompts], np.int32)
    if lens.max() + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt of {lens.max()} tokens + max_new_tokens={max_new_tokens} exceeds the context length "
            f"{cfg.max_position_embeddings}"
        )
    b, t = len(prompts), bucket(int(lens.max()))
    cache = init_contiguous_cache(cfg, b, bucket(t + max_new_tokens))
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    model_def, weights = split_model(cfg, params)  # once: each step reuses the same compiled program

    def draw(logits_: jax.Array, step: int) -> np.ndarray:
        rows = [RowSampling(temperature=temperature, seed=(seed + i) % 2**32, counter=step) for i in range(b)]
        return np.asarray(_sample(logits_, build_sampling_tensors(rows, b, 1, 1, False)).token_ids)

    out, cache = _step(model_def, weights, cfg, tokens, positions, positions < lens[:, None], cache, False)
    nxt = draw(out, 0)
    results: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(b, bool)
    eos = np.array(eos_token_ids, np.int32)
    for step in range(max_new_tokens):
        for i in np.flatnonzero(~done):
            results[i].append(int(nxt[i]))
        done |= np.isin(nxt, eos)
        if done.all() or step == max_new_tokens - 1:
            break
        pos = (lens + step)[:, None]
        out, cache = _step(model_def, weights, cfg, nxt[:, None], pos, ~done[:, None], cache, False)
        nxt = draw(out, step + 1)
    return results


def main(argv: list[str] | None = None) -> int:
    from jaxinfer.model_files import DEFAULT_MODEL

    ap = argparse.ArgumentParser(prog="python -m jaxinfer.generate", description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="preset name, GGUF file, HF directory or checkpoint")
    ap.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap prompts in the chat template (default: when the model has one)",
    )
    args = ap.parse_args(argv)
    if args.temperature < 0:
        ap.error("--temperature must be >= 0")
    if args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    try:
        return _run(args)
    except user_errors() as e:  # a bad model path or setting: one line, as `jaxinfer generate` says it
        print(f"{ap.prog}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from jaxinfer.weights import load_model

    t0 = time.perf_counter()
    m = load_model(args.model, dtype=args.dtype)
    tok = m.tokenizer
    chat = tok.chat_template is not None if args.chat is None else args.chat
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if chat else p for p in args.prompt]
    # The chat template already contains BOS where the model wants it.
    prompts = [tok.encode(t, add_special_tokens=not chat) for t in texts]
    t1 = time.perf_counter()
    outs = generate_tokens(m.params, m.config, prompts, args.max_tokens, tok.eos_token_ids, args.temperature, args.seed)
    t2 = time.perf_counter()
    for prompt, ids in zip(args.prompt, outs, strict=True):
        print(f"### {prompt}\n{tok.decode(ids)}\n")
    n = sum(len(o) for o in outs)
    print(f"[load {t1 - t0:.1f}s, generate {n} tokens in {t2 - t1:.1f}s incl. compile]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
