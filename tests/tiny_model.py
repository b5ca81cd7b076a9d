"""The tiny random-weight Llama (SmolLM2's vocabulary and tokenizer) that every test of a live server, client or
notebook runs, and the one set of engine settings they all use.

One model and one set of settings: the steps the first server compiles are in the persistent XLA cache, and every
later server, in-process engine and notebook kernel loads them instead of compiling its own (~2 s a step on the CI
machine class, 12 steps a server).
"""

from __future__ import annotations

from pathlib import Path

# The engine settings, as LLM()/EngineArgs keywords: the notebooks' small ones (notebooks/*.ipynb, which
# tests/notebooks runs on this model), so their engines and server load these steps too.
SETTINGS = {"max_model_len": 256, "num_kv_tokens": 2048, "max_num_seqs": 4, "max_num_batched_tokens": 32}


def settings_flags() -> list[str]:
    """SETTINGS as serve.py / `jaxinfer serve` flags."""
    return [f"--{k.replace('_', '-')}={v}" for k, v in SETTINGS.items()]


def write_tiny_model(path: Path) -> None:
    """A jaxinfer checkpoint at `path` whose tokenizer comes from the default model's GGUF (its source)."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.model import init_params
    from jaxinfer.model_files import smollm2_gguf
    from jaxinfer.weights.checkpoint import save_checkpoint

    cfg = ModelConfig(arch="llama", vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)  # fmt: skip
    save_checkpoint(path, cfg, init_params(cfg, seed=0), source={"kind": "gguf", "path": str(smollm2_gguf())})
