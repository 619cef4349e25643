"""The `cpu-loops` path: C++ loops from a stack's g-net leaves straight to its weights and
back (`gbfunc.cpu`).

Taken for one-layer ReLU row or one-output g-nets, one per tile, on CPU in float32 with the
loops built, whose parameters are generated whole and not centred: traced by
`torch.compile`, or eagerly where compiling is asked for (`compiling_asked`).
"""

import contextlib
from collections.abc import Mapping

import torch
from torch import Tensor

from .._plan import Plan, Stack, plan_of, token_of
from .._spec import HASH_GAIN
from ..cpu import Placement, add_hash, placement, refusal, weights
from ._policy import AUTO_GRAPH_WEIGHTS, PLAIN_ONLY, Call, compiler_missing, compiling_asked

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
    if context.dispatch_mode:  # a FakeTensorMode's tensors have no data for the loops
        return "a TorchDispatchMode is active: it would not see the loops' work"
    if context.forward_ad:
        return "forward-mode AD is active: the loops have no forward-mode rule"
    if context.plain:
        return PLAIN_ONLY
    if context.compiling and context.nested:  # torch 2.13: dynamo's fake tensors fail in the op
        return "traced inside nested torch.func transforms (grad of vmap): the ops fail there"
    if not context.compiling:
        if context.transformed:
            return "called eagerly inside a torch.func transform (compile it to take them)"
        if context.compile is False:
            return "compile=False"
        asked = context.compile if call.plan is None else compiling_asked(call.plan, context)
        if not asked and call.plan is None:
            return "compile=None: a selection takes them eagerly only with compile=True"
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


def stack_weights(
    plan: Plan, index: int, leaves: Mapping[str, Tensor], form: str, traced: bool
) -> dict[str, Tensor]:
    """The runner for a whole plan: `{name: weight}` of every parameter that stack `index` of
    `plan` generates, whole, written by the loops in the variant `form` (`generate`; the
    variant holds whether the call is `traced`)."""
    made = generate(plan.stacks[index], leaves, placement_of(plan, index), form)
    return {p.name: w.reshape(p.shape) for p, w in zip(plan.generated_by(index), made, strict=True)}


def placement_of(plan: Plan, index: int) -> Placement | None:
    """Where the loops write the weights of stack `index` of `plan` (`gbfunc.cpu.placement`),
    every parameter it generates whole; None where they cannot (a centred parameter)."""
    token = token_of(plan)
    if token is None:  # a plan made inside the traced function: traced as it is
        return placement(plan.stacks[index], plan.generated_by(index))
    return _placement(token, index)


@torch.compiler.assume_constant_result
def _placement(token: str, index: int) -> Placement | None:
    """`placement_of` the plan with this `token`, computed once per plan and stack, and run
    in Python where `torch.compile` traces it, not traced: its loops run per tile, and
    dynamo tracing them took a third of a two-layer GPT-2 step's compile (2,796 tiles).
    Cached in a dict: dynamo cannot take an `lru_cache` as a constant function."""
    key = (token, index)
    with contextlib.suppress(KeyError):  # one lookup: another thread may clear it after a test
        return _PLACEMENTS[key]
    if len(_PLACEMENTS) >= 256:
        _PLACEMENTS.clear()
    plan = plan_of(token)
    made = _PLACEMENTS[key] = placement(plan.stacks[index], plan.generated_by(index))
    return made


_PLACEMENTS: dict[tuple[str, int], Placement | None] = {}


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
    return any(p.center for p in plan.generated_by(index))
