"""Plain `LLM()` on whatever device jax picks: the user's path (build_engine, dtype auto, pool sizing, start-up log).

Prints the backend, the dtype chosen, a chat reply, tokens/s of a 32-prompt greedy batch, and the compilations the
second batch caused (a steady workload compiles nothing). Run by scripts/device_check.sh on a lent GPU.
"""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.runner import compile_count


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    t0 = time.perf_counter()
    llm = LLM()
    device = f"{jax.default_backend()} ({jax.devices()[0].device_kind})"
    print(f"LLM() ready in {time.perf_counter() - t0:.1f} s on {device}")
    print("dtype:", llm.engine.cfg.dtype)
    reply = llm.chat([{"role": "user", "content": "Name three colours."}], SamplingParams(max_tokens=24, temperature=0))
    print("chat:", repr(reply[0].outputs[0].text))
    rng = np.random.default_rng(0)
    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for round_ in (1, 2):
        prompts = [rng.integers(3, 40000, int(n)).tolist() for n in rng.integers(16, 257, 32)]
        before, t0 = compile_count(), time.perf_counter()
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"round {round_}: {toks / dt:.0f} output tok/s, {compile_count() - before} compilations")
    llm.close()


if __name__ == "__main__":
    main()
