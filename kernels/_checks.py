"""Argument checks of the launchers: every error names the argument, what arrived and what fits.

The launchers take raw, contiguous tensors; the autograd ops in `gbfunc.kernels` make their
inputs contiguous first, so these checks guard direct launcher calls and the library's own
invariants alike.
"""

from typing import NamedTuple

import torch
from torch import Tensor

from gbfunc._plan import Generated, Stack

from . import _placement, _runtime


def expected_shapes(stack: Stack, numel: int) -> dict[str, tuple[int, ...] | None]:
    """Per-genome shape of every launcher argument (`None`: must be `None`)."""
    t, (th, _), h, p = stack.num_tiles, stack.tile, stack.genome.hidden, stack.outputs
    deep = stack.genome.depth - 1
    return {
        "grad": (numel,),
        "a": (t, th, h),
        "b": (t, stack.columns, h),
        "c": (t, h),
        "w_hidden": (t, deep, h, h) if deep else None,
        "b_hidden": (t, deep, h) if deep else None,
        "w_out": (t, h, p),
        "b_out": (t, p),
    }


# The dtypes the kernels take here, as errors name them.
_DTYPES = ", ".join(str(d).removeprefix("torch.") for d in _runtime.DTYPES)


class Launch(NamedTuple):
    """What a kernel launch takes beside the g-net tensors: where each tile lands (`(T, 4)`
    places, `(T,)` scales: `_placement.placement_tensors`), the size of the stack's flat
    output, and its g-nets' outputs per evaluation and activation."""

    places: Tensor
    scales: Tensor
    numel: int
    outputs: int
    activation: str


def check_launch(
    where: str, stack: object, params: object, tensors: dict[str, Tensor | None]
) -> Launch:
    """Raise unless `stack`, `params` and `tensors` fit together and this device; what the
    launch takes beside the tensors."""
    if not isinstance(stack, Stack):
        raise TypeError(
            f"{where}: stack must be a gb.Stack (from plan.stacks), got {type(stack).__name__}."
        )
    if not (isinstance(params, tuple) and all(isinstance(p, Generated) for p in params)):
        raise TypeError(
            f"{where}: params must be a tuple of gb.Generated (the stack's, in plan order), "
            f"got {params!r}."
        )
    if (beyond := _beyond_limits(stack)) is not None:
        raise ValueError(f"{where}: stack {stack.key!r} has {beyond}. Use backend='torch'.")
    _, _, numel = _placement.placement(stack, params)
    shapes = expected_shapes(stack, numel)
    first = tensors["a"]
    if not isinstance(first, Tensor):
        raise TypeError(f"{where}: a must be a Tensor, got {type(first).__name__}.")
    if first.dtype not in _runtime.DTYPES:
        raise TypeError(f"{where}: a has dtype {first.dtype}; the kernels take {_DTYPES} here.")
    _runtime.check_runnable(where, first.device)
    batch = tuple(first.shape[:-3])
    for name, x in tensors.items():
        shape = shapes[name]
        if shape is None or x is None:
            if shape is not None or x is not None:
                want = "None" if shape is None else f"a Tensor of shape {(*batch, *shape)}"
                raise ValueError(f"{where}: {name} must be {want} for depth {stack.genome.depth}.")
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"{where}: {name} must be a Tensor, got {type(x).__name__}.")
        if x.dtype != first.dtype:
            raise TypeError(f"{where}: {name} has dtype {x.dtype}; expected {first.dtype}, like a.")
        if x.device != first.device:
            raise ValueError(f"{where}: {name} is on {x.device}; expected {first.device}, like a.")
        if tuple(x.shape) != (*batch, *shape):
            raise ValueError(
                f"{where}: {name} has shape {tuple(x.shape)}; expected {(*batch, *shape)} "
                f"for stack {stack.key!r}. Was it made for another stack?"
            )
        if not x.is_contiguous():
            raise ValueError(
                f"{where}: {name} is not contiguous (strides {x.stride()}); pass "
                f"{name}.contiguous(), or call gbfunc.kernels.generate, which does."
            )
    places, scales = _placement.placement_tensors(stack, params, first.device)
    return Launch(places, scales, numel, stack.outputs, stack.genome.activation)


def refusal(stack: Stack, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot generate `stack` in `dtype` (None: they can).

    The one statement of the kernels' limits: `gb.apply`'s Triton rule reads it to send such
    a stack to torch (`backend="auto"`), and the launchers (`check_launch`) to refuse it.
    """
    if (beyond := _beyond_limits(stack)) is not None:
        return beyond
    if dtype not in _runtime.DTYPES:
        return f"dtype {str(dtype).removeprefix('torch.')}; the kernels take {_DTYPES} here"
    return None


def _beyond_limits(stack: Stack) -> str | None:
    if stack.genome.hidden > _runtime.MAX_HIDDEN:
        return (
            f"genome.hidden={stack.genome.hidden} > {_runtime.MAX_HIDDEN} (the kernels keep a "
            "block of hidden units in registers)"
        )
    if stack.outputs > _runtime.MAX_OUTPUTS:
        return f"{stack.outputs} outputs > {_runtime.MAX_OUTPUTS} per evaluation"
    return None


def contiguous(x: Tensor | None) -> Tensor | None:
    """`x.contiguous()`, passing `None` through."""
    return None if x is None else x.contiguous()
