"""Decoder transformer families as pure functions over a params pytree."""

from jaxinfer.model.transformer import (
    AttentionFn,
    Params,
    check_params,
    forward,
    init_params,
    logits,
    param_axes,
    param_shapes,
)

__all__ = [
    "AttentionFn",
    "Params",
    "check_params",
    "forward",
    "init_params",
    "logits",
    "param_axes",
    "param_shapes",
]
