"""Decoder transformer families as Flax NNX modules, and the protocol a user module follows to be served."""

from jaxinfer.model.transformer import (
    AttentionFn,
    Params,
    Transformer,
    abstract_model,
    check_params,
    forward,
    init_params,
    logits,
)

__all__ = [
    "AttentionFn",
    "Params",
    "Transformer",
    "abstract_model",
    "check_params",
    "forward",
    "init_params",
    "logits",
]
