"""The `compiled-mlp` path: a stack's tile MLP compiled once per signature, run in chunks
(`torch_ops.tile_mlp` with `compiled=True`).

Taken eagerly, outside a graph: `compile=True`, or `compile=None` on stacks of
`AUTO_COMPILE_ELEMENTS` hidden activations (`compiles_eagerly`). Its variants are the
traced forms of the `torch` path's (`variant`): the compiled bodies are traced code.
"""

from functools import partial

from . import torch_ops
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
    """The form its compiled bodies run for the call's stack (`_tile_mlp_forward.forward_form`)."""
    return torch_ops.tile_form(call.stack, call.leaves["w_in"], traced=True, exporting=False)


# The runners, the `torch` path's with the tile MLP compiled in the variant `form`: a whole
# plan's stack (`stack_weights`), some tiles of a stack cut into `spans` (`tiles`).
stack_weights = partial(torch_ops.stack_weights, compiled=True)
tiles = partial(torch_ops.evaluate_tile_parts, compiled=True)
