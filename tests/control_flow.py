"""Finds the control flow of a lowered program whose predicate an accelerator reads on the host.

XLA:GPU runs a conditional by copying its predicate to the host and waiting for it, so the host stalls until
everything before it has run (a while loop does the same every iteration). A conditional whose selector is a
constant is inlined by XLA before it runs: `lax.platform_dependent` lowers to such cases, a constant platform index
selecting the branch of the lowering platform. This walks the StableHLO of `jax.jit(f).trace(...).lower(...)` and
returns every case, if or while that is not of that constant kind.
"""

from __future__ import annotations

import re

from jax._src.lib.mlir import ir

_BRANCHING = ("stablehlo.case", "stablehlo.if")


def _is_constant(value: ir.Value) -> bool:
    """A stablehlo.constant, or a branch whose selector is constant and whose every branch returns constants."""
    if isinstance(value.owner, ir.Block):
        return False  # a block (function) argument: not known here
    op = value.owner.operation
    if op.name == "stablehlo.constant":
        return True
    if op.name in _BRANCHING and _is_constant(op.operands[0]):
        index = list(op.results).index(value)
        return all(_is_constant(region.blocks[0].operations[-1].operands[index]) for region in op.regions)
    return False


def host_synced_control_flow(lowered) -> list[str]:
    """The data-dependent case/if/while ops of a `jax.stages.Lowered`, as short descriptions (empty: none)."""
    found: list[str] = []

    def walk(op: ir.Operation) -> None:
        name = op.name
        if name == "stablehlo.while" or (name in _BRANCHING and not _is_constant(op.operands[0])):
            where = re.search(r'loc\("([^"]*)"', str(op.location))
            found.append(f"{name} at {where.group(1) if where else op.location}")
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    walk(inner.operation)

    module = lowered.compiler_ir("stablehlo")
    for op in module.body.operations:
        walk(op.operation)
    return found
