"""What the loops offer a stack of g-nets: whether they can generate it here (and if not,
why), and where its weights land.

The dispatcher's `cpu-loops` path (`gbfunc.generate.cpu_loops`) asks these two through
`gbfunc.cpu`'s public names, so that its rule reads none of this package's modules' limits.
(The C sub-ops that the `torch` path's traced forms call, `_relu_loops`, and the hashed
tables' gradient, `_hash_gradient`, say where they run by their own predicates:
`sums_usable`, `layer_usable`, `one_output_usable`, and `_hash_gradient.usable`.)
"""

from collections.abc import Sequence

import torch

from .._plan import Generated, Stack
from ._build import unavailable_reason
from ._hash_weights import usable as table_usable
from ._relu_loops import MIN_UNITS
from ._relu_rows import (
    MAX_OUTPUTS,
    MAX_UNITS,
    Placement,
    placement as rows_placement,
    suits,
    usable,
)


def refusal(stack: Stack, dtype: torch.dtype, device_type: str, *, detail: bool) -> str | None:
    """Why the loops cannot generate `stack` from leaves of `dtype` on `device_type` (None:
    they can): its g-nets, the dtype or device, or the loops' build. `detail`: the exact
    reason, where otherwise a fixed string is enough (the hot path and traced code)."""
    if not suits(stack):
        return "its g-nets are not one-layer ReLU row or one-output g-nets, one per tile"
    units, outputs = stack.genome.hidden, stack.outputs
    hashed_ok = not stack.genome.hashed or table_usable(dtype, device_type)
    if hashed_ok and usable(units, outputs, dtype, device_type, stack.columns):
        return None
    if not detail:
        return "no C loops for these g-nets here"
    if device_type != "cpu" or dtype != torch.float32:
        return f"the loops take CPU float32; the g-nets are {dtype} on {device_type}"
    reason = unavailable_reason()
    if reason:
        return f"the CPU loops are off: {reason}"
    return (
        f"no loops for {units} units and {outputs} outputs (row g-nets: "
        f"{MIN_UNITS}-{MAX_UNITS} units, up to {MAX_OUTPUTS} outputs)"
    )


def placement(stack: Stack, params: Sequence[Generated]) -> Placement | None:
    """Where the loops write `stack`'s weights `params` (the parameters it generates, each
    whole); None where its g-nets are not what the loops compute or a parameter is centred."""
    return rows_placement(stack, params) if suits(stack) else None
