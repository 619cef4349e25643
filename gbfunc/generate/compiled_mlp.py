"""The `compiled-mlp` path: a stack's tile MLP compiled once per signature, run in chunks
(`_tilemlp.tile_mlp` with `compiled=True`).

Taken eagerly, outside a graph: `compile=True`, or `compile=None` on stacks of
`AUTO_COMPILE_ELEMENTS` hidden activations (`compiles_eagerly`). Its variants are the
traced forms of the `torch` path's (`variant`): the compiled bodies are traced code.
"""

from functools import partial

from .._evaluate import evaluate_tile_parts, tile_form
from ._policy import (
    AUTO_COMPILE_ELEMENTS,
    Call,
    compiler_missing,
    compiles_eagerly,
    own_compile_refused,
)

NAME = "compiled-mlp"


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
    """The form its compiled bodies run for the call's stack (`_tilemlp_forward.forward_form`)."""
    return tile_form(call.stack, call.leaves["w_in"], traced=True, exporting=False)


# The runner: tiles `indices` of a stack, `(len(indices), TH, TW * K)`, through its tile MLP
# compiled in the variant `form`, cut into `spans` (`evaluate_tile_parts`).
tiles = partial(evaluate_tile_parts, compiled=True)
