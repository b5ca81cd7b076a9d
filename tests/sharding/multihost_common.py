"""The tiny model and workload shared by the two-process test and its single-process reference."""

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model import init_params
from jaxinfer.types import SamplingParams
from jaxinfer.weights.layout import hf_name, to_torch_layout

CC = dict(block_size=8, num_pages=32, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
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
    """Serves host params (an nnx state) back in PyTorch layout by HF name, so tests place them through the real
    loading path (`jaxinfer.weights.layout.build_on_mesh`)."""
    table = {hf_name(cfg, path): to_torch_layout(path, np.asarray(v[...])) for path, v in params.flat_state()}
    return table.get
