"""Builds the (Engine, Tokenizer) pair the server runs, from the same settings `jaxinfer.LLM` takes.

It is `jaxinfer.llm.build_engine`, the builder behind `LLM`, fed from the command line.
Imports of jax live inside the function so that the HTTP side starts listening before jax initialises.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from jaxinfer.server.args import ServerArgs

if TYPE_CHECKING:
    from jaxinfer.engine.engine import Engine
    from jaxinfer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

TIMELINE_WINDOW = 512  # steps the /metrics timeline gauges summarise


def build_engine(args: ServerArgs) -> tuple[Engine, Tokenizer]:
    from jaxinfer.llm import build_engine as build

    t0 = time.perf_counter()
    engine, tokenizer = build(
        args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_kv_tokens=args.num_kv_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=args.enable_prefix_caching, max_logprobs=args.max_logprobs, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size, data_parallel_size=args.data_parallel_size,
        compilation_cache=(args.compilation_cache_dir or True) if args.enable_compilation_cache else False,
        overlap_scheduling=args.overlap_scheduling, session_ttl=args.session_ttl,
        session_cache_pages=args.session_cache_pages, host_kv_cache_memory=args.host_kv_cache_memory,
    )  # fmt: skip
    log.info("model %s loaded in %.1fs", args.model, time.perf_counter() - t0)
    if args.step_timeline:
        from jaxinfer.engine.timeline import StepTimeline

        for e in getattr(engine, "replicas", [engine]):
            e.runner.timeline = StepTimeline(max_steps=TIMELINE_WINDOW)
    return engine, tokenizer
