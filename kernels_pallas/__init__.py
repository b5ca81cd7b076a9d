"""Paged-attention kernels (Pallas: Triton for GPU, Mosaic for TPU) with pure-jnp references.

Use the dispatching entry points; see README.md for shapes and the dispatch order.
"""

from kernels_pallas.common import POOL_LANE_MULTIPLE, UnsupportedCase, pool_shape
from kernels_pallas.dispatch import (
    IMPLS,
    decode_implementation,
    finish_builds,
    paged_decode_attention,
    prepare,
    ragged_implementation,
    ragged_paged_attention,
)
from kernels_pallas.reference import write_kv

__all__ = [
    "IMPLS",
    "POOL_LANE_MULTIPLE",
    "UnsupportedCase",
    "decode_implementation",
    "finish_builds",
    "paged_decode_attention",
    "pool_shape",
    "prepare",
    "ragged_implementation",
    "ragged_paged_attention",
    "write_kv",
]
