"""Row g-nets and one-output g-nets with one ReLU layer on CPU: from their leaves straight to
the weights, in C.

A row g-net (`Stack.columns == 1`) emits a whole tile row per evaluation. Through the tile
MLP that is a `(TH, H) @ (H, P)` matmul per tile with 8-16 hidden units, too short a
contraction for MKL; its tiles are then copied onto each weight's grid, cut and scaled, and
the weights' gradients copied back into tiles (ragged ones through masked copies). Here one
loop computes each tile row from the g-net's leaves (the first layer from the code tables
included) and writes it, scaled, where it lands in its weight; the backward reads each
weight's gradient in place, row by row, and returns the leaves' gradients.

Eagerly, a plan whose stacks all suit runs these loops op by op instead of a compiled graph
(`gb.apply`), which also skips AOTAutograd's wrappers. Compiled steps gain little from
the loops: inductor already fuses the copies there.

The backward's two products per tile, the hidden units' gradients `g @ w_out^T` and
`w_out`'s `x^T @ g`, are register-blocked (sums held in registers across the loop feeding
them, not reloaded per row).

One-output g-nets (several evaluation columns, `Q > 1`) run the loops of `_relu_tiles`
through the same ops, placement and glue; `rows_reference` specifies both kinds.

`relu_rows` and `relu_rows_backward` are custom ops (`gbfunc::...`), opaque to inductor;
`_Rows` pairs them as forward and backward for autograd, `vmap` and `torch.compile`.
`rows_reference` is the specification in plain torch, and double backward goes through it.
`suits`, `placement` and `usable` say where the loops run: CPU float32, 4-32 units, at most
512 outputs, both loops compiled. The measurements behind these choices are in
`benchmarks/results/design_measurements.md`.
"""

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch._functorch.utils import unwrap_dead_wrappers

from .._function import signature_once
from .._plan import Generated, Stack, tile_places
from .._spec import Terms, code_tables, reference
from .._tracing import legacy_batched
from ._build import Loop, compiled_loop, launch, splits_added, threads_and_splits
from ._relu_loops import supported
from ._relu_tiles import BACKWARD as TILES_BACKWARD, BLOCK_ROWS, FORWARD as TILES_FORWARD

_FORWARD = Loop("relu_rows_forward", "relu_rows.cpp", pointers=9, sizes=4)
_BACKWARD = Loop("relu_rows_backward", "relu_rows.cpp", pointers=12, sizes=5)
# The loops are measured, and run, for at most this many hidden units and outputs (the MLP's
# row g-nets: 8 and 16 units, 128 and 256 outputs): each position costs `units * outputs`
# multiply-adds without register blocking, where MKL's matmuls gain on larger g-nets.
MAX_UNITS = 32
MAX_OUTPUTS = 512


class Placement(NamedTuple):
    """Where a stack's tiles land, in the loops' terms, as plain numbers (constants to a
    compiled graph): per tile `(weight, offset in it, row stride, rows, columns)`, flattened;
    each weight's matrix shape `(rows, columns)`, flattened; each tile's scale; and the three
    as the custom ops take them, one string (`placed_as`): as lists of ints and floats they
    would cross torch's dispatcher element by element on every call."""

    tiles: tuple[int, ...]
    shapes: tuple[int, ...]
    scales: tuple[float, ...]
    encoded: str

    @property
    def numbers(self) -> tuple[list[int], list[int], list[float]]:
        """The three as the loops' drivers and the references take them (lists)."""
        return list(self.tiles), list(self.shapes), list(self.scales)


def placed_as(
    tiles: tuple[int, ...], shapes: tuple[int, ...], scales: tuple[float, ...]
) -> Placement:
    """The `Placement` of these numbers, with its string (floats round-trip through `repr`)."""
    text = ";".join(",".join(map(repr, part)) for part in (tiles, shapes, scales))
    return Placement(tiles, shapes, scales, text)


@functools.lru_cache(maxsize=64)
def decoded(placement: str) -> Placement:
    """The `Placement` whose string is `placement`."""
    tiles, shapes, scales = (part.split(",") if part else [] for part in placement.split(";"))
    numbers = (tuple(map(int, tiles)), tuple(map(int, shapes)), tuple(map(float, scales)))
    return Placement(*numbers, placement)


def suits(stack: Stack) -> bool:
    """Whether a stack's g-nets are what the loops compute: g-nets of one ReLU layer, one per
    tile (not shared), that are either row g-nets (one evaluation column, a tile row's worth
    of outputs, on matrices: no kernel window) or one-output g-nets evaluated on several
    columns (`_relu_tiles`, any kernel window). A hashed table is added by `_hash_weights`."""
    genome = stack.genome
    one_layer = genome.depth == 1 and genome.activation == "relu"
    rows = stack.columns == 1 and stack.window == () and stack.tile[1] == stack.outputs
    one_output = stack.columns > 1 and stack.outputs == 1
    return one_layer and not genome.share and (rows or one_output)


def placement(stack: Stack, params: Sequence[Generated]) -> Placement | None:
    """Where `stack`'s tiles land on `params`, the parameters it generates, each whole
    (`_plan.tile_places`, with each tile's offset taken from its weight's start); None where
    a parameter is centred (its rows' means need the whole row first)."""
    if any(p.center for p in params):
        return None
    places, scales, _ = tile_places(stack, tuple(params))
    starts = [0]  # of each weight in the stack's flat output (plain loops: traced by dynamo)
    for p in params:
        starts.append(starts[-1] + p.numel)
    tiles = []
    for base, stride, rows, cols in places:
        weight = sum(base >= start for start in starts[1:-1])
        tiles += [weight, base - starts[weight], stride, rows, cols]
    shapes = tuple(n for p in params for n in (p.shape[0], p.numel // p.shape[0]))
    return placed_as(tuple(tiles), shapes, tuple(scales))


@torch.compiler.assume_constant_result
def usable(
    units: int, outputs: int, dtype: torch.dtype, device_type: str, columns: int = 1
) -> bool:
    """Whether the loops run for `units` hidden units, `outputs` outputs and `columns`
    evaluation columns (`Stack.columns`; more than one: the one-output loops): on CPU, in
    float32, from `_relu_loops.MIN_UNITS` to `MAX_UNITS` units, at most `MAX_OUTPUTS`
    outputs, with both loops compiled."""
    if units > MAX_UNITS or not 1 <= outputs <= MAX_OUTPUTS:
        return False
    if not supported(units, dtype, device_type):
        return False
    one_output = columns > 1
    loops = (TILES_FORWARD, TILES_BACKWARD) if one_output else (_FORWARD, _BACKWARD)
    return all(compiled_loop(loop, units, outputs) is not None for loop in loops)


def generate(
    stack: Stack, leaves: dict[str, Tensor], where: Placement, *, direct: bool
) -> tuple[Tensor, ...]:
    """The weights `stack`'s g-nets generate, as matrices `(rows, columns)`, from its leaves
    in `gparams["stacks"]` (`suits(stack)` and `usable` must hold). `direct`: a plainly eager
    call, which calls the loops without the custom ops' dispatch; otherwise (traced or
    transformed) through the ops."""
    row_code, col_code = code_tables(stack, leaves["w_in"])
    g_nets = [leaves[k] for k in ("w_in", "b_in", "w_out", "b_out")]
    if direct:
        return _apply_eagerly(row_code, col_code, *g_nets, where, True)
    # Traced under `torch.func.grad`, dynamo mishandles a Function applied to the transformed
    # function's own arguments (the ops inside see its wrapped tensors;
    # pytorch/pytorch#193279, torch 2.13): a view makes them values computed inside.
    g_nets = [x.view_as(x) for x in g_nets]
    return _Rows.apply(row_code, col_code, *g_nets, where, False)


@signature_once
class _Rows(torch.autograd.Function):
    """`relu_rows` with `relu_rows_backward` as its backward; composes with `grad`, `vmap`
    (through the ops' vmap rules) and `torch.compile`. Plainly eager calls skip the custom
    ops' dispatch (tens of microseconds a call, a tenth of the loops' time here); traced or
    transformed ones go through them, opaque to inductor (`direct`: `generate`'s)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(row_code, col_code, w_in, b_in, w_out, b_out, where: Placement, direct: bool):
        tensors = (row_code, col_code, w_in, b_in, w_out, b_out)
        if direct:
            return tuple(_forward(*tensors, where))
        return tuple(relu_rows(*tensors, where.encoded))

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        row_code, col_code, w_in, b_in, w_out, _, where, direct = inputs
        ctx.save_for_backward(row_code, col_code, w_in, b_in, w_out)
        ctx.where, ctx.direct = where, direct

    @staticmethod
    def backward(ctx, *grads):
        # Batched gradients (`is_grads_batched=True`, autograd's legacy vmap, which takes
        # neither the loops, having no storage, nor the ops): the specification's backward.
        if legacy_batched(grads):
            gradients = _backward_reference(list(grads), *ctx.saved_tensors, *ctx.where.numbers)
        # The op (with its vmap and autograd rules) unless direct without create_graph.
        elif not ctx.direct or torch.is_grad_enabled():
            gradients = relu_rows_backward(list(grads), *ctx.saved_tensors, ctx.where.encoded)
        else:
            gradients = _backward(list(grads), *ctx.saved_tensors, ctx.where)
        return (None, None, *gradients, None, None)


def _apply_eagerly(*args: object) -> tuple[Tensor, ...]:
    """`_Rows.apply(*args)` outside `torch.compile` and `torch.func` transforms, through
    torch's C++ apply: `Function.apply`'s Python wrapper binds the arguments through
    `inspect.signature` on every call to a Function with `setup_context`, which is all it
    adds there besides unwrapping dead functorch wrappers, done here too."""
    args = unwrap_dead_wrappers(args)
    return super(torch.autograd.Function, _Rows).apply(*args)


def rows_reference(row_code, col_code, w_in, b_in, w_out, b_out, tiles, shapes, scales):
    """`relu_rows` in plain torch: the specification, the spec's `reference` placed.

    Shapes: row_code `(TH, R)`, col_code `(Q, C)`, w_in `(T, R + C, H)`, b_in `(T, H)`,
    w_out `(T, H, P)`, b_out `(T, P)`, with `Q == 1` (row g-nets) or `P == 1` (one-output
    g-nets, `_relu_tiles`); `tiles`, `shapes` and `scales` as in `Placement`. The first layer
    splits as in `stack_terms` (`a` the row codes', `b` the column codes', `c` `b_in`); tile
    `t`, its `P` values side by side, is `(TH, Q * P)`, scaled by its scale, cut to its rows
    and columns and placed at its offset in its weight. Returns each weight as its matrix.
    """
    r = row_code.shape[-1]
    terms = Terms(row_code @ w_in[:, :r], col_code @ w_in[:, r:], b_in, None, None, w_out, b_out)
    return placed(reference(terms, "relu").flatten(2), tiles, shapes, scales)


def placed(
    tiles_out: Tensor, tiles: list[int], shapes: list[int], scales: list[float]
) -> list[Tensor]:
    """Tiles `(T, TH, Q * P)`, each scaled by its scale, cut to its rows and columns and
    placed at its offset in its weight, as `Placement` says (plain torch: the specification of
    the loops' writes). Returns each weight as its matrix."""
    out = tiles_out * tiles_out.new_tensor(scales)[:, None, None]
    weights = []
    for index in range(len(shapes) // 2):
        height, width = shapes[2 * index : 2 * index + 2]
        bands: dict[int, list[tuple[int, Tensor]]] = {}
        for t in range(len(tiles) // 5):
            weight, start, _, rows, cols = tiles[5 * t : 5 * t + 5]
            if weight == index:
                bands.setdefault(start // width, []).append((start % width, out[t, :rows, :cols]))
        rows_of = [
            torch.cat([x for _, x in sorted(b, key=lambda e: e[0])], 1)
            for _, b in sorted(bands.items(), key=lambda e: e[0])
        ]
        weights.append(torch.cat(rows_of).reshape(height, width))
    return weights


@torch.library.custom_op("gbfunc::relu_rows", mutates_args=(), device_types="cpu")
def relu_rows(
    row_code: Tensor,
    col_code: Tensor,
    w_in: Tensor,
    b_in: Tensor,
    w_out: Tensor,
    b_out: Tensor,
    placement: str,
) -> list[Tensor]:
    """`rows_reference(...)` by the C loop (`usable` must hold), the placement `encoded`."""
    return _forward(row_code, col_code, w_in, b_in, w_out, b_out, decoded(placement))


def _forward(row_code, col_code, w_in, b_in, w_out, b_out, where: Placement) -> list[Tensor]:
    inputs = [x.contiguous() for x in (row_code, col_code, w_in, b_in, w_out, b_out)]
    weights = new_weights(w_in, where.shapes)
    table, tile_scales = placement_tables(where.encoded)
    units, outputs = w_out.shape[-2:]
    columns = col_code.shape[0]
    tiles = (w_in.shape[0], table.shape[0])
    tables = (*inputs, tile_scales, table, weights)
    widths = (row_code.shape[0], row_code.shape[1], col_code.shape[1])
    if columns == 1:
        threads = torch.get_num_threads()
        launch(_FORWARD, units, outputs, *tables, w_in.shape[0], *widths, threads, tiles=tiles)
        return weights
    tile_rows, row_width, col_width = widths
    blocks = -(-tile_rows // BLOCK_ROWS)
    threads, splits = threads_and_splits(w_in.shape[0], blocks)
    sizes = (w_in.shape[0], tile_rows, columns, row_width, col_width, splits, threads)
    launch(TILES_FORWARD, units, 1, *tables, *sizes, tiles=tiles)
    return weights


@relu_rows.register_fake
def _(row_code, col_code, w_in, b_in, w_out, b_out, placement) -> list[Tensor]:
    return new_weights(w_in, decoded(placement).shapes)


@relu_rows.register_vmap
def _(info, in_dims, row_code, col_code, w_in, b_in, w_out, b_out, placement):
    tensors = (row_code, col_code, w_in, b_in, w_out, b_out)
    return per_genome(
        lambda *args: relu_rows(*args, placement), info.batch_size, in_dims[:6], tensors
    )


@torch.library.custom_op("gbfunc::relu_rows_backward", mutates_args=(), device_types="cpu")
def relu_rows_backward(
    grads: list[Tensor | None],
    row_code: Tensor,
    col_code: Tensor,
    w_in: Tensor,
    b_in: Tensor,
    w_out: Tensor,
    placement: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gradients of `relu_rows` w.r.t. `w_in`, `b_in`, `w_out` and `b_out`, given each
    weight's gradient (None: zero), by the C loop, which reads them in place."""
    return _backward(grads, row_code, col_code, w_in, b_in, w_out, decoded(placement))


def _backward(grads, row_code, col_code, w_in, b_in, w_out, where: Placement) -> tuple:
    inputs = [x.contiguous() for x in (row_code, col_code, w_in, b_in, w_out)]
    grads = [None if g is None else g.contiguous() for g in grads]
    table, tile_scales = placement_tables(where.encoded)
    num_tiles, width, units = w_in.shape
    outputs, tile_rows = w_out.shape[-1], row_code.shape[0]
    threads, splits = threads_and_splits(num_tiles, tile_rows)
    partials = (
        w_in.new_empty(num_tiles, splits, width, units),
        w_in.new_empty(num_tiles, splits, units),
        w_in.new_empty(num_tiles, splits, units, outputs),
        w_in.new_empty(num_tiles, splits, outputs),
    )
    columns = col_code.shape[0]
    sizes = (num_tiles, tile_rows) + ((columns,) if columns > 1 else ())
    widths = (row_code.shape[1], col_code.shape[1], splits, threads)
    loop = TILES_BACKWARD if columns > 1 else _BACKWARD
    tiles = (num_tiles, table.shape[0])
    launch(
        loop,
        units,
        outputs,
        grads,
        *inputs,
        tile_scales,
        table,
        *partials,
        *sizes,
        *widths,
        tiles=tiles,
    )
    return tuple(splits_added(x) for x in partials)


@relu_rows_backward.register_fake
def _(grads, row_code, col_code, w_in, b_in, w_out, placement) -> tuple:
    b_out = w_out.new_empty(w_out.shape[0], w_out.shape[-1])
    return (
        w_in.new_empty(w_in.shape),
        b_in.new_empty(b_in.shape),
        w_out.new_empty(w_out.shape),
        b_out,
    )


@relu_rows_backward.register_vmap
def _(info, in_dims, grads, row_code, col_code, w_in, b_in, w_out, placement):
    others = (row_code, col_code, w_in, b_in, w_out)
    each = [
        relu_rows_backward(per_weight, *rest, placement)
        for per_weight, rest in batched_gradients(
            info.batch_size, grads, in_dims[0], in_dims[1:6], others
        )
    ]
    return tuple(torch.stack(x) for x in zip(*each, strict=True)), (0, 0, 0, 0)


def _backward_reference(grads, row_code, col_code, w_in, b_in, w_out, tiles, shapes, scales):
    """`relu_rows_backward` by autograd through `rows_reference`, differentiable."""
    b_out = w_out.new_zeros(w_out.shape[0], w_out.shape[-1]).requires_grad_()
    leaves = (w_in, b_in, w_out)
    with torch.enable_grad():
        leaves = tuple(x if x.requires_grad else x.detach().requires_grad_() for x in leaves)
        weights = rows_reference(row_code, col_code, *leaves, b_out, tiles, shapes, scales)
        pairs = [(w, g) for w, g in zip(weights, grads, strict=True) if g is not None]
        return torch.autograd.grad(
            [w for w, _ in pairs],
            [*leaves, b_out],
            [g for _, g in pairs],
            create_graph=True,
            allow_unused=True,
            materialize_grads=True,
        )


def _save_backward(ctx, inputs: tuple, output) -> None:
    grads, *tensors, placement = inputs
    ctx.present = [g is not None for g in grads]
    ctx.save_for_backward(*(g for g in grads if g is not None), *tensors)
    ctx.numbers = decoded(placement).numbers


def _backward_backward(ctx, *outer: Tensor | None) -> tuple:
    """Double backward: autograd through `_backward_reference`."""
    saved = [x.detach().requires_grad_() for x in ctx.saved_tensors]
    count = sum(ctx.present)
    given = iter(saved[:count])
    grads = [next(given) if present else None for present in ctx.present]
    with torch.enable_grad():
        inner = _backward_reference(grads, *saved[count:], *ctx.numbers)
    pairs = [(x, g) for x, g in zip(inner, outer, strict=True) if g is not None]
    result = torch.autograd.grad(
        [x for x, _ in pairs], saved, [g for _, g in pairs], allow_unused=True
    )
    given = iter(result[:count])
    per_weight = [next(given) if present else None for present in ctx.present]
    return (per_weight, *result[count:], None)


relu_rows_backward.register_autograd(_backward_backward, setup_context=_save_backward)


def _save_forward(ctx, inputs: tuple, output) -> None:
    *tensors, _, placement = inputs
    ctx.save_for_backward(*tensors)
    ctx.placement = placement


def _forward_backward(ctx, grads: list[Tensor | None]) -> tuple:
    """The op's own backward, `relu_rows_backward`, as `_Rows`'s: where a trace reaches the
    op without `_Rows` around it (`torch.compile` of `vmap` over genomes that train)."""
    gradients = relu_rows_backward(list(grads), *ctx.saved_tensors, ctx.placement)
    return (None, None, *gradients, None)


relu_rows.register_autograd(_forward_backward, setup_context=_save_forward)


def new_weights(like: Tensor, shapes: Sequence[int]) -> list[Tensor]:
    """Empty weight matrices like `like`, of `shapes` (`Placement.shapes`: rows, columns...)."""
    return [like.new_empty(shapes[i], shapes[i + 1]) for i in range(0, len(shapes), 2)]


@functools.lru_cache(maxsize=64)
def placement_tables(placement: str, gain: float = 1.0) -> tuple[Tensor, Tensor]:
    """The placement whose string is `placement` as the loops read it, `(T, 5)` int64, and
    the tiles' scales times `gain`, float32; cached by the string, whose hash Python keeps
    (keyed by the numbers, every call hashed them again)."""
    where = decoded(placement)
    table = torch.tensor(where.tiles, dtype=torch.int64, device="cpu").reshape(-1, 5)
    scales = [s * gain for s in where.scales]
    return table, torch.tensor(scales, dtype=torch.float32, device="cpu")


def batched(size: int, in_dims: tuple, tensors: tuple) -> list[tuple[Tensor, ...]]:
    """Per vmapped genome, the tensors' slices (unbatched ones repeated)."""
    moved = [x if d is None else x.movedim(d, 0) for x, d in zip(tensors, in_dims, strict=True)]
    return [
        tuple(x if d is None else x[k] for x, d in zip(moved, in_dims, strict=True))
        for k in range(size)
    ]


def batched_gradients(
    size: int, grads: list[Tensor | None], grad_dims: list, in_dims: tuple, tensors: tuple
) -> list[tuple[list[Tensor | None], tuple[Tensor, ...]]]:
    """Per vmapped genome, each weight's gradient (None stays None) and the other tensors'
    slices, for the backward ops' vmap rules."""
    present = [g for g in grads if g is not None]
    dims = [d for g, d in zip(grads, grad_dims, strict=True) if g is not None]
    each = []
    for args in batched(size, (*dims, *in_dims), (*present, *tensors)):
        given = iter(args[: len(present)])
        each.append(([None if g is None else next(given) for g in grads], args[len(present) :]))
    return each


def per_genome(
    run: Callable[..., list[Tensor]], size: int, in_dims: tuple, tensors: tuple
) -> tuple[list[Tensor], list[int]]:
    """A forward op's vmap rule: `run` on each vmapped genome's slices of `tensors`, its
    weight lists stacked along a new dim 0."""
    each = [run(*args) for args in batched(size, in_dims, tensors)]
    return [torch.stack(w) for w in zip(*each, strict=True)], [0] * len(each[0])
