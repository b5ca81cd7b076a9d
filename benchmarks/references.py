"""Reference engines for `bench_offline`: HF transformers `generate` and llama.cpp (llama-cpp-python), run on the
same token-id workload, each in its own child process.

    python -m benchmarks.references --engine hf --model smollm2-135m-instruct --workload wl.json --out res.json

A child process per engine keeps the engines' thread pools (jax's, torch's OpenMP, ggml's) and memory apart and
lets a crash in a native library cost one row instead of the whole benchmark. `bench_offline` writes the workload
file, starts this module with `sys.executable -m benchmarks.references`, and reads the result file.

Both references decode greedily and ignore EOS, so each request produces exactly its `max_tokens` tokens:
- hf: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=torch.float32)` (the GGUF dequantized by
  transformers to the same fp32 values jaxinfer uses), static batches of `--batch-size` requests sorted by output
  then prompt length, left-padded; a batch runs until its longest request is done (that is what `generate` can do),
  and only each request's own `max_tokens` count as output;
- llamacpp: the low-level batched API (`llama_decode` with one sequence id per request, a unified KV cache of
  `n_seq_max` sequences), continuous batching: finished sequences leave, waiting ones join, prompts are fed in
  chunks beside the decodes, up to `n_batch` tokens per call. Greedy is an argmax over the returned logits.
  Run on an f32 GGUF written from the dequantized tensors of the original file (written once into a cache dir) and,
  as `llamacpp-quant`, on the original quantized file; both with an f32 KV cache, so only the weights differ.

Each result also holds `check_tokens`: the greedy tokens of the first `--check-prompts` prompts run alone (batch 1,
no padding), for the cross-engine agreement check in `bench_offline`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ENGINES = ("hf", "llamacpp", "llamacpp-quant")
# ../shared/wheels beside the repository: llama-cpp-python built for these CPUs.
LLAMA_CPP_WHEEL = str(
    Path(__file__).resolve().parents[2] / "shared" / "wheels" / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
)

Request = tuple[list[int], int]  # (prompt token ids, max_tokens)


def llama_cpp_missing() -> str | None:
    """Why the llama.cpp reference cannot run here, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed (pip install {LLAMA_CPP_WHEEL}: a build for these CPUs, AMX off)"
    return None


def hf_missing() -> str | None:
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    return f"{' and '.join(missing)} not installed (bash scripts/install.sh test)" if missing else None


# --- f32 GGUF ------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    return Path(os.environ.get("JAXINFER_CACHE", Path.home() / ".cache" / "jaxinfer")) / "bench"


def f32_gguf(src: Path, out_dir: Path | None = None) -> Path:
    """An F32 copy of a GGUF file: every tensor dequantized with the `gguf` package (as jaxinfer's loader does),
    the metadata copied, `general.file_type` set to ALL_F32. Written once; the name keys on the source's path,
    size and mtime."""
    import gguf

    st = src.stat()
    key = hashlib.sha1(f"{src.resolve()}|{st.st_size}|{st.st_mtime_ns}|f32|v1".encode()).hexdigest()[:12]
    out_dir = out_dir or cache_dir()
    dst = out_dir / f"{src.stem}-f32-{key}.gguf"
    if dst.exists():
        return dst
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst.with_suffix(".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        # The writer emits the header counts and the architecture itself.
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, w.reshape(tuple(reversed([int(n) for n in t.shape]))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)  # a crash mid-write must not leave a file that looks complete
    return dst


# --- HF transformers -----------------------------------------------------------------------------------


def run_hf(
    model_path: Path, workloads: dict[str, list[Request]], batch_size: int, threads: int, check_prompts: int
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    pad = 0

    def generate(batch: list[Request]) -> list[list[int]]:
        width = max(len(p) for p, _ in batch)
        new = max(n for _, n in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding: every row's last prompt token lines up
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            # eos_token_id=None overrides the model's EOS: never stop early (ignore_eos); every row runs `new` steps.
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                eos_token_id=None, pad_token_id=pad,
            )  # fmt: skip
        return [out[i, width : width + n].tolist() for i, (_, n) in enumerate(batch)]

    t0 = time.perf_counter()
    generate([([1, 2, 3, 4], 4)])  # first call: lazy initialisation inside torch and transformers
    warmup_s = time.perf_counter() - t0
    first = next(iter(workloads.values()))
    check = [generate([(p, min(n, 32))])[0] for p, n in first[:check_prompts]]

    rows = {}
    for name, reqs in workloads.items():
        # Sorted by output length first (a batch decodes until its longest request is done), then prompt length.
        order = sorted(range(len(reqs)), key=lambda i: (reqs[i][1], len(reqs[i][0])))
        outs: list[list[int]] = [[] for _ in reqs]
        computed = 0
        t0 = time.perf_counter()
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            batch = [reqs[i] for i in idx]
            computed += len(batch) * max(n for _, n in batch)
            for i, toks in zip(idx, generate(batch), strict=True):
                outs[i] = toks
        elapsed = time.perf_counter() - t0
        print(f"hf {name}: {elapsed:.1f}s", file=sys.stderr, flush=True)
        rows[name] = dict(elapsed_s=elapsed, output_lens=[len(o) for o in outs], decoded_tokens=computed,
                          first_tokens=[o[:64] for o in outs[:check_prompts]])  # fmt: skip
    return dict(
        engine="hf", load_s=load_s, warmup_s=warmup_s, check_tokens=check, workloads=rows,
        notes=[f"transformers {_version('transformers')}, torch {torch.__version__}, {threads} threads, "
               f"static batches of {batch_size} sorted by output length"],
    )  # fmt: skip


# --- llama.cpp -----------------------------------------------------------------------------------------


class LlamaCppBatch:
    """A llama.cpp model + context driven through the low-level batched API, greedy, continuous batching."""

    def __init__(self, path: Path, n_ctx: int, n_seq_max: int, n_batch: int, threads: int, unified: bool):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        mp = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq_max
        cp.kv_unified = unified
        cp.type_k = cp.type_v = lc.GGML_TYPE_F32
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context (n_ctx too large for memory?)")
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_ctx, self.n_seq_max, self.n_batch = lc.llama_n_ctx(self.ctx), n_seq_max, n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def generate(self, reqs: Sequence[Request]) -> tuple[list[list[int]], int]:
        """Greedy tokens of every request (each exactly max_tokens long); also the number of llama_decode calls."""
        lc, b = self.lc, self.batch
        for p, n in reqs:
            if len(p) + n > self.n_ctx:
                raise ValueError(f"a request of {len(p) + n} tokens does not fit n_ctx={self.n_ctx}")
        waiting = list(range(len(reqs)))[::-1]  # a stack: pop() takes the next in order
        outs: list[list[int]] = [[] for _ in reqs]
        free_seqs = list(range(self.n_seq_max))[::-1]
        active: dict[int, list[int]] = {}  # seq id -> [request index, prompt tokens fed]
        reserved = 0  # KV tokens the active sequences will hold at their end (admission never over-commits)
        calls = 0
        while waiting or active:
            while waiting and free_seqs:
                p, n = reqs[waiting[-1]]
                if reserved + len(p) + n > self.n_ctx:
                    break
                reserved += len(p) + n
                active[free_seqs.pop()] = [waiting.pop(), 0]
            # (token, position, seq id, wants logits): decodes first (one token each), then prompt chunks in the
            # remaining room, like a chunked-prefill scheduler.
            entries: list[tuple[int, int, int, bool]] = []
            for seq, (r, fed) in active.items():
                p = reqs[r][0]
                if fed == len(p) and outs[r]:
                    entries.append((outs[r][-1], len(p) + len(outs[r]) - 1, seq, True))
            for seq, st in active.items():
                r, fed = st
                p = reqs[r][0]
                take = min(self.n_batch - len(entries), len(p) - fed)
                if take > 0:
                    entries += [(p[j], j, seq, j == len(p) - 1) for j in range(fed, fed + take)]
                    st[1] = fed + take
            emit = []  # (seq id, batch index whose logits give its next token)
            for i, (tok, pos, seq, logits) in enumerate(entries):
                b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = tok, pos, 1, seq, int(logits)
                if logits:
                    emit.append((seq, i))
            b.n_tokens = len(entries)
            rc = lc.llama_decode(self.ctx, b)
            calls += 1
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for seq, i in emit:
                r = active[seq][0]
                outs[r].append(self._argmax(i))
                if len(outs[r]) == reqs[r][1]:
                    lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
                    reserved -= len(reqs[r][0]) + reqs[r][1]
                    del active[seq]
                    free_seqs.append(seq)
        return outs, calls


def run_llamacpp(
    model_path: Path,
    workloads: dict[str, list[Request]],
    n_seq_max: int,
    n_batch: int,
    max_ctx: int,
    threads: int,
    check_prompts: int,
    quantized: bool,
) -> dict[str, Any]:
    notes = []
    t0 = time.perf_counter()
    if quantized:
        path = model_path
    else:
        path = f32_gguf(model_path)
        notes.append(f"f32 GGUF: {path}")
    longest = max(len(p) + n for reqs in workloads.values() for p, n in reqs)
    n_ctx = min(max(max_ctx, longest), n_seq_max * longest)
    # A KV stream per sequence when every request fits one (n_ctx / n_seq_max cells): with one unified pool,
    # llama.cpp's attention for each token runs over every used cell of every sequence, masked (the 256-request
    # workload: 30.6 output tok/s unified, 46.0 with a stream per sequence, back to back on a 2-core EPYC).
    unified = n_ctx // n_seq_max < longest
    eng = LlamaCppBatch(path, n_ctx, n_seq_max, n_batch, threads, unified)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.generate([([1, 2, 3, 4], 4)])
    warmup_s = time.perf_counter() - t0
    first = next(iter(workloads.values()))
    check = [eng.generate([(p, min(n, 32))])[0][0] for p, n in first[:check_prompts]]
    rows = {}
    for name, reqs in workloads.items():
        t0 = time.perf_counter()
        outs, calls = eng.generate(reqs)
        elapsed = time.perf_counter() - t0
        print(f"llamacpp {name}: {elapsed:.1f}s", file=sys.stderr, flush=True)
        rows[name] = dict(elapsed_s=elapsed, output_lens=[len(o) for o in outs], decode_calls=calls,
                          first_tokens=[o[:64] for o in outs[:check_prompts]])  # fmt: skip
    eng.close()
    import llama_cpp

    notes.append(
        f"llama-cpp-python {llama_cpp.__version__}, {threads} threads, batched API: n_seq_max={n_seq_max}, "
        f"n_batch={n_batch}, n_ctx={n_ctx} ({'unified KV' if unified else 'a KV stream per sequence'}, f32), "
        "continuous batching"
    )
    return dict(engine="llamacpp-quant" if quantized else "llamacpp", load_s=load_s, warmup_s=warmup_s,
                check_tokens=check, workloads=rows, model_file=str(path), notes=notes)  # fmt: skip


def _version(module: str) -> str:
    from importlib.metadata import version

    return version(module)


# --- CLI (the child process) ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.references", description=__doc__.split("\n")[0])
    p.add_argument("--engine", required=True, choices=ENGINES)
    p.add_argument("--model", required=True, help="model name or path (a GGUF file for these references)")
    p.add_argument("--workload", required=True, help='JSON: {"name": [[prompt_ids, max_tokens], ...], ...}')
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch-size", type=int, default=32, help="hf: requests per generate() call")
    p.add_argument("--n-seq-max", type=int, default=64, help="llamacpp: concurrent sequences")
    p.add_argument("--n-batch", type=int, default=512, help="llamacpp: tokens per llama_decode call")
    p.add_argument("--max-ctx", type=int, default=65536, help="llamacpp: KV tokens of the unified cache (at most)")
    p.add_argument("--check-prompts", type=int, default=2)
    args = p.parse_args(argv)

    from jaxinfer.model_files import resolve_model_path

    model_path = resolve_model_path(args.model)
    if model_path.suffix != ".gguf":
        raise SystemExit(f"references need a GGUF model file, got {model_path}")
    raw = json.loads(Path(args.workload).read_text())
    workloads = {k: [(list(map(int, pr)), int(n)) for pr, n in v] for k, v in raw.items()}
    if args.engine == "hf":
        res = run_hf(model_path, workloads, args.batch_size, args.threads, args.check_prompts)
    else:
        res = run_llamacpp(model_path, workloads, args.n_seq_max, args.n_batch, args.max_ctx, args.threads,
                           args.check_prompts, quantized=args.engine == "llamacpp-quant")  # fmt: skip
    Path(args.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
