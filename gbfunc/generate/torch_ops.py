"""The `torch` path: pure torch, op by op, with a recomputing backward (`_tilemlp.tile_mlp`);
traced by `torch.compile`, inductor's code (on CPU calling the C loops' sub-ops where
`gbfunc.cpu` has them built). It always applies: the fallback of every other path.

Its variants, the forms of the tile MLP's forward (`_tilemlp_forward.FORMS`), are chosen
by `variant` from the call's context and the stack: `eager-recompute` eagerly (in chunks,
with a recomputing backward); traced, `c-loops` (the C loops' sub-ops: ReLU, float32, CPU,
not exported), `by-columns` or `by-units` (one output: a sum over the units, vectorised
over the columns or over the units) and `unrolled` or `units-major` (a written-out sum over
the units for one layer and few outputs, else matmuls).
"""

from .._evaluate import evaluate_tile_parts, tile_form
from ._policy import Call

NAME = "torch"


def refuses(call: Call) -> str | None:
    """None: pure torch generates every stack."""
    return None


def variant(call: Call) -> str:
    """The variant that generates the call's stack (`_tilemlp_forward.forward_form`)."""
    context = call.context
    w_in = call.leaves["w_in"]
    return tile_form(call.stack, w_in, traced=context.compiling, exporting=context.exporting)


# The runner: tiles `indices` of a stack, `(len(indices), TH, TW * K)`, op by op in the
# variant `form`, cut into `spans` (`evaluate_tile_parts`).
tiles = evaluate_tile_parts
