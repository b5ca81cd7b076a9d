"""The tiny model and workload shared by the two-process test and its single-process reference."""

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model import init_params
from jaxinfer.types import SamplingParams
from jaxinfer.weights.layout import hf_name

CC = dict(page_size=8, num_pages=32, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
PROMPTS = [[5, 9, 17], list(range(1, 24)), [42] * 9]
SAMPLING = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=5, temperature=0.9, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)]  # fmt: skip


def tiny_config() -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, max_position_embeddings=128)  # fmt: skip


def host_getter(cfg: ModelConfig):
    """The same random weights in every process (numpy RNG), served through HF names."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        params = jax.tree.map(np.asarray, init_params(cfg, seed=4, std=0.4))
    return getter_for(cfg, params)


def getter_for(cfg: ModelConfig, params):
    """Serves host params in our layout back in PyTorch layout by HF name, so tests place them through the real
    loading path (`jaxinfer.weights.layout.build_on_mesh`)."""
    table = {}

    def walk(tree, path):
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, (*path, k))
        elif isinstance(tree, list):
            for i, v in enumerate(tree):
                walk(v, (*path, i))
        else:
            table[hf_name(cfg, path)] = _torch_layout(path[-1], tree)

    walk(params, ())
    return table.get


def _torch_layout(key: str, x: np.ndarray) -> np.ndarray:
    if key in ("q", "k", "v"):
        return x.reshape(x.shape[0], -1).T
    if key == "o":
        return x.reshape(-1, x.shape[-1]).T
    if key in ("lm_head", "gate", "up", "down"):
        return x.T
    return x
