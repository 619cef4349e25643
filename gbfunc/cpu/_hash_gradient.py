"""The hashed tables' gradient on CPU as a C loop.

A hashed stack adds to each tile position one bucket of its tile's table, signed
(`_genome.hash_buckets`, packed as int32 `(bucket + 1) * sign`): forward a gather, backward a
scatter-add of the weights' gradient into the buckets. Torch's CPU scatter-add runs on one
thread, and inductor feeds it an int64 copy of the index and a float copy of the signed
gradient, written each step. `table_gradient` reads the packed index and the gradient as they
are, decodes a chunk of positions at a time (vectorised), then adds them into a table of
partial sums per thread. The measurements behind it are in
`benchmarks/results/design_measurements.md`.

`signed_gather` is the forward, an `autograd.Function` whose backward is this loop. Traced
by `torch.compile` under `torch.func.grad`, dynamo drops that backward and differentiates the
gather itself (torch's scatter-add) where the Function is applied to the transformed
function's own argument (pytorch/pytorch#193279): callers pass a view of the table leaf.
"""

import torch
from torch import Tensor

from .._function import signature_once
from .._spec import signed_buckets
from . import _build

_LOOP = _build.Loop("hash_table_gradient", "hash_table_gradient.cpp", pointers=3, sizes=4)


@torch.compiler.assume_constant_result
def usable(dtype: torch.dtype, device_type: str) -> bool:
    """Whether `table_gradient` runs its C loop: where `_build.vectorised_cpu` holds and
    the loop compiled."""
    return _build.vectorised_cpu(dtype, device_type) and _build.compiled_loop(_LOOP, 1) is not None


@torch.library.custom_op("gbfunc::hash_table_gradient", mutates_args=(), device_types="cpu")
def table_gradient(grad: Tensor, packed: Tensor, buckets: int) -> Tensor:
    """`_spec.gradient_reference(grad, packed, buckets)` by the C loop (`usable` must hold)."""
    tiles = grad.shape[0]
    grad, packed = grad.reshape(tiles, -1).contiguous(), packed.contiguous()
    positions = grad.shape[1]
    # A tile's positions are its rows.
    threads, splits = _build.threads_and_splits(tiles, positions)
    partial = grad.new_empty(tiles, splits, buckets)
    _build.launch(_LOOP, 1, 1, grad, packed, partial, tiles, positions, buckets, splits, threads)
    return _build.splits_added(partial)


@table_gradient.register_fake
def _(grad: Tensor, packed: Tensor, buckets: int) -> Tensor:
    return grad.new_empty(grad.shape[0], buckets)


@table_gradient.register_vmap
def _(info, in_dims: tuple, grad: Tensor, packed: Tensor, buckets: int) -> tuple:
    if in_dims[1] is not None:
        raise NotImplementedError("gbfunc: a hash is fixed by the plan; it cannot be batched.")
    (grad,) = _build.tiles_folded(info.batch_size, in_dims[:1], (grad,))
    return _build.tiles_unfolded(info.batch_size, table_gradient(grad, packed, buckets)), 0


def _save_hash(ctx, inputs: tuple, output) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.shape = inputs[0].shape


def _table_gradient_backward(ctx, outer: Tensor) -> tuple:
    """Double backward: the gradient is linear in `grad`, its adjoint the signed gather."""
    (packed,) = ctx.saved_tensors
    return signed_buckets(outer, packed).reshape(ctx.shape), None, None


table_gradient.register_autograd(_table_gradient_backward, setup_context=_save_hash)


@signature_once
class _SignedGather(torch.autograd.Function):
    """`signed_buckets` with `table_gradient` as its backward; composes with `grad`, `vmap`
    (through the op's vmap rule) and `torch.compile` (the forward traced, fused by inductor
    with what reads it; the backward opaque)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(table: Tensor, packed: Tensor) -> Tensor:
        return signed_buckets(table, packed)

    @staticmethod
    def setup_context(ctx, inputs: tuple, output: Tensor) -> None:
        table, packed = inputs
        ctx.save_for_backward(packed)
        ctx.buckets = table.shape[-1]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple:
        (packed,) = ctx.saved_tensors
        return table_gradient(grad, packed, ctx.buckets), None


def signed_gather(table: Tensor, packed: Tensor) -> Tensor:
    """`signed_buckets(table, packed)`, its backward the C loop where `usable`."""
    if usable(table.dtype, table.device.type):
        return _SignedGather.apply(table, packed)
    return signed_buckets(table, packed)
