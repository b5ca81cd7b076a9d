"""jaxinfer: a JAX/XLA LLM inference engine.

from jaxinfer import LLM, SamplingParams
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    # Lazy, so that host-only modules (types, scheduler, tokenizer) can be imported without initialising jax.
    if name == "LLM":
        from jaxinfer.llm import LLM

        return LLM
    if name in ("SamplingParams", "RequestOutput", "CompletionOutput"):
        from jaxinfer import types

        return getattr(types, name)
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
