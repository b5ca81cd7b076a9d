"""A user-defined decoder that is none of the built-in families: two parallel attention/MLP blocks (GPT-J style),
LayerNorm instead of RMSNorm, learned absolute positions instead of RoPE, a plain GELU MLP, tied embeddings. Its
vocabulary is a prefix of SmolLM2's, so SmolLM2's tokenizer decodes its ids.

It follows jaxinfer.model.protocol, and carries logical axis names on its kernels so tensor parallelism applies.
`build` is the entry point `serve.py --model tests.model.byo_model:build` would load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import ModelConfig

CONFIG = ModelConfig(arch="custom", vocab_size=4096, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)  # fmt: skip


def _linear(din: int, dout: int, axes: tuple[str, str], rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=False, rngs=rngs, kernel_init=nnx.initializers.normal(0.5),
                      kernel_metadata={"out_sharding": axes, "eager_sharding": False})  # fmt: skip


class ParallelBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, rngs: nnx.Rngs):
        d, h, kv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.index, self.heads = index, (h, kv, dh)
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.q = _linear(d, h * dh, ("embed", "q_heads"), rngs)
        self.kv = _linear(d, 2 * kv * dh, ("embed", "kv_heads"), rngs)
        self.o = _linear(h * dh, d, ("q_heads", "embed"), rngs)
        self.up = _linear(d, cfg.intermediate_size, ("embed", "mlp"), rngs)
        self.down = _linear(cfg.intermediate_size, d, ("mlp", "embed"), rngs)

    def __call__(self, x, attend, cache):
        b, t, _ = x.shape
        h, kv, dh = self.heads
        y = self.norm(x)
        q = self.q(y).reshape(b, t, h, dh)
        k, v = jnp.split(self.kv(y).reshape(b, t, 2 * kv, dh), 2, axis=2)
        attn, cache = attend(self.index, q, k, v, cache)
        # Attention and MLP read the same normed input and are added together (parallel block).
        return x + self.o(attn.reshape(b, t, h * dh)) + self.down(jax.nn.gelu(self.up(y))), cache


class ParallelLM(nnx.Module):
    def __init__(self, cfg: ModelConfig = CONFIG, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, embedding_init=nnx.initializers.normal(1.0))
        self.pos = nnx.Embed(cfg.max_position_embeddings, cfg.hidden_size, rngs=rngs)
        self.blocks = nnx.List([ParallelBlock(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.norm = nnx.LayerNorm(cfg.hidden_size, rngs=rngs)

    def __call__(self, token_ids, positions, kv_cache, attend):
        x = self.embed(token_ids) + self.pos(positions)
        new_cache = []
        for block, c in zip(self.blocks, kv_cache, strict=True):
            x, c = block(x, attend, c)
            new_cache.append(c)
        return self.norm(x), new_cache

    def logits(self, hidden):
        return self.embed.attend(hidden).astype(jnp.float32)


def model() -> ParallelLM:
    return ParallelLM(rngs=nnx.Rngs(0))


def build() -> tuple[ParallelLM, str]:
    """The entry point: the module and the tokenizer to serve it with (a Tokenizer, or a model name or path)."""
    return model(), "smollm2-135m-instruct"
