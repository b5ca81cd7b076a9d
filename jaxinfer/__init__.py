"""jaxinfer: a JAX/XLA LLM inference engine.

from jaxinfer import LLM, SamplingParams
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestsFailedError", "BeamSearchParams",
           "StructuredOutputsParams"]  # fmt: skip


def __getattr__(name: str) -> Any:
    # Lazy, so that host-only modules (types, scheduler, tokenizer) can be imported without initialising jax.
    if name == "LLM":
        from jaxinfer.host_memory import gc_paused

        with gc_paused():  # importing jax and flax makes ~200k objects that live as long as the process
            from jaxinfer.llm import LLM
        return LLM
    if name in (
        "SamplingParams",
        "RequestOutput",
        "CompletionOutput",
        "RequestsFailedError",
        "StructuredOutputsParams",
    ):
        from jaxinfer import types

        return getattr(types, name)
    if name == "BeamSearchParams":
        from jaxinfer.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
