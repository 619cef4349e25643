"""The `torch` path: pure torch, op by op, with a recomputing backward; its rule, its
variant, its runners and the tile MLP as an `autograd.Function` (its bodies in `_bodies`).
Every other path falls back to it; `compiled-mlp` and `graph` run it in their own variants;
`gbfunc.dist`'s rank-owned g-nets call it, and `gb.init` reads its chunking.

A stack's g-nets run on its tiles in one batched call, `(tiles, TH, TW * K)` out, from the
separable first layer's small terms (`_spec.stack_terms`): `tile_mlp`, `_spec.reference` as
an `autograd.Function`, saves nothing of size `(T, TH, Q, H)` and recomputes it in its
backward (FlashAttention-style); it composes with `grad`, `vmap` and `torch.compile`.

The variants are the forms of the tile MLP (`_traced_forms.FORMS`): `eager-recompute`
eagerly, in chunks of tiles (one fused reduction for one-layer, one-output g-nets, else
units-major matmuls, which the traced `units-major` form runs too); traced, a form written
for inductor or the C loops (`_traced_forms`), or, under transforms dynamo traces no
`autograd.Function` under, `plain-autograd`: `reference` in plain ops, no Function. The
`compiled-mlp` path passes its compiled bodies (`CompiledBodies`), which plainly eager calls
run instead. Traced by `torch.compile` under `torch.func.grad`, the Function keeps its
backward: dynamo drops it only where it is applied to the transformed function's own
argument (pytorch/pytorch#193279, torch 2.13), and the terms are always computed from the
leaves first.
"""

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._function import signature_once
from .._plan import TILE_LEAVES, Plan, Stack
from .._realised import realised
from .._spec import (
    Terms,
    hashed_tiles as spec_hashed_tiles,
    reference_jvp,
    stack_terms,
    tile_rows,
)
from .._tiling import assemble, block_spans, split_into
from .._tracing import legacy_batched, plain_eager
from . import _traced_forms as traced_forms
from ._bodies import after, backward_recompute, forward_no_save
from ._policy import Call
from ._traced_forms import EAGER, ONE_OUTPUT_UNITS_MAJOR, PLAIN

NAME = "torch"

# Eager evaluation is chunked over tiles so that the transient (chunk, TH, Q, H) tensor stays
# cache-sized; graphs traced by an outer compile are left whole for inductor to fuse.
CHUNK_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class CompiledBodies:
    """The `compiled-mlp` path's tile MLP in a traced form, compiled once per signature, each
    returning None where it cannot compile: `forward(terms, activation, b_t, form)`, and
    `backward(grad, terms, activation, form)`, every term's gradient (`terms.b_out` unread)."""

    forward: Callable[[Terms, str, Tensor | None, str], Tensor | None]
    backward: Callable[[Tensor, Terms, str, str], tuple | None]


def refuses(call: Call) -> str | None:
    """None: pure torch generates every stack."""
    return None


def variant(call: Call) -> str:
    """The variant that generates the call's stack (`_traced_forms.forward_form`)."""
    context, stack, w_in = call.context, call.stack, call.leaves["w_in"]
    traced, exporting = context.compiling, context.exporting
    return traced_forms.tile_form(
        stack, w_in, traced=traced, exporting=exporting, plain=context.plain
    )


def stack_weights(
    plan: Plan,
    index: int,
    leaves: Mapping[str, Tensor],
    form: str,
    traced: bool,
    *,
    compiled: CompiledBodies | None = None,
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
    `spans`) rather than splitting its output: all but row g-nets (`Q == 1`), whose compiled
    steps ran slower taken apart (`benchmarks/scaling.py`)."""
    return stack.columns > 1


def evaluate_stack(stack: Stack, leaves: Mapping[str, Tensor], *, form: str = EAGER) -> Tensor:
    """Every tile of a stack, `(T, TH, TW * K)`, from its leaves
    (`gparams["stacks"][stack.key]`): one batched g-net evaluation, in the tile MLP's `form`
    (`tile_form`), op by op with the recomputing backward (`tile_mlp`)."""
    (tiles,) = evaluate_parts(stack, leaves, None, form=form)
    return tiles


def evaluate_parts(
    stack: Stack,
    leaves: Mapping[str, Tensor],
    spans: Sequence[tuple[int, int]] | None,
    *,
    form: str = EAGER,
    compiled: CompiledBodies | None = None,
) -> tuple[Tensor, ...]:
    """`evaluate_stack` cut into the consecutive tile ranges `spans` (None: one part, the
    whole stack), each part with a gradient of its own that the tile MLP's backward takes
    apart (`tile_mlp`)."""
    terms = stack_terms(stack, leaves)
    spans = None if spans is None else tuple(spans)
    reads_b_t = stack.one_reduction and form in ONE_OUTPUT_UNITS_MAJOR
    b_t = traced_forms.units_major_columns(stack, leaves) if reads_b_t else None
    activation = stack.genome.activation
    parts = tile_mlp(terms, activation, form=form, compiled=compiled, b_t=b_t, spans=spans)
    parts = (parts,) if spans is None else parts
    ranges = spans or ((0, stack.num_tiles),)
    traced = op_by_op_form(form, compiled) != EAGER
    table = leaves["tile_hash"] if stack.genome.hashed else None
    hashed = None if table is None else hashed_tiles(stack, table, traced, plain=form == PLAIN)
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
    compiled: CompiledBodies | None = None,
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


def hashed_tiles(stack: Stack, table: Tensor, traced: bool, *, plain: bool = False) -> Tensor:
    """Each tile's hashed weights `(T, TH, TW * K)` from its table `(T, buckets)`, `traced`
    by `torch.compile` (`_traced_forms.hashed_tiles`, in plain autograd where `plain`) or not
    (`_spec.hashed_tiles`)."""
    if not traced:
        return spec_hashed_tiles(stack, table)
    return traced_forms.hashed_tiles(stack, table, plain=plain)


def tile_chunks(
    num_tiles: int, per_tile: int, budget: int = CHUNK_ELEMENTS
) -> list[tuple[int, int]]:
    """Balanced consecutive tile ranges of at most `budget` elements at `per_tile` each (at
    least one tile)."""
    count = max(1, math.ceil(num_tiles / max(1, budget // max(1, per_tile))))
    size = max(1, math.ceil(num_tiles / count))  # balanced: at most two sizes, often one
    return [(s, min(num_tiles, s + size)) for s in range(0, num_tiles, size)]


def joined(parts: list) -> object:
    """One tensor, or one tuple of tensors (None kept), from the results of tile chunks."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True))


def op_by_op_form(form: str, compiled: CompiledBodies | None) -> str:
    """The form of what runs op by op: `form`, or `EAGER` with `compiled` bodies, which hold
    the traced form alone (and whose fallback runs eagerly)."""
    return EAGER if compiled is not None else form


def _eager_chunks(terms: Terms, whole: bool) -> list[tuple[int, int]]:
    """The tile ranges that bodies called op by op run on: the whole stack where traced
    (`whole`: inductor fuses it), else cache-sized chunks (`CHUNK_ELEMENTS`)."""
    num_tiles, rows, hidden = terms.a.shape
    if whole:
        return [(0, num_tiles)]
    return tile_chunks(num_tiles, rows * terms.b.shape[1] * hidden)


def _backward_per_range(terms: Terms) -> bool:
    """Whether traced code runs the backward once per tile range (`tile_mlp`'s `spans`)
    rather than once on their concatenation: except for one-layer, one-output g-nets whose
    hidden units are reduced one at a time (`_traced_forms.vectorised_units`), three
    reductions per unit, which per range multiplied the compiled graph and its compile time."""
    units = terms.a.shape[-1]
    return not terms.one_reduction or traced_forms.vectorised_units(terms.a) == units


@signature_once
class _TileMLP(torch.autograd.Function):
    """`reference` with a recomputing backward; its arguments are a flat `Terms`, `b_t`, the
    activation, the form, the compiled bodies to run (or None) and the tile ranges to return
    apart (or None) (see `tile_mlp`; `autograd.Function` takes tensors one by one)."""

    @staticmethod
    def forward(a, b, c, w_hidden, b_hidden, w_out, b_out, b_t, activation, form, compiled, spans):
        # Named, not `*inputs`: dynamo, inlining a Function none of whose inputs requires grad
        # (under vmap, with frozen g-nets), passes `ctx` first unless the arity matches.
        terms = Terms(a, b, c, w_hidden, b_hidden, w_out, b_out)
        out = None
        if compiled is not None and plain_eager():  # a guard: the path's rule asked for eager
            out = compiled.forward(terms, activation, b_t, form)
        if out is None:  # op by op: in `form`, or eagerly where compiled bodies could not run
            form = op_by_op_form(form, compiled)
            out = joined(
                [
                    forward_no_save(terms.tiles(lo, hi), activation, tile_rows(b_t, lo, hi), form)
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
                    tuple(backward_recompute(g.contiguous(), terms.tiles(lo, hi), *how))
                    for g, (lo, hi) in zip(grads, ctx.spans, strict=True)
                ]
                return (*joined(results), *done)
            # Assembled once every range's gradient exists, not from the first one on.
            last = torch.cat([g.reshape(-1)[:1] for g in grads])
            grads = tuple(after(g, last) for g in grads)
        grad = joined(list(grads)).contiguous()
        compiled = ctx.compiled
        eager = plain_eager() and not torch.is_grad_enabled()  # no second order, nor batched
        if compiled is not None and eager and not legacy_batched((grad,)):  # (storage-less) grads
            found = compiled.backward(grad, terms, ctx.activation, ctx.form)
            if found is not None:
                return (*found, *done)
        results = [
            tuple(backward_recompute(grad[lo:hi], terms.tiles(lo, hi), *how))
            for lo, hi in _eager_chunks(terms, whole=form != EAGER)
        ]
        return (*joined(results), *done)

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
        function = _TileMLP if torch.compiler.is_compiling() else _TileMLPForwardMode
        out = function.apply(*args, activation, form, compiled, None)
        out = out.reshape(size, -1, *out.shape[1:])
        if spans is None:
            return out, 0
        return tuple(out[:, lo:hi] for lo, hi in spans), (0,) * len(spans)


class _TileMLPForwardMode(_TileMLP):
    """`_TileMLP` with a forward-mode rule (`jvp`, `jacfwd`, `hessian`): the spec's, laid
    out as the outputs are. Eager only: dynamo does not trace a Function with one."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        _TileMLP.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*inputs[:7])
        ctx.stride = (output if ctx.spans is None else output[0]).stride()

    @staticmethod
    def jvp(ctx, *tangents):
        terms, along = Terms(*ctx.saved_tensors), Terms(*tangents[:7])
        out = reference_jvp(terms, along, ctx.activation, ctx.stride)
        return out if ctx.spans is None else tuple(out[lo:hi] for lo, hi in ctx.spans)


def tile_mlp(
    terms: Terms,
    activation: str,
    *,
    form: str = EAGER,
    compiled: CompiledBodies | None = None,
    b_t: Tensor | None = None,
    spans: tuple[tuple[int, int], ...] | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """`reference`, with a backward that recomputes instead of saving `(T, TH, Q, H)`.

    `form` (`_traced_forms.forward_form`, the caller's path's choice): `EAGER` runs in chunks
    of tiles, the traced forms whole. With `compiled` bodies (`compiled_mlp.BODIES`), plainly
    eager calls run the forward and backward through them (eagerly where they cannot
    compile). `b_t`, optional: `terms.b` laid out units-major, `(T, H, Q)`, computed apart
    from the same leaves, which the `c-loops` and `by-columns` one-output forms read instead
    of `b`; its gradient is returned through `b`.

    `spans`, optional: consecutive tile ranges `(start, stop)` covering the stack; the output
    is returned cut into them. Traced, the backward runs once per range where it can
    (`_backward_per_range`), so the stack's whole gradient, which inductor would allocate at
    the first range's arrival, where a training step's activations peak, is never
    assembled; otherwise the ranges' gradients are joined once the last has arrived.
    """
    if form == PLAIN:  # no autograd.Function: plain ops that dynamo differentiates itself
        out = forward_no_save(terms, activation, form=PLAIN)
        return out if spans is None else tuple(out[lo:hi] for lo, hi in spans)
    function = _TileMLP if torch.compiler.is_compiling() else _TileMLPForwardMode
    return function.apply(*terms, b_t, activation, form, compiled, spans)


# The runner for a selection's stacks (`gbfunc.dist`): the tiles `tiles` of a stack,
# `(len(tiles), TH, TW * K)`, op by op in the variant `form`, cut into `spans`.
tiles = evaluate_tile_parts
