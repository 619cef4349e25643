"""Evaluate a stack of g-nets on every position of their tiles, without storing activations.

The first layer is separable: for tile `t`, row `i` and evaluation column `q`,
`z[t, i, q] = a[t, i] + b[t, q] + c[t]` with `a = row_code @ w_in[:R]`, `b = col_code @ w_in[R:]`.
A tile therefore costs two tiny matmuls and ~3H FLOPs per weight, and nothing of size
`(T, TH, Q, H)` has to be saved: the backward recomputes it (FlashAttention-style). With
several outputs or hidden layers the activations are laid out units-major, `(T, H, Q * TH)`,
so that every matmul has the tile's positions as its long axis. The forward bodies are in
`_tilemlp_forward`, the recomputing backward's in `_tilemlp_backward`; this module runs
them: in chunks of tiles, eagerly or compiled once per signature, as one
`autograd.Function`.

`reference` is the specification (plain autograd). `tile_mlp` is the same function as an
`autograd.Function` whose backward recomputes; it composes with `grad`, `vmap` and
`torch.compile(fullgraph=True)`. It runs in the form of its forward that the caller passes
(`_tilemlp_forward.forward_form`, chosen once per call by the dispatcher's paths): eagerly,
in chunks of tiles; traced by an outer `torch.compile`, whole, in a form written for
inductor. Called eagerly with `compiled=True`, its forward and backward bodies run in that
traced form as code compiled once per signature (shapes, dtypes, device, activation), which
is what makes eager training with large genomes fast. The recomputing backward runs
there too, under `loss.backward()` and under `torch.func.grad` alike (checked with a backward
that returns zeros): dynamo drops a Function's backward under `grad` only where the Function
is applied to the transformed function's own argument (pytorch/pytorch#193279, torch 2.13),
and the tile MLP's terms are always computed from the leaves first.
"""

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ._compiled import CompiledCache
from ._function import signature_once
from ._spec import Terms, plain_eager, tile_rows
from ._tilemlp_backward import _after, _backward_recompute
from ._tilemlp_forward import EAGER, _forward_no_save, _vectorised_units

# Eager evaluation is chunked over tiles so that the transient (chunk, TH, Q, H) tensor stays
# cache-sized; graphs traced by an outer compile are left whole for inductor to fuse.
CHUNK_ELEMENTS = 1 << 18
# Compiled bodies called eagerly run whole where inductor fuses the MLP into reductions (one
# hidden layer, one output); elsewhere the hidden activations are matmul operands, which it
# materialises, so they run in chunks of this many (tile, row, column, hidden) elements.
COMPILED_CHUNK_ELEMENTS = 1 << 20


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

    `form`: the form of the forward (`_tilemlp_forward.forward_form`, as the caller's path
    chose it): `EAGER` runs in chunks of tiles, the traced forms whole, for an outer
    `torch.compile`. With `compiled`, plain eager calls run the forward and the backward in
    the traced `form` as code compiled once per signature (the first call of a signature
    compiles: seconds; where it cannot, they run eagerly). `b_t`, optional,
    is `terms.b` laid out units-major, `(T, H, Q)`, computed apart (from the same leaves):
    the `c-loops` and `by-columns` forms of a one-layer, one-output forward read it instead of
    `b`. Its gradient is returned through `b` (None for `b_t`), so
    the two must hold the same values.

    `spans`, optional: consecutive tile ranges `(start, stop)` covering the stack; the output
    is returned cut into them, one tensor each. In a traced form, the backward runs once per range
    on that range's gradient, so the whole stack's gradient is never assembled: a concatenation
    of gradients arriving one weight at a time, which inductor allocates whole at the first,
    at the start of a training step's backward, where the model's activations peak.
    """
    return _TileMLP.apply(*terms, b_t, activation, form, compiled, spans)
