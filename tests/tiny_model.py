"""The tiny random-weight Llama (SmolLM2's vocabulary and tokenizer) that every test of a live server, client or
notebook runs, and the one set of engine settings they all use; and the one set the tests that run the real SmolLM2
(engine tests and the live API server) use.

One model and one set of settings: the steps the first server compiles are in the persistent XLA cache, and every
later server, in-process engine and notebook kernel loads them instead of compiling its own (~2 s a step on the CI
machine class, 12 steps a server).
"""

from __future__ import annotations

from pathlib import Path

# The default model's (SmolLM2's) settings for every test that runs it through LLM(), an Engine or the live API
# server (tests/server/conftest.py): the steps the engine tests compile, the server's warm-up loads.
SMOLLM2_SETTINGS = {"num_kv_tokens": 4096, "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 64}

# The tiny model's settings, as LLM()/EngineArgs keywords: the notebooks' small ones (notebooks/*.ipynb, which
# tests/notebooks runs on this model), so their engines and server load these steps too.
SETTINGS = {"max_model_len": 256, "num_kv_tokens": 2048, "max_num_seqs": 4, "max_num_batched_tokens": 32}


def settings_flags(settings: dict | None = None) -> list[str]:
    """`settings` (default: SETTINGS) as serve.py / `jaxinfer serve` flags."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in (SETTINGS if settings is None else settings).items()]


def write_tiny_model(path: Path) -> None:
    """A jaxinfer checkpoint at `path` whose tokenizer comes from the default model's GGUF (its source)."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.model import init_params
    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.weights.checkpoint import save_checkpoint

    cfg = ModelConfig(arch="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)  # fmt: skip
    save_checkpoint(path, cfg, init_params(cfg, seed=0), source={"kind": "gguf", "path": str(smollm2_gguf())})
