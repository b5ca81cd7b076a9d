"""Start-up that shows itself: a progress bar while the step buckets compile, then one summary block saying what
the user got (model, dtype, devices, mesh, attention kernels, KV capacity, buckets, time to ready).

Used by the server's engine process and by `LLM(..., warmup=True)`. The bar goes to stderr and hides itself when
stderr is not a terminal (logs stay clean); the summary is logged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from jaxinfer.cache.sizing import format_bytes
from jaxinfer.host_memory import gc_paused


@dataclass
class WarmupReport:
    seconds: float
    buckets: int  # compiled step programs (shape buckets x sampling variants), over every replica
    deferred: int = 0  # programs left to load or compile while the engine is idle (warm_up's `defer`)


@gc_paused()  # loading or compiling every step allocates as the build does (see gc_paused)
def warm_up(engine: Any, show: bool | None = None, prompt_logprobs: bool = False, defer: bool = False) -> WarmupReport:
    """Compiles every step bucket of every replica with a progress bar counting buckets (with `prompt_logprobs`
    also the variants that score prompt tokens). `show`: None = when stderr is a terminal. `defer`: the fewer-row
    mixed steps and the rarer sampling variants are left for `compile_deferred` to load or compile (see
    `ModelRunner.warmup`)."""
    replicas = getattr(engine, "replicas", [engine])
    t0 = time.perf_counter()
    compiled = 0
    with tqdm(desc="Compiling step buckets", unit="bucket", disable=None if show is None else not show) as bar:

        def tick(done: int, total: int) -> None:
            nonlocal compiled
            compiled += 1  # counted here: a disabled bar counts nothing
            bar.total = total * len(replicas)
            bar.update(1)

        for r in replicas:
            r.runner.warmup(prompt_logprobs=prompt_logprobs, progress=tick, defer=defer)
    return WarmupReport(time.perf_counter() - t0, compiled, pending_compiles(engine))


def pending_compiles(engine: Any) -> int:
    """Step programs `warm_up(defer=True)` left, over every replica."""
    return sum(len(r.runner.deferred) for r in getattr(engine, "replicas", [engine]))


def compile_deferred(engine: Any) -> int:
    """Compiles one program `warm_up(defer=True)` left (the first replica's that has any); returns how many are
    left over every replica. The engine core calls it while idle."""
    for r in getattr(engine, "replicas", [engine]):
        if r.runner.deferred:
            r.runner.compile_deferred()
            break
    return pending_compiles(engine)


def prepare_grammars(engine: Any) -> bool:
    """Builds what structured outputs read of the tokenizer (`GrammarCompiler.prepare`: up to a second or two for a
    large vocabulary) unless it is built; returns whether it did. The engine core calls it while idle."""
    grammars = getattr(getattr(engine, "replicas", [engine])[0], "grammars", None)  # None: an engine without them
    if grammars is None or grammars.prepared:
        return False
    grammars.prepare()
    return True


def attention_kernels(runner: Any) -> str:
    """Which implementation the decode and the mixed (ragged) steps use on this backend, for these pools."""
    import jax
    import jax.numpy as jnp

    import kernels_pallas

    cfg, pool = runner.cfg, runner.kv[0][0]  # stored rows (kernels_pallas.pool_shape): the kernels' checks see heads
    k = v = jax.ShapeDtypeStruct((*pool.shape[:2], cfg.num_kv_heads, cfg.head_dim), pool.dtype)
    q = jax.ShapeDtypeStruct((runner.cc.max_num_seqs, cfg.num_heads, cfg.head_dim), jnp.dtype(cfg.dtype))
    decode = kernels_pallas.decode_implementation(q, k, v, runner.attn_impl)
    ragged = kernels_pallas.ragged_implementation(q, k, v, runner.attn_impl)
    return f"decode {decode}, mixed {ragged}"


def summary(engine: Any, model: str, load_s: float, warm: WarmupReport, ready_s: float | None = None) -> str:
    """The block printed once the engine is ready."""
    import jax

    replicas = getattr(engine, "replicas", [engine])
    runner, cc = replicas[0].runner, replicas[0].cc
    cfg = runner.cfg
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    mesh = runner.mesh
    mesh_text = "single device" if mesh is None else " x ".join(f"{k}={v}" for k, v in mesh.shape.items())
    tokens = runner.num_kv_tokens
    full_seqs = tokens // cc.max_model_len
    # The pools as allocated, at their own dtype (a float32 model's pool is float16 on CPU by default).
    kv_bytes = runner.num_pages * runner.page_bytes
    params = sum(x.size for x in jax.tree.leaves(runner.params))
    rows = [
        ("model", f"{model} ({cfg.arch}, {cfg.num_layers} layers, {params / 1e6:.0f}M parameters)"),
        ("dtype", str(cfg.dtype)),
        ("backend", f"{jax.default_backend()}: {len(devices)} device(s), {', '.join(kinds)}"),
        ("mesh", f"{mesh_text}" + (f" per replica; {len(replicas)} replicas" if len(replicas) > 1 else "")),
        ("attention", f"{attention_kernels(runner)}; layers {runner.layer_loop}"),
        (
            "KV cache",
            f"{tokens} tokens ({runner.num_pages} pages x {cc.block_size}, {format_bytes(kv_bytes)}) per "
            f"replica = {full_seqs} sequences at max_model_len {cc.max_model_len}; "
            f"max_num_seqs {cc.max_num_seqs}",
        ),  # fmt: skip
        (
            "buckets",
            f"{warm.buckets} compiled in {warm.seconds:.1f}s (decode batch {runner.seq_buckets}, "
            f"mixed tokens {runner.token_buckets} on rows {runner.buckets.mixed_seq_buckets})"
            + (f"; {warm.deferred} more variants load or compile while idle" if warm.deferred else ""),
        ),  # fmt: skip
        ("load", f"{load_s:.1f}s (weights, KV pool)"),
    ]
    if ready_s is not None:
        rows.append(("ready in", f"{ready_s:.1f}s since the process started"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(["jaxinfer is ready", *(f"  {k:<{width}}  {v}" for k, v in rows)])


def seconds_since_start(pid: int | None = None) -> float | None:
    """Seconds since process `pid` (default: this one) started, when psutil can tell."""
    try:
        import psutil
    except ImportError:
        return None
    return time.time() - psutil.Process(pid).create_time()
