"""A hashed stack's table straight onto its weights, and the weights' gradients back, in C.

A hashed stack adds to each position of a tile one bucket of the tile's table, signed
(`_genome.hash_buckets`, packed as int32 `(bucket + 1) * sign`), times `HASH_GAIN`. Where the
stack's g-nets run `_relu_rows`' loops, which write the weights directly, laying the hashed
tiles out on the weights and their gradients back into tiles would be all that is left of
the tile layout. Here the forward adds each cut position's signed bucket to the g-nets'
weights, into new tensors, in one pass (a separate `aten::add` cost as much as the gather),
and the backward adds each weight's gradient, read in place, into the buckets: partial tables
per row split of a tile, added after. The ops read the tile hash from its cache, not as a
graph input: as an op's output it would be copied every compiled step. The sign is a
multiply, not a branch: random, a branch on it mispredicts half the time. With AVX-512 both
loops take 16 positions at a time (a gather; a gather and a scatter where no two positions
share a bucket).

`hash_weights` and `hash_weights_backward` are custom ops (`gbfunc::...`), opaque to
inductor, paired by `_HashWeights` for autograd, `vmap` and `torch.compile`;
`hash_weights_reference` is the specification in plain torch. The measurements behind
these choices are in `benchmarks/results/design_measurements.md`.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from .._function import signature_once
from .._spec import cached_tile_hash, signed_buckets
from .._tracing import legacy_batched
from ._build import Loop, compiled_loop, launch, splits_added, threads_and_splits, vectorised_cpu
from ._relu_rows import (
    Placement,
    batched_gradients,
    decoded,
    new_weights,
    per_genome,
    placed,
    placement_tables,
)

_FORWARD = Loop("hash_weights", "hash_weights.cpp", pointers=6, sizes=4)
_BACKWARD = Loop("hash_weights_backward", "hash_weights.cpp", pointers=5, sizes=5)


@torch.compiler.assume_constant_result
def usable(dtype: torch.dtype, device_type: str) -> bool:
    """Whether the loops run: where `_build.vectorised_cpu` holds and both compile."""
    if not vectorised_cpu(dtype, device_type):
        return False
    return all(compiled_loop(loop, 1) is not None for loop in (_FORWARD, _BACKWARD))


def generate(
    base: Sequence[Tensor],
    table: Tensor,
    positions: int,
    tile_rows: int,
    where: Placement,
    gain: float,
    *,
    direct: bool,
) -> tuple[Tensor, ...]:
    """The weights `base` (matrices `(rows, columns)`, the g-nets') plus what a hashed stack's
    table `(T, B)` adds to them, each value times `gain`, for tiles of `positions` positions
    in `tile_rows` rows (`direct`: a plainly eager call, `_relu_rows.generate`'s)."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (table, *base))):
        # No gradient to take: the op itself. Dynamo, inlining `_HashWeights` (whose forward
        # takes `*base`) where no input requires grad, passed `ctx` for the table.
        return tuple(hash_weights(list(base), table, positions, tile_rows, where.encoded, gain))
    if not direct:
        table = table.view_as(table)  # see `_relu_rows.generate` (pytorch/pytorch#193279)
    return _HashWeights.apply(table, positions, tile_rows, where.encoded, gain, *base)


@signature_once
class _HashWeights(torch.autograd.Function):
    """`hash_weights` with `hash_weights_backward` as its backward (the base weights'
    gradients pass through)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(table, positions, tile_rows, placement, gain, *base):
        return tuple(hash_weights(list(base), table, positions, tile_rows, placement, gain))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        table, *numbers = inputs[:5]
        ctx.buckets, ctx.numbers = table.shape[-1], numbers

    @staticmethod
    def backward(ctx, *grads):
        # `is_grads_batched=True`: autograd's legacy vmap takes no op of a list of tensors
        if legacy_batched(grads):
            g_table = _table_gradient_reference(list(grads), ctx.buckets, *ctx.numbers)
        else:
            g_table = hash_weights_backward(list(grads), ctx.buckets, *ctx.numbers)
        return (g_table, None, None, None, None, *grads)


def hash_weights_reference(
    base: list[Tensor],
    table: Tensor,
    positions: int,
    tile_rows: int,
    tiles: list[int],
    shapes: list[int],
    scales: list[float],
) -> list[Tensor]:
    """`hash_weights` in plain torch: the specification. Position `p` of tile `t` (`(TH, Q)`
    row-major, `TH = tile_rows`, `TH * Q = positions`) adds `sign * table[t, bucket]` of the
    tile hash (`_genome.hash_buckets(positions, B)`), scaled, to its element of `base`; tiles
    are cut and placed by `_relu_rows.placed`."""
    packed = cached_tile_hash(positions, table.shape[-1], table.device)
    values = signed_buckets(table, packed)  # (T, positions)
    hashed = placed(values.reshape(table.shape[0], tile_rows, -1), tiles, shapes, scales)
    return [b + h for b, h in zip(base, hashed, strict=True)]


@torch.library.custom_op("gbfunc::hash_weights", mutates_args=(), device_types="cpu")
def hash_weights(
    base: list[Tensor],
    table: Tensor,
    positions: int,
    tile_rows: int,
    placement: str,
    gain: float,
) -> list[Tensor]:
    """`hash_weights_reference(...)` by the C loop (`usable` must hold), with the placement
    `encoded` and each value times `gain`. The tile hash comes from the cache, not through the
    graph: passed as an op's output, it is copied each step so that compiled code may reuse
    its memory."""
    table_of, tile_scales = placement_tables(placement, gain)
    weights = new_weights(table, decoded(placement).shapes)
    base = [x.contiguous() for x in base]
    table = table.contiguous()
    packed = cached_tile_hash(positions, table.shape[-1], table.device)
    launch(
        _FORWARD,
        1,
        1,
        base,
        table,
        packed,
        tile_scales,
        table_of,
        weights,
        table.shape[0],
        tile_rows,
        positions // tile_rows,
        table.shape[1],
        torch.get_num_threads(),
        tiles=(table.shape[0], table_of.shape[0]),
    )
    return weights


@hash_weights.register_fake
def _(base, table, positions, tile_rows, placement, gain) -> list[Tensor]:
    return new_weights(table, decoded(placement).shapes)


@hash_weights.register_vmap
def _(info, in_dims, base, table, positions, tile_rows, placement, gain):
    count, numbers = len(base), (positions, tile_rows, placement, gain)
    return per_genome(
        lambda *args: hash_weights(list(args[:count]), args[count], *numbers),
        info.batch_size,
        (*in_dims[0], in_dims[1]),
        (*base, table),
    )


@torch.library.custom_op("gbfunc::hash_weights_backward", mutates_args=(), device_types="cpu")
def hash_weights_backward(
    grads: list[Tensor | None],
    buckets: int,
    positions: int,
    tile_rows: int,
    placement: str,
    gain: float,
) -> Tensor:
    """The gradient of `hash_weights` w.r.t. the table `(T, buckets)`, given each weight's
    gradient (None: zero), by the C loop, which reads them in place."""
    present = [g for g in grads if g is not None]
    grads = [None if g is None else g.contiguous() for g in grads]
    packed = cached_tile_hash(positions, buckets, present[0].device)
    table_of, tile_scales = placement_tables(placement, gain)
    num_tiles = table_of.shape[0]
    threads, splits = threads_and_splits(num_tiles, tile_rows)
    partials = present[0].new_empty(num_tiles, splits, buckets)
    launch(
        _BACKWARD,
        1,
        1,
        grads,
        packed,
        tile_scales,
        table_of,
        partials,
        num_tiles,
        tile_rows,
        positions // tile_rows,
        buckets,
        splits,
        threads,
    )
    return splits_added(partials)


@hash_weights_backward.register_fake
def _(grads, buckets, positions, tile_rows, placement, gain) -> Tensor:
    present = [g for g in grads if g is not None]
    return present[0].new_empty(len(decoded(placement).tiles) // 5, buckets)


@hash_weights_backward.register_vmap
def _(info, in_dims, grads, buckets, positions, tile_rows, placement, gain):
    numbers = (buckets, positions, tile_rows, placement, gain)
    each = [
        hash_weights_backward(per_weight, *numbers)
        for per_weight, _ in batched_gradients(info.batch_size, grads, in_dims[0], (), ())
    ]
    return torch.stack(each), 0


def _table_gradient_reference(grads: list[Tensor | None], buckets: int, *numbers: object) -> Tensor:
    """`hash_weights_backward(grads, buckets, *numbers)` by autograd through
    `hash_weights_reference` (plain torch)."""
    positions, tile_rows, placement, gain = numbers
    tiles, shapes, scales = decoded(placement).numbers
    present = next(g for g in grads if g is not None)
    with torch.enable_grad():
        table = torch.zeros(len(tiles) // 5, buckets, dtype=present.dtype, requires_grad=True)
        zeros = [table.new_zeros(shapes[i], shapes[i + 1]) for i in range(0, len(shapes), 2)]
        scales = [s * gain for s in scales]
        weights = hash_weights_reference(zeros, table, positions, tile_rows, tiles, shapes, scales)
        pairs = [(w, g) for w, g in zip(weights, grads, strict=True) if g is not None]
        (g_table,) = torch.autograd.grad([w for w, _ in pairs], table, [g for _, g in pairs])
    return g_table


def _save_backward(ctx, inputs: tuple, output) -> None:
    ctx.numbers = inputs[2:]


def _backward_backward(ctx, outer: Tensor) -> tuple:
    """The backward is linear in the weights' gradients: its own backward is the forward's
    table part (plain torch; double backward is rare)."""
    positions, tile_rows, placement, gain = ctx.numbers
    tiles, shapes, scales = decoded(placement).numbers
    zeros = [outer.new_zeros(shapes[i], shapes[i + 1]) for i in range(0, len(shapes), 2)]
    scales = [s * gain for s in scales]
    grads = hash_weights_reference(zeros, outer, positions, tile_rows, tiles, shapes, scales)
    return (grads, None, None, None, None, None)


hash_weights_backward.register_autograd(_backward_backward, setup_context=_save_backward)


def _save_forward(ctx, inputs: tuple, output) -> None:
    _, table, *numbers = inputs
    ctx.buckets, ctx.numbers = table.shape[-1], numbers


def _forward_backward(ctx, grads: list[Tensor | None]) -> tuple:
    """The op's own backward, as `_HashWeights`'s: where a trace reaches the op without
    `_HashWeights` around it (`torch.compile` of `vmap` over genomes that train)."""
    g_table = hash_weights_backward(list(grads), ctx.buckets, *ctx.numbers)
    return (list(grads), g_table, None, None, None, None)


hash_weights.register_autograd(_forward_backward, setup_context=_save_forward)
