"""The `compiled-mlp` path: a stack's tile MLP compiled once per signature, run in chunks:
the `torch` path's runners with these compiled bodies (`BODIES`, `torch_ops.tile_mlp`'s
`compiled`).

Taken eagerly, outside a graph: `compile=True`, or `compile=None` on stacks of
`AUTO_COMPILE_ELEMENTS` hidden activations (`compiles_eagerly`). Its variants are the
traced forms of the `torch` path's (`variant`): the compiled bodies are traced code.
"""

from collections.abc import Callable
from functools import partial

from torch import Tensor

from .._spec import Terms, tile_rows
from . import torch_ops
from ._bodies import backward_recompute, forward_no_save
from ._compiled import CompiledCache
from ._policy import (
    AUTO_COMPILE_ELEMENTS,
    Call,
    compiler_missing,
    compiles_eagerly,
    own_compile_refused,
)
from ._traced_forms import tile_form

NAME = "compiled-mlp"

# Compiled bodies run whole where inductor fuses the MLP into reductions (one hidden layer,
# one output); elsewhere the hidden activations are matmul operands, which it materialises,
# so they run in chunks of this many (tile, row, column, hidden) elements.
COMPILED_CHUNK_ELEMENTS = 1 << 20


def refuses(call: Call) -> str | None:
    """Why the stack's tile MLP does not run compiled (None: it does)."""
    context = call.context
    if refused := own_compile_refused(context):
        return refused
    if not compiles_eagerly(call.stack, context.compile):
        if context.compile is False:
            return "compile=False"
        return f"compile=None and the stack is small (< {AUTO_COMPILE_ELEMENTS} activations)"
    if context.device == "cpu" and (missing := compiler_missing(call)):
        return missing
    return None


def variant(call: Call) -> str:
    """The form its compiled bodies run for the call's stack (`_traced_forms.forward_form`)."""
    return tile_form(call.stack, call.leaves["w_in"], traced=True, exporting=False)


def compiled_chunks(terms: Terms) -> list[tuple[int, int]]:
    """The tile ranges that compiled bodies run on: the whole stack where inductor fuses it."""
    num_tiles, rows, hidden = terms.a.shape
    if terms.one_reduction:
        return [(0, num_tiles)]
    per_tile = rows * terms.b.shape[1] * hidden
    return torch_ops.tile_chunks(num_tiles, per_tile, COMPILED_CHUNK_ELEMENTS)


_BODIES = CompiledCache("the tile MLP")


def _compiled(body: Callable, *args: object) -> object | None:
    """`body(*args)` through code compiled once per signature of the arguments (shapes,
    dtypes, devices, activation); None where that signature cannot be compiled."""
    signature = ((tuple(a.shape), a.dtype, a.device) if isinstance(a, Tensor) else a for a in args)
    return _BODIES.call((body.__name__, *signature), body, *args)


def _forward_body(*inputs) -> Tensor:
    *flat, b_t, activation, form = inputs
    return forward_no_save(Terms(*flat), activation, b_t, form)


def _backward_body(grad: Tensor, *inputs) -> tuple:
    *saved, activation, form = inputs
    return tuple(backward_recompute(grad, Terms(*saved, None), activation, form))


def _detached(terms: Terms) -> Terms:
    """`terms` detached from autograd, which records the Function, not what runs inside."""
    return Terms(*(None if x is None else x.detach() for x in terms))


def _forward(terms: Terms, activation: str, b_t: Tensor | None, form: str) -> Tensor | None:
    """The tile MLP's forward in `form` through compiled bodies, chunk by chunk; None where
    one could not compile."""
    detached = _detached(terms)
    b_t = None if b_t is None else b_t.detach()
    outs = [
        _compiled(_forward_body, *detached.tiles(lo, hi), tile_rows(b_t, lo, hi), activation, form)
        for lo, hi in compiled_chunks(detached)
    ]
    return torch_ops.joined(outs) if all(part is not None for part in outs) else None


def _backward(grad: Tensor, terms: Terms, activation: str, form: str) -> tuple | None:
    """The gradients of every term through compiled bodies (`terms.b_out` is None, not read);
    None where one could not compile."""
    saved = _detached(terms)
    results = [
        _compiled(_backward_body, grad[lo:hi], *saved.tiles(lo, hi)[:-1], activation, form)
        for lo, hi in compiled_chunks(saved)
    ]
    return torch_ops.joined(results) if all(r is not None for r in results) else None


BODIES = torch_ops.CompiledBodies(_forward, _backward)

# The runners, the `torch` path's with the tile MLP compiled in the variant `form`: a whole
# plan's stack (`stack_weights`), some tiles of a stack cut into `spans` (`tiles`).
stack_weights = partial(torch_ops.stack_weights, compiled=BODIES)
tiles = partial(torch_ops.evaluate_tile_parts, compiled=BODIES)
