"""Run in a fresh process by test_exec_cache.py: a tiny engine on a given cache dir; prints one JSON line."""

from __future__ import annotations

import json
import logging
import os
import sys

from jaxinfer.engine import exec_cache
from jaxinfer.engine.runner import compile_count, enable_compilation_cache


def main(cache_dir: str, norm_eps: float, defer: bool) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if os.environ.get("EXEC_CACHE_CHILD_SOURCE"):  # another jaxinfer's source, whose steps are the same programs
        exec_cache.source_hash = lambda: os.environ["EXEC_CACHE_CHILD_SOURCE"]
    enable_compilation_cache(cache_dir)
    from jaxinfer.config import ModelConfig
    from jaxinfer.engine.config import CacheConfig
    from jaxinfer.engine.engine import Engine
    from jaxinfer.model import init_params
    from jaxinfer.types import SamplingParams

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=256, norm_eps=norm_eps)  # fmt: skip
    cache = CacheConfig(block_size=4, num_pages=40, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16)
    eng = Engine(cfg, init_params(cfg, seed=0, std=0.5), cache, eos_token_ids=(), seed=0)
    before = compile_count()  # the pool's zero-fill and init_params' ops are compiled (or cache-read) above
    ec = eng.runner.exec_cache
    out = {}
    if defer:  # as the server's core: every variant, the rarer ones deferred where the cache lacks them
        eng.runner.warmup(advanced=True, prompt_logprobs=True, defer=True)
        out.update(deferred=len(eng.runner.deferred), ready_programs=ec.loaded + ec.compiled)
    else:
        eng.runner.warmup(advanced=False)
    prompts = [[5, 9, 2, 33], list(range(2, 30)), [7]]
    sps = [SamplingParams(max_tokens=8, temperature=t, seed=3, ignore_eos=True) for t in (0.0, 1.0, 0.0)]
    outs = eng.generate(prompts, sps)
    out["tokens"] = [o[0].output_token_ids for o in outs]
    if defer:
        rare = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, seed=1, ignore_eos=True),
                SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1, ignore_eos=True)]  # fmt: skip
        rare_tokens = [o[0].output_token_ids for o in eng.generate(prompts[:2], rare)]  # before they compiled
        while eng.runner.compile_deferred():
            pass
        settled = compile_count()
        again = [o[0].output_token_ids for o in eng.generate(prompts[:2], rare)]
        out.update(compiles_after_deferred=compile_count() - settled, rare_same=again == rare_tokens)
    print(json.dumps({
        "step_compiles": compile_count() - before,
        "loaded": ec.loaded,
        "compiled": ec.compiled,
        "not_stored": ec.not_stored,
        **out,
    }))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3:] == ["defer"])
