"""The `torch` path: pure torch, op by op, with a recomputing backward; its rule, its variants
and its runners. Every other path falls back to it; `compiled-mlp` and `graph` run it in their
own variants; `gbfunc.dist`'s rank-owned g-nets call it, and `gb.init` reads its chunking.

A stack's g-nets are evaluated on its tiles in one batched call, `(tiles, TH, TW * K)` out.
The first layer is separable: for tile `t`, row `i` and column `q`,
`z[t, i, q] = a[t, i] + b[t, q] + c[t]` with `a = row_code @ w_in[:, :R]` and
`b = col_code @ w_in[:, R:]` (per g-net),
so a tile costs two tiny matmuls and ~3H FLOPs per weight, and nothing of size `(T, TH, Q, H)`
is saved: `tile_mlp`, `_spec.reference` as an `autograd.Function`, recomputes it in its
backward (FlashAttention-style) and composes with `grad`, `vmap` and `torch.compile`.

The variants are the forms of the tile MLP's forward (`_tile_mlp_forward.FORMS`; the bodies
there and in `_tile_mlp_backward`), which `variant` picks from the call's context and the
stack: `eager-recompute` eagerly, in chunks of tiles; traced, whole, a form written for
inductor (`docs/design.md` lists them). With `compiled=True` (the `compiled-mlp` path) a
plainly eager call (neither traced nor inside a `torch.func` transform, whose calls the
path's rule sends elsewhere) runs the traced form's bodies as code compiled once per
signature, backward included. Traced by `torch.compile` under `torch.func.grad`, the Function
keeps its backward: dynamo drops it only where it is applied to the transformed function's
own argument (pytorch/pytorch#193279, torch 2.13), and the terms are always computed from the
leaves first.
"""

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import torch
from torch import Tensor

from .._compiled import CompiledCache
from .._function import signature_once
from .._plan import TILE_LEAVES, Plan, Stack
from .._realised import realised
from .._spec import (
    HASH_GAIN,
    Terms,
    bucket_signs,
    cached,
    code_tables,
    packed_tile_hash,
    per_tile,
    plain_eager,
    reference,
    stack_terms,
    tile_rows,
)
from .._tiling import assemble, block_spans, split_into
from ..cpu._hash_gradient import gathered, signed_gather
from ._policy import Call
from ._tile_mlp_backward import _after, _backward_recompute
from ._tile_mlp_forward import (
    EAGER,
    ONE_OUTPUT_UNITS_MAJOR,
    _forward_no_save,
    _vectorised_units,
    forward_form,
    reads_units_major_columns,
)

NAME = "torch"

# Eager evaluation is chunked over tiles so that the transient (chunk, TH, Q, H) tensor stays
# cache-sized; graphs traced by an outer compile are left whole for inductor to fuse.
CHUNK_ELEMENTS = 1 << 18
# Compiled bodies called eagerly run whole where inductor fuses the MLP into reductions (one
# hidden layer, one output); elsewhere the hidden activations are matmul operands, which it
# materialises, so they run in chunks of this many (tile, row, column, hidden) elements.
COMPILED_CHUNK_ELEMENTS = 1 << 20


def refuses(call: Call) -> str | None:
    """None: pure torch generates every stack."""
    return None


def variant(call: Call) -> str:
    """The variant that generates the call's stack (`_tile_mlp_forward.forward_form`)."""
    context = call.context
    w_in = call.leaves["w_in"]
    return tile_form(call.stack, w_in, traced=context.compiling, exporting=context.exporting)


def stack_weights(
    plan: Plan,
    index: int,
    leaves: Mapping[str, Tensor],
    form: str,
    traced: bool,
    *,
    compiled: bool = False,
) -> dict[str, Tensor]:
    """The runner for a whole plan: `{name: weight}` of every parameter that stack `index` of
    `plan` generates, whole, from its g-nets' `leaves`: every tile evaluated in the variant
    `form` (`compiled`: through compiled bodies), split into the parameters' blocks and laid
    out (`_tiling.assemble`); `traced` by `torch.compile`, each weight is computed into a
    buffer of its own (`realised`)."""
    stack = plan.stacks[index]
    params = plan.generated_by(index)
    spans = block_spans(params, stack.num_tiles)
    if spans is not None and traced and parts_from_tile_mlp(stack):
        # Traced, the blocks come apart out of the tile MLP: its backward then takes them
        # range by range where it can (`tile_mlp`).
        found = evaluate_parts(stack, leaves, spans, form=form, compiled=compiled)
        tiles = dict(zip(spans, found, strict=True))
    else:
        (tiles,) = evaluate_parts(stack, leaves, None, form=form, compiled=compiled)
        if spans is not None:
            tiles = split_into(tiles, spans)
    weights = {p.name: assemble(p, stack, tiles) for p in params}
    return {name: realised(w) for name, w in weights.items()} if traced else weights


def parts_from_tile_mlp(stack: Stack) -> bool:
    """Whether traced code takes a split stack's parts out of its tile MLP (`tile_mlp`'s
    `spans`), rather than splitting the MLP's output: all but row g-nets (one evaluation per
    tile row, `Q == 1`). Their hidden activations are a tile row's `H` values, so there is
    little for the parts to free early, and per part their backward runs more, smaller batched
    matmuls: taken apart, their compiled steps were slower for little memory saved. Only the
    largest model measured favoured the parts (`benchmarks/scaling.py`'s transformer at width
    1024)."""
    return stack.columns > 1


def evaluate_stack(
    stack: Stack,
    leaves: Mapping[str, Tensor],
    *,
    recompute: bool = True,
    form: str = EAGER,
    compiled: bool = False,
) -> Tensor:
    """Every tile of a stack, `(T, TH, TW * K)`: one batched g-net evaluation.

    Args:
        stack: The stack's description.
        leaves: Its parameters, `gparams["stacks"][stack.key]`.
        recompute: Use the recomputing backward (`tile_mlp`); False runs plain autograd.
        form: The tile MLP's form (`tile_form`): `EAGER`, or traced by `torch.compile`.
        compiled: Run `tile_mlp` eagerly through compiled code in `form` (see `gb.apply`).
    """
    (tiles,) = evaluate_parts(
        stack, leaves, None, recompute=recompute, form=form, compiled=compiled
    )
    return tiles


def evaluate_parts(
    stack: Stack,
    leaves: Mapping[str, Tensor],
    spans: Sequence[tuple[int, int]] | None,
    *,
    recompute: bool = True,
    form: str = EAGER,
    compiled: bool = False,
) -> tuple[Tensor, ...]:
    """`evaluate_stack` cut into the consecutive tile ranges `spans` (None: one part, the
    whole stack), each part with a gradient of its own that the tile MLP's backward takes
    apart (`tile_mlp`)."""
    terms = stack_terms(stack, leaves)
    spans = None if spans is None else tuple(spans)
    if recompute:
        reads_b_t = stack.one_reduction and form in ONE_OUTPUT_UNITS_MAJOR
        b_t = units_major_columns(stack, leaves) if reads_b_t else None
        activation = stack.genome.activation
        parts = tile_mlp(terms, activation, form=form, compiled=compiled, b_t=b_t, spans=spans)
    else:
        y = reference(terms, stack.genome.activation)
        parts = y if spans is None else tuple(y[lo:hi] for lo, hi in spans)
    parts = (parts,) if spans is None else parts
    ranges = spans or ((0, stack.num_tiles),)
    traced = op_by_op_form(form, compiled) != EAGER
    hashed = hashed_tiles(stack, leaves["tile_hash"], traced) if stack.genome.hashed else None
    out = []
    for y, (lo, hi) in zip(parts, ranges, strict=True):
        y = y.reshape(y.shape[0], y.shape[1], -1)
        out.append(y if hashed is None else y + hashed[lo:hi])
    return tuple(out)


def evaluate_tile_parts(
    stack: Stack,
    leaves: Mapping[str, Tensor],
    tiles: Sequence[int],
    spans: Sequence[tuple[int, int]] | None,
    *,
    form: str = EAGER,
    compiled: bool = False,
) -> tuple[Tensor, ...]:
    """Tiles `tiles` (ascending indices into the stack) of a stack, `(len(tiles), TH, TW * K)`,
    cut into `spans`, consecutive ranges of positions in `tiles` (None: one part), each part
    with a gradient of its own (`evaluate_parts`). Only the g-nets of those tiles run;
    gradients flow back into their rows of `leaves`."""
    if len(tiles) == stack.num_tiles:  # ascending and distinct: every tile
        return evaluate_parts(stack, leaves, spans, form=form, compiled=compiled)
    device = leaves["w_in"].device
    owner = stack.gnet_of_tile
    per_gnet = Counter(owner[t] for t in tiles)
    gnets = sorted(per_gnet)
    counts = tuple(per_gnet[g] for g in gnets)
    by_gnet = torch.tensor(gnets, device=device)
    by_tile = torch.tensor(list(tiles), device=device)
    sub = {
        k: v.index_select(0, by_tile if k in TILE_LEAVES else by_gnet) for k, v in leaves.items()
    }
    sub_stack = replace(stack, tiles_per_gnet=counts)
    return evaluate_parts(sub_stack, sub, spans, form=form, compiled=compiled)


def hashed_tiles(stack: Stack, table: Tensor, traced: bool) -> Tensor:
    """Each tile's hashed weights `(T, TH, TW * K)` from its table `(T, buckets)`, `traced`
    by `torch.compile` or not."""
    positions = stack.tile_positions
    # torch.gather, not index_select: its backward is a scatter_add, which inductor's CPU code
    # leaves to torch's kernel, where index_select's index_add becomes a scatter of atomic
    # adds.
    if traced:
        packed = _packed_tile_hash_op(positions, stack.genome.hashed, table.device)
        # A view: under `torch.func.grad`, dynamo drops the backward of a Function applied to
        # the transformed function's own argument and differentiates its forward instead
        # (pytorch/pytorch#193279, torch 2.13), which kept torch's scatter-add and the int64
        # index inductor writes for it.
        shared = signed_gather(table.view_as(table), packed) * HASH_GAIN  # backward: in C
    else:
        bucket, sign = cached(
            bucket_signs, positions, stack.genome.hashed, table.dtype, table.device
        )
        shared = gathered(table, bucket, sign * HASH_GAIN)
    return shared.reshape(table.shape[0], stack.tile[0], -1)


def units_major_columns(stack: Stack, leaves: Mapping[str, Tensor]) -> Tensor:
    """`stack_terms(stack, leaves).b` laid out units-major, `(T, H, Q)`: a matmul's own
    output, which compiled code reads with the columns as the vector axis (`tile_mlp`)."""
    w_in = leaves["w_in"]
    _, col = code_tables(stack, w_in)
    b_t = w_in[:, stack.row_width :].mT @ col.mT  # (G, H, Q)
    return per_tile(b_t, stack.tiles_per_gnet) if stack.genome.share else b_t


def _reads_units_major(stack: Stack, w_in: Tensor, traced: bool) -> bool:
    """Whether the tile MLP's forward runs as compiled code that reads `units_major_columns`:
    one hidden layer and one output (a fused reduction), `traced` (by `torch.compile`, or
    compiled eagerly), on tiles wide enough for it (`reads_units_major_columns`)."""
    wide = reads_units_major_columns(stack.columns, w_in.dtype, w_in.device)
    return stack.one_reduction and wide and traced


def tile_form(stack: Stack, w_in: Tensor, *, traced: bool, exporting: bool) -> str:
    """The form of the tile MLP's forward (`forward_form`) that `evaluate_parts` runs for
    `stack` with first layers `w_in`: `traced` by `torch.compile` or in gbfunc's compiled
    bodies (`compiled=True`, never exporting)."""
    genome = stack.genome
    return forward_form(
        one_layer=genome.depth == 1,
        hidden=genome.hidden,
        outputs=stack.outputs,
        activation=genome.activation,
        dtype=w_in.dtype,
        device_type=w_in.device.type,
        traced=traced,
        exporting=exporting,
        units_major_columns=_reads_units_major(stack, w_in, traced),
    )


@torch.library.custom_op("gbfunc::tile_hash", mutates_args=())
def _packed_tile_hash_op(positions: int, buckets: int, device: torch.device) -> Tensor:
    """The cached `packed_tile_hash` as one opaque operation for `torch.compile`: traced, the
    hash's argsort and integer arithmetic would run in every compiled step. Returns a copy,
    so that the compiled code may reuse its memory without touching the cache. Packed,
    bucket and sign copy 4 bytes a position, not 12 (int64 and float32), and unpack inside
    the gather's kernel, which lowers a compiled step's peak (measured:
    `benchmarks/results/design_measurements.md`)."""
    return cached(packed_tile_hash, positions, buckets, device).clone()


@_packed_tile_hash_op.register_fake
def _(positions: int, buckets: int, device: torch.device) -> Tensor:
    return torch.empty(positions, dtype=torch.int32, device=device)


# The tile MLP, `reference` as an `autograd.Function` with a recomputing backward.


def tile_chunks(
    num_tiles: int, per_tile: int, budget: int = CHUNK_ELEMENTS
) -> list[tuple[int, int]]:
    """Balanced consecutive tile ranges of at most `budget` elements at `per_tile` each (at
    least one tile)."""
    count = max(1, math.ceil(num_tiles / max(1, budget // max(1, per_tile))))
    size = max(1, math.ceil(num_tiles / count))  # balanced: at most two sizes, often one
    return [(s, min(num_tiles, s + size)) for s in range(0, num_tiles, size)]


def _compiled_chunks(terms: Terms) -> list[tuple[int, int]]:
    """The tile ranges that compiled bodies run on: the whole stack where inductor fuses it."""
    num_tiles, rows, hidden = terms.a.shape
    if terms.one_reduction:
        return [(0, num_tiles)]
    return tile_chunks(num_tiles, rows * terms.b.shape[1] * hidden, COMPILED_CHUNK_ELEMENTS)


def _joined(parts: list) -> object:
    """One tensor, or one tuple of tensors (None kept), from the results of tile chunks."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True))


_BODIES = CompiledCache("the tile MLP")


def _compiled(body: Callable, *args: object) -> object | None:
    """`body(*args)` through code compiled once per signature of the arguments (shapes,
    dtypes, devices, activation); None where that signature cannot be compiled."""
    signature = ((tuple(a.shape), a.dtype, a.device) if isinstance(a, Tensor) else a for a in args)
    return _BODIES.call((body.__name__, *signature), body, *args)


def op_by_op_form(form: str, compiled: bool) -> str:
    """The form of what runs op by op: `form`, or `EAGER` with `compiled`, whose compiled
    bodies hold the traced form alone (and whose fallback runs eagerly)."""
    return EAGER if compiled else form


def _eager_chunks(terms: Terms, whole: bool) -> list[tuple[int, int]]:
    """The tile ranges that bodies called op by op run on: the whole stack where traced
    (`whole`: inductor fuses it), else cache-sized chunks (`CHUNK_ELEMENTS`)."""
    num_tiles, rows, hidden = terms.a.shape
    if whole:
        return [(0, num_tiles)]
    return tile_chunks(num_tiles, rows * terms.b.shape[1] * hidden)


def _forward_body(*inputs) -> Tensor:
    *flat, b_t, activation, form = inputs
    return _forward_no_save(Terms(*flat), activation, b_t, form)


def _backward_body(grad: Tensor, *inputs) -> tuple:
    *saved, activation, form = inputs
    return tuple(_backward_recompute(grad, Terms(*saved, None), activation, form))


def _backward_per_range(terms: Terms) -> bool:
    """Whether traced code runs the backward once per tile range (`tile_mlp`'s `spans`)
    rather than once on their concatenation: except for one-layer, one-output g-nets whose
    hidden units are reduced one at a time (`_vectorised_units`), three reductions per unit,
    which per range multiplied the compiled graph and its compile time."""
    return not terms.one_reduction or _vectorised_units(terms.a) == terms.a.shape[-1]


@signature_once
class _TileMLP(torch.autograd.Function):
    """`reference` with a recomputing backward; its arguments are a flat `Terms`, `b_t`, the
    activation, the form, whether to run compiled bodies and the tile ranges to return
    apart, or None (see `tile_mlp`; `autograd.Function` takes tensors one by one)."""

    @staticmethod
    def forward(a, b, c, w_hidden, b_hidden, w_out, b_out, b_t, activation, form, compiled, spans):
        # Named, not `*inputs`: dynamo, inlining a Function none of whose inputs requires grad
        # (under vmap, with frozen g-nets), passes `ctx` first unless the arity matches.
        terms = Terms(a, b, c, w_hidden, b_hidden, w_out, b_out)
        out = None
        if compiled and plain_eager():  # a guard: the path's rule already asked for eager
            # Detached: autograd records this Function, not what runs inside (no_grad here).
            detached = Terms(*(None if x is None else x.detach() for x in terms))
            b_t = None if b_t is None else b_t.detach()
            outs = [
                _compiled(
                    _forward_body,
                    *detached.tiles(lo, hi),
                    tile_rows(b_t, lo, hi),
                    activation,
                    form,
                )
                for lo, hi in _compiled_chunks(detached)
            ]
            if all(part is not None for part in outs):
                out = _joined(outs)
        if out is None:  # op by op: in `form`, or eagerly where compiled bodies could not run
            form = op_by_op_form(form, compiled)
            out = _joined(
                [
                    _forward_no_save(terms.tiles(lo, hi), activation, tile_rows(b_t, lo, hi), form)
                    for lo, hi in _eager_chunks(terms, whole=form != EAGER)
                ]
            )
        return out if spans is None else tuple(out[lo:hi] for lo, hi in spans)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *flat, _, activation, form, compiled, spans = inputs
        ctx.save_for_backward(*flat[:-1])  # b_out is not needed, nor b_t (b holds its values)
        ctx.activation, ctx.form, ctx.compiled, ctx.spans = activation, form, compiled, spans

    @staticmethod
    def backward(ctx, *grads):
        terms = Terms(*ctx.saved_tensors, None)
        form = op_by_op_form(ctx.form, ctx.compiled)
        how, done = (ctx.activation, form), (None, None, None, None, None)
        if ctx.spans is not None and form != EAGER:
            if _backward_per_range(terms):
                # Each range's gradient goes through the backward on its own: the whole
                # stack's gradient is never assembled (see `tile_mlp`).
                results = [
                    tuple(_backward_recompute(g.contiguous(), terms.tiles(lo, hi), *how))
                    for g, (lo, hi) in zip(grads, ctx.spans, strict=True)
                ]
                return (*_joined(results), *done)
            # Assembled once every range's gradient exists, not from the first one on.
            last = torch.cat([g.reshape(-1)[:1] for g in grads])
            grads = tuple(_after(g, last) for g in grads)
        grad = _joined(list(grads)).contiguous()
        if ctx.compiled and plain_eager() and not torch.is_grad_enabled():  # not create_graph
            saved = Terms(*(None if x is None else x.detach() for x in terms))
            results = [
                _compiled(
                    _backward_body,
                    grad[lo:hi],
                    *saved.tiles(lo, hi)[:-1],
                    ctx.activation,
                    ctx.form,
                )
                for lo, hi in _compiled_chunks(saved)
            ]
            if all(result is not None for result in results):
                return (*_joined(results), *done)
        results = [
            tuple(_backward_recompute(grad[lo:hi], terms.tiles(lo, hi), *how))
            for lo, hi in _eager_chunks(terms, whole=form != EAGER)
        ]
        return (*_joined(results), *done)

    @staticmethod
    def vmap(info, in_dims, *inputs):
        # Fold the vmapped genomes into the tile axis: K stacks of T tiles are one stack of K*T.
        size = info.batch_size

        def fold(x: Tensor | None, dim: int | None) -> Tensor | None:
            if x is None:
                return None
            x = x.unsqueeze(0).expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
            return x.reshape(size * x.shape[1], *x.shape[2:])

        *flat, activation, form, compiled, spans = inputs
        args = [fold(x, d) for x, d in zip(flat, in_dims, strict=False)]
        out = _TileMLP.apply(*args, activation, form, compiled, None)
        out = out.reshape(size, -1, *out.shape[1:])
        if spans is None:
            return out, 0
        return tuple(out[:, lo:hi] for lo, hi in spans), (0,) * len(spans)


def tile_mlp(
    terms: Terms,
    activation: str,
    *,
    form: str = EAGER,
    compiled: bool = False,
    b_t: Tensor | None = None,
    spans: tuple[tuple[int, int], ...] | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """`reference`, with a backward that recomputes instead of saving `(T, TH, Q, H)`.

    `form`: the form of the forward (`_tile_mlp_forward.forward_form`, as the caller's path
    chose it): `EAGER` runs in chunks of tiles, the traced forms whole, for an outer
    `torch.compile`. With `compiled`, plain eager calls run the forward and the backward in
    the traced `form` as code compiled once per signature (the first call of a signature
    compiles: seconds; where it cannot, they run eagerly). `b_t`, optional,
    is `terms.b` laid out units-major, `(T, H, Q)`, computed apart (from the same leaves):
    the `c-loops` and `by-columns` forms of a one-layer, one-output forward read it instead of
    `b`. Its gradient is returned through `b` (None for `b_t`), so
    the two must hold the same values.

    `spans`, optional: consecutive tile ranges `(start, stop)` covering the stack; the output
    is returned cut into them, one tensor each. In a traced form, the backward runs once per
    range on that range's gradient where it can (`_backward_per_range`), so the whole stack's
    gradient is not assembled: a concatenation of gradients arriving one weight at a time,
    which inductor allocates whole at the first, at the start of a training step's backward,
    where the model's activations peak. Otherwise the ranges' gradients are joined once the
    last has arrived.
    """
    return _TileMLP.apply(*terms, b_t, activation, form, compiled, spans)


# The runner for a selection's stacks (`gbfunc.dist`): the tiles `tiles` of a stack,
# `(len(tiles), TH, TW * K)`, op by op in the variant `form`, cut into `spans`.
tiles = evaluate_tile_parts
