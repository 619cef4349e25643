"""The `cpu-loops` path: C++ loops from a stack's g-net leaves straight to its weights and
back (`gbfunc.cpu`).

Taken for one-layer ReLU row or one-output g-nets, one per tile, on CPU in float32 with the
loops built, whose parameters are generated whole and not centred: traced by
`torch.compile`, or eagerly where compiling is asked for (`compiling_asked`).
"""

from collections.abc import Mapping

from torch import Tensor

from .._plan import Plan, Stack
from .._spec import HASH_GAIN
from ..cpu import Placement, add_hash, refusal, weights
from ._policy import AUTO_GRAPH_WEIGHTS, Call, compiler_missing, compiling_asked

NAME = "cpu-loops"
# Its variants: called straight eagerly, without the custom ops' dispatch (tens of
# microseconds a call); through the ops (their autograd and vmap rules, opaque to inductor)
# where traced or transformed.
DIRECT = "direct"
OPS = "ops"


def refuses(call: Call) -> str | None:
    """Why the loops do not generate the call's stack (None: they do)."""
    context = call.context
    if context.exporting:
        return "torch.export keeps standard ops"
    if context.dynamo_off:
        return "dynamo is switched off (torch._dynamo.config.disable)"
    if not context.compiling:
        if context.transformed:
            return "called eagerly inside a torch.func transform (compile it to take them)"
        if context.compile is False:
            return "compile=False"
        asked = context.compile if call.plan is None else compiling_asked(call.plan, context)
        if not asked:
            return f"compile=None and the plan is small (< {AUTO_GRAPH_WEIGHTS} weights)"
    if not call.placed:
        return "its parameters are selected in parts, or centred (center=True)"
    if context.eager and context.device == "cpu" and (missing := compiler_missing(call)):
        return missing  # (traced: `refusal` asks the loops, which know it too)
    if call.plan is not None and _centred(call.plan, call.index):
        return "a parameter it generates is centred (center=True reads whole rows first)"
    w_out = call.leaves["w_out"]
    return refusal(call.stack, w_out.dtype, w_out.device.type, detail=call.detail)


def variant(call: Call) -> str:
    """`DIRECT` for a plainly eager call, else `OPS` (`gbfunc.cpu` picks its loop by the
    g-nets' shape)."""
    return DIRECT if call.context.eager else OPS


def generate(
    stack: Stack, leaves: Mapping[str, Tensor], where: Placement, form: str
) -> list[Tensor]:
    """The weights of `stack` (matrices `(rows, columns)`, in the order `where` places them)
    from its leaves, written by the loops where they land, in the variant `form`; a hashed
    stack's table is added there too."""
    direct = form == DIRECT
    generated = weights(stack, leaves, where, direct=direct)
    if stack.genome.hashed:
        positions, rows = stack.tile_positions, stack.tile[0]
        table = leaves["tile_hash"]
        generated = add_hash(generated, table, positions, rows, where, HASH_GAIN, direct=direct)
    return list(generated)


def _centred(plan: Plan, index: int) -> bool:
    """Whether a parameter that stack `index` of `plan` generates is centred."""
    return any(p.center for p in plan.generated if p.stack_index == index)
