"""Tensors as buffers of their own in graphs traced by `torch.compile`.

Generated parameters (`realised`):
Traced, a generated parameter is a chain of pointwise ops (layout, hashed values, scale) on
the g-nets' output. A matmul reads it from a buffer, so inductor computes it into one; a
pointwise consumer, an embedding lookup, would inline the whole chain, and inductor then
stores the lookup's result, read by several kernels, rather than recompute it in each:
activation-sized buffers a plain model's graph does not hold (measured on the main job's
transformer: `benchmarks/results/design_measurements.md`).
"""

import torch
from torch import Tensor

from ._function import signature_once
from ._tracing import exporting, functions_traceable


def realised(weight: Tensor) -> Tensor:
    """`weight`, computed into a buffer of its own where a graph is being compiled (not
    exported: an exported graph keeps only standard ops), under transforms that dynamo traces
    an `autograd.Function` under (`functions_traceable`); itself otherwise."""
    if compiling_a_buffer() and functions_traceable():
        return _Realised.apply(weight)
    return weight


@signature_once
class _Realised(torch.autograd.Function):
    """The identity, with inductor's `force_stride_order` forward, given the tensor's own
    strides: inductor's lowering computes the tensor into a buffer; run op by op (other
    backends) it returns the tensor itself. The prim has no autograd formula or batching
    rule of its own; this gives it both."""

    @staticmethod
    def forward(weight: Tensor) -> Tensor:
        if torch.is_grad_enabled():
            # Dynamo inlined this forward without the backward (it does under vmap, with
            # leaves that require grad): the prim would be differentiated, and cannot be.
            return weight
        from torch._inductor import inductor_prims  # noqa: F401 (registers the prim)

        return torch.ops.prims.inductor_force_stride_order(weight, weight.stride())

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad

    @staticmethod
    def vmap(info, in_dims, weight: Tensor) -> tuple[Tensor, int | None]:
        return _Realised.apply(weight), in_dims[0]


def contiguous_buffer(x: Tensor) -> Tensor:
    """`x.contiguous()`, and in a graph being compiled without gradients (a Function's
    forward or backward), a buffer of that layout: inductor otherwise inlines the copy into
    each consumer, which then reads `x` in its old layout."""
    if compiling_a_buffer() and not torch.is_grad_enabled():
        from torch._inductor import inductor_prims  # noqa: F401 (registers the prim)

        return torch.ops.prims.inductor_force_stride_order(x, _contiguous_strides(x.shape))
    return x.contiguous()


def _contiguous_strides(shape: torch.Size) -> list[int]:
    """The strides of a contiguous tensor of `shape`, as `torch._prims_common`'s
    `make_contiguous_strides_for` gives them: written here because dynamo up to torch 2.11
    at least refuses to trace that one (it calls `is_nested_int`, marked as skipped)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = step * max(size, 1)
    return strides[::-1]


def compiling_a_buffer() -> bool:
    """Compiling (inductor's prims apply), not exporting (an exported graph keeps only
    standard ops)."""
    return torch.compiler.is_compiling() and not exporting()
