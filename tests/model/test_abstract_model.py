"""abstract_model builds its modules with shape-only parameters (layers.abstract_params) instead of tracing every
initializer under nnx.eval_shape: the same graphdef (its repr too, which keys the executable cache), and every
parameter's shape, dtype, type and sharding metadata."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from jaxinfer.config import ModelConfig
from jaxinfer.model.transformer import Transformer, abstract_model

BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=256)  # fmt: skip


@pytest.mark.parametrize("features", [
    dict(arch="llama", tie_word_embeddings=False),
    dict(arch="llama", tie_word_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True, dtype="bfloat16"),
    dict(arch="qwen3", qk_norm=True),
    dict(arch="gemma3", qk_norm=True, sandwich_norm=True, norm_offset=1.0, embed_scale=True, activation="gelu_tanh",
         layer_windows=(5, 0, 5)),
])  # fmt: skip
def test_abstract_model_is_what_eval_shape_gives(features):
    cfg = ModelConfig(**BASE, **features)
    graphdef, state = abstract_model(cfg)
    want_graphdef, want_state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    assert graphdef == want_graphdef
    # The executable cache keys on these reprs: equal objects whose metadata dicts are ordered differently miss.
    assert repr(graphdef) == repr(want_graphdef)
    assert str(jax.tree.structure(state)) == str(jax.tree.structure(want_state))
    got, want = dict(nnx.to_flat_state(state)), dict(nnx.to_flat_state(want_state))
    assert got.keys() == want.keys()
    for path, variable in got.items():
        expected = want[path]
        value, want_value = variable.get_value(), expected.get_value()
        assert isinstance(value, jax.ShapeDtypeStruct), path
        assert (type(variable), value.shape, value.dtype) == (type(expected), want_value.shape, want_value.dtype)
        assert variable.get_metadata() == expected.get_metadata(), path
