"""Version shims for the Pallas Triton backend (jax 0.10.x and 0.11.x).

jax 0.10 makes Mosaic GPU the default Pallas GPU backend and 0.11 deprecates Triton, so every GPU
kernel here names Triton explicitly through its CompilerParams class. Imported lazily so that a jax
without the Triton backend only loses the GPU kernels (they raise UnsupportedCase), not the package.
"""

from __future__ import annotations

import inspect
from typing import Any

from jax.experimental import pallas as pl

from kernels_pallas.common import UnsupportedCase


def triton_module() -> Any:
    try:
        from jax.experimental.pallas import triton as plgpu
    except ImportError as e:  # pragma: no cover - depends on the installed jax
        raise UnsupportedCase(f"Pallas Triton backend unavailable: {e}") from e
    return plgpu


def triton_call_kwargs(num_warps: int, num_stages: int) -> dict[str, Any]:
    """Keyword arguments for ``pl.pallas_call`` that select the Triton lowering."""
    plgpu = triton_module()
    kwargs: dict[str, Any] = {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
    # Some jax versions grew an explicit backend argument; name it where it exists.
    if "backend" in inspect.signature(pl.pallas_call).parameters:
        kwargs["backend"] = "triton"
    return kwargs


def masked_store(
    ref: Any,  # Ref f[*shape] (a slice view, e.g. ``o_ref.at[pl.ds(start, n)]``)
    value: Any,  # f[*shape]
    mask: Any,  # bool[*shape]; False elements are left untouched in memory
) -> None:
    triton_module().store(ref, value, mask=mask)
