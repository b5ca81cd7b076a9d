"""Roofline limits of a model on a device: how fast a decode step or a prefill could possibly be.

    python -m benchmarks.roofline                              # SmolLM2 preset on this device
    python -m benchmarks.roofline --shape llama3-8b --batch 1,64 --context 600 --prefill-len 2048

- decode is bandwidth-bound: every step reads all the weights once plus the live K/V of every row, so the floor is
  `(weight bytes + live KV bytes) / peak bandwidth`; MBU = floor / measured step time;
- prefill is compute-bound: `2 * params * tokens` FLOPs for the matmuls (+ causal attention), so the floor is
  `FLOPs / peak FLOP/s`; MFU = floor / measured step time.

Peak bandwidth is measured here (a jitted `x + 1` over a large array: read + write bytes / time, like a memcpy),
unless `--peak-gbs` is given. Peak FLOP/s comes from a table of device specs (dense bf16 on accelerators; for CPUs
the figure in ../shared/ANCHORS.md: ~150 GFLOP/s fp32 per core, so ~300 for the 2-core CI machine), unless
`--peak-tflops` is given. `bench_latency` uses these functions for its MBU/MFU columns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.common import SHAPES, format_table, int_list, metadata, num_params, shape_config
from jaxinfer.config import ModelConfig

# Dense peak FLOP/s by device kind (substring match, first hit wins), for bf16 / fp32 inputs. Vendor spec sheets;
# fp32 on NVIDIA counts the non-tensor-core rate since XLA's default precision for f32 matmuls may use TF32 or not.
_PEAK_FLOPS: list[tuple[str, float, float]] = [
    ("H200", 989e12, 67e12),
    ("H100", 989e12, 67e12),  # SXM; the PCIe card is ~756
    ("A100", 312e12, 19.5e12),
    ("L4", 121e12, 30e12),
    ("TPU v6", 918e12, 918e12 / 4),
    ("TPU v5p", 459e12, 459e12 / 4),
    ("TPU v5 lite", 197e12, 197e12 / 4),
    ("TPU v5e", 197e12, 197e12 / 4),
    ("TPU v4", 275e12, 275e12 / 4),
]
# CPU: ~300 GFLOP/s fp32 for the 2-core CI machine (ANCHORS.md), i.e. per core; bf16 gets no faster on CPUs
# without AMX in XLA, so the same figure is used.
CPU_FLOPS_PER_CORE = 150e9


def default_peak_flops(dtype: str) -> float | None:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return CPU_FLOPS_PER_CORE * (os.cpu_count() or 1)
    for name, bf16, fp32 in _PEAK_FLOPS:
        if name.lower() in dev.device_kind.lower():
            return fp32 if dtype == "float32" else bf16
    return None


def measure_copy_bandwidth(nbytes: int | None = None, iters: int = 10) -> float:
    """Bytes/s of a jitted elementwise `x + 1` over one large f32 array, in place, counting the read and the write.

    An elementwise op (not `jnp.copy`, which XLA may alias away) is what a memory-bound kernel can reach. The input
    is donated so the output reuses its buffer: a fresh 256 MiB output per call costs page faults on CPU and
    halved the figure. Median of `iters` runs; 256 MiB on CPU (far past the caches), 2 GiB on accelerators.
    """
    if nbytes is None:
        nbytes = (256 << 20) if jax.default_backend() == "cpu" else (2 << 30)
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    x = jax.block_until_ready(f(jnp.zeros(nbytes // 4, jnp.float32)))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        x = jax.block_until_ready(f(x))
        samples.append(time.perf_counter() - t0)
    x.delete()
    return 2 * nbytes / statistics.median(samples)


# --- counts --------------------------------------------------------------------------------------------


def itemsize(cfg: ModelConfig) -> int:
    return jnp.dtype(cfg.dtype).itemsize


def layer_params(cfg: ModelConfig) -> int:
    """Parameters of the transformer blocks (what every token multiplies through)."""
    head = cfg.vocab_size * cfg.hidden_size
    return num_params(cfg) - head * (1 if cfg.tie_word_embeddings else 2) - cfg.hidden_size  # - final norm


def decode_weight_bytes(cfg: ModelConfig, batch: int) -> int:
    """Weight bytes one decode step must read: every block, the final norm, the LM head; of the input embedding
    only the `batch` gathered rows when it is not tied to the head (a tied table is read whole by the head)."""
    head = cfg.vocab_size * cfg.hidden_size
    embed_rows = 0 if cfg.tie_word_embeddings else batch * cfg.hidden_size
    return (layer_params(cfg) + cfg.hidden_size + head + embed_rows) * itemsize(cfg)


def kv_bytes(cfg: ModelConfig, tokens: int) -> int:
    """K and V of `tokens` cached tokens, every layer (what attention reads)."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize(cfg) * tokens


def attention_flops(cfg: ModelConfig, q_len: int, prefix: int = 0) -> int:
    """QK^T and PV FLOPs of a causal chunk of q_len new tokens after `prefix` cached ones, all layers."""
    keys = q_len * prefix + q_len * (q_len + 1) // 2
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys


def step_flops(cfg: ModelConfig, tokens: int, sampled_rows: int, attn_keys_flops: int = 0) -> int:
    """Matmul FLOPs of one engine step: 2 * block params per token, plus the LM head for the sampled rows only
    (the engine computes logits at each sequence's last token), plus the attention FLOPs given."""
    return 2 * layer_params(cfg) * tokens + 2 * cfg.vocab_size * cfg.hidden_size * sampled_rows + attn_keys_flops


def decode_floor_s(cfg: ModelConfig, batch: int, context: int, peak_bw: float) -> float:
    return (decode_weight_bytes(cfg, batch) + kv_bytes(cfg, batch * context)) / peak_bw


def prefill_floor_s(cfg: ModelConfig, tokens: int, peak_flops: float, num_seqs: int = 1) -> float:
    per_seq = tokens // num_seqs
    flops = step_flops(cfg, tokens, num_seqs, num_seqs * attention_flops(cfg, per_seq))
    return flops / peak_flops


def roofline_rows(
    cfg: ModelConfig,
    batches: Sequence[int],
    context: int,
    prefill_lens: Sequence[int],
    peak_bw: float,
    peak_flops: float | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    decode = []
    for b in batches:
        wb, kb = decode_weight_bytes(cfg, b), kv_bytes(cfg, b * context)
        fl = step_flops(cfg, b, b, b * attention_flops(cfg, 1, context - 1))
        decode.append(
            dict(
                batch=b, context=context, weight_bytes=wb, kv_bytes=kb, bw_floor_s=(wb + kb) / peak_bw,
                flops=fl, compute_floor_s=fl / peak_flops if peak_flops else None,
                max_tok_s=b / max((wb + kb) / peak_bw, fl / peak_flops if peak_flops else 0.0),
            )
        )  # fmt: skip
    prefill = []
    for n in prefill_lens:
        fl = step_flops(cfg, n, 1, attention_flops(cfg, n))
        floor = fl / peak_flops if peak_flops else None
        prefill.append(dict(tokens=n, flops=fl, compute_floor_s=floor, max_tok_s=n / floor if floor else None))
    return decode, prefill


# --- CLI -----------------------------------------------------------------------------------------------


def add_peak_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peak-gbs", type=float, help="peak memory bandwidth in GB/s (default: measured copy bandwidth)")
    p.add_argument(
        "--peak-tflops",
        type=float,
        help=f"peak FLOP/s in TFLOP/s (default: device table; CPU {CPU_FLOPS_PER_CORE / 1e9:.0f} GFLOP/s per core)",
    )


def resolve_peaks(args: argparse.Namespace, dtype: str) -> tuple[float, str, float | None, str]:
    """(bytes/s, where it came from, FLOP/s or None, where it came from)."""
    if args.peak_gbs:
        bw, bw_src = args.peak_gbs * 1e9, "--peak-gbs"
    else:
        bw, bw_src = measure_copy_bandwidth(), "measured: jitted in-place x + 1, read + write bytes"
    if args.peak_tflops:
        return bw, bw_src, args.peak_tflops * 1e12, "--peak-tflops"
    flops = default_peak_flops(dtype)
    src = "device table" if flops else "unknown device (give --peak-tflops)"
    if flops and jax.default_backend() == "cpu":
        src = f"{CPU_FLOPS_PER_CORE / 1e9:.0f} GFLOP/s per core x {os.cpu_count()} (ANCHORS.md)"
    return bw, bw_src, flops, src


def model_config(args: argparse.Namespace) -> ModelConfig:
    if args.shape:
        return shape_config(args.shape, args.dtype or "bfloat16")
    from jaxinfer.weights import load_weights

    cfg, params, _ = load_weights(args.model, dtype=args.dtype or "float32")
    del params
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks.roofline", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="model name or path (ignored with --shape)")
    p.add_argument("--shape", help="random-weight shape instead of --model: " + ", ".join(SHAPES))
    p.add_argument("--dtype", help="float32 (default for --model) or bfloat16 (default for --shape)")
    p.add_argument("--batch", default="1,8,32", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="decode context per row")
    p.add_argument("--prefill-len", default="128,512,2048", help="prefill lengths (one sequence)")
    add_peak_flags(p)
    p.add_argument("--out", help="write JSON here")
    args = p.parse_args(argv)
    cfg = model_config(args)
    bw, bw_src, flops, flops_src = resolve_peaks(args, cfg.dtype)
    decode, prefill = roofline_rows(cfg, int_list(args.batch), args.context, int_list(args.prefill_len), bw, flops)
    print(
        f"{args.shape or args.model}: {num_params(cfg) / 1e6:.1f}M params ({cfg.dtype}), "
        f"{decode_weight_bytes(cfg, 1) / 2**20:.0f} MiB read per decode step, "
        f"KV {kv_bytes(cfg, 1) / 1024:.1f} KiB/token\n"
        f"peak bandwidth {bw / 1e9:.1f} GB/s ({bw_src}); peak {(flops or 0) / 1e12:.3f} TFLOP/s ({flops_src})"
    )
    print("\n== decode floor (bandwidth: weights + live KV; compute: 2 * params * rows + attention)")
    print(
        format_table(
            ["B", "ctx", "weights_MiB", "kv_MiB", "bw_floor_ms", "compute_floor_ms", "max_tok/s"],
            [
                [
                    str(r["batch"]), str(r["context"]), f"{r['weight_bytes'] / 2**20:.0f}",
                    f"{r['kv_bytes'] / 2**20:.1f}", f"{r['bw_floor_s'] * 1e3:.3f}",
                    "-" if r["compute_floor_s"] is None else f"{r['compute_floor_s'] * 1e3:.3f}",
                    f"{r['max_tok_s']:.0f}",
                ]
                for r in decode
            ],
        )
    )  # fmt: skip
    print("\n== prefill floor (compute: 2 * block params * tokens + LM head for one row + causal attention)")
    print(
        format_table(
            ["tokens", "GFLOP", "compute_floor_ms", "max_tok/s"],
            [
                [
                    str(r["tokens"]), f"{r['flops'] / 1e9:.1f}",
                    "-" if r["compute_floor_s"] is None else f"{r['compute_floor_s'] * 1e3:.2f}",
                    "-" if r["max_tok_s"] is None else f"{r['max_tok_s']:.0f}",
                ]
                for r in prefill
            ],
        )
    )  # fmt: skip
    if args.out:
        meta = metadata("benchmarks.roofline", args, argv)
        meta.update(peak_bytes_per_s=bw, peak_bw_source=bw_src, peak_flops=flops, peak_flops_source=flops_src)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, decode=decode, prefill=prefill), f, indent=1)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
