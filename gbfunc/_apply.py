"""`gb.apply`: g-net parameters in, every p-net parameter out, as a pure function."""

from torch import Tensor

from ._condition import condition_of, conditioned, folded, without_condition
from ._dispatch import Route, check_call, context_of, route, runner
from ._plan import Plan
from ._tiling import parameters
from ._tracing import autocast_off
from ._tree import GParams, first_leaf
from .generate import graph, torch_ops


def apply(
    gparams: GParams,
    plan: Plan,
    *,
    condition: Tensor | None = None,
    task: int | Tensor | None = None,
    check: bool = False,
    backend: str = "auto",
    compile: bool | None = None,
) -> dict[str, Tensor]:
    """Generate every parameter of the p-net described by `plan`.

    Each stack's g-nets are evaluated on their tiles in one batched call; tiles are laid out
    on each weight's grid, cut to its shape and scaled. Free parameters pass through. Pure:
    no module is touched, so it composes with `torch.func.grad`, `vmap` and `torch.compile`.
    Under `torch.autocast` the weights are still generated in the g-nets' dtype (autocast
    applies to the p-net's ops that use them).

    Args:
        gparams: From `gb.init(plan, ...)` (or trained from it).
        plan: The plan that made `gparams`.
        condition: For a plan whose g-nets read a condition (`gb.plan(..., condition=w)`):
            the vector `(w,)` to generate the weights for. `torch.func.vmap` over it gives
            one weight set per condition.
        task: Instead of `condition`, the index of a learned task embedding
            (`gb.plan(..., tasks=n)`): an int, or a 0-d integer tensor under `vmap`.
        check: Also reject NaN or inf in `gparams` and `condition` (reads values: not for
            compiled code).
        backend: `"torch"`, `"triton"` (fused kernels, `gbfunc.kernels`; through Triton's
            interpreter on CPU) or `"auto"`: Triton for CUDA tensors, torch otherwise.
        compile: Whether an eager call may generate through compiled code of gbfunc's own
            (the plan compiled as one graph, a stack's tile MLP compiled, or the CPU's C
            loops; each path's rule is in its module of `gbfunc.generate`, `gbfunc._dispatch`
            applies them and `gb.explain` shows them). `None`: where it pays (plans of
            `AUTO_GRAPH_WEIGHTS` weights or more; stacks of `AUTO_COMPILE_ELEMENTS` hidden
            activations); with gradients off, no graph unless `True` (the C loops, or a large
            stack's compiled tile MLP). `False`: never
            (for debugging). A double backward or batched gradients take the graph's
            gradient op by op (its compiled backward cannot). The first compiling call
            takes seconds; the result is the same either way, to rounding.

    Returns:
        A dict of every parameter by name, ready for
            `torch.func.functional_call(model, params, args)`.

    Examples:
        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> params = gb.apply(gb.init(plan), plan)
        >>> torch.func.functional_call(model, params, (torch.randn(2, 64),)).shape
        torch.Size([2, 32])
    """
    check_call(
        gparams,
        plan,
        "gb.apply",
        backend=backend,
        compile=compile,
        values=check,
        condition=condition,
    )
    with autocast_off(first_leaf(gparams["stacks"])):
        return _generate(gparams, plan, condition, task, backend, compile)


def _generate(
    gparams: GParams,
    plan: Plan,
    condition: Tensor | None,
    task: int | Tensor | None,
    backend: str,
    compile: bool | None,
) -> dict[str, Tensor]:
    """`apply`'s work once the call is checked."""
    z, routed, stacks = None, plan, gparams["stacks"]
    if plan.condition or condition is not None or task is not None:  # else nothing to fold
        z = condition_of(gparams, plan, condition, task, "gb.apply")
        routed, stacks = without_condition(plan, stacks)
    path = route(routed, stacks, context_of(stacks, backend=backend, compile=compile))
    if path.plan == graph.NAME:  # folds the condition in inside, so that its inputs stay leaves
        params = graph.generate(plan, gparams, condition, task, op_by_op)
        if params is not None:  # None: the graph cannot be used (warned), so op by op
            return params
    if z is not None:  # the other paths run the plan without a condition, `z` folded in
        gparams, plan = conditioned(gparams, plan, z)
    return parameters(plan.params, gparams, generated(gparams, plan, path))


def generated(gparams: GParams, plan: Plan, path: Route) -> dict[str, Tensor]:
    """Every generated parameter of `plan` (without a condition), each stack's by its path's
    runner in its variant, as `path` has them (`graph` there: its compile failed, so op by
    op, eagerly)."""
    weights = {}
    for index, stack in enumerate(plan.stacks):
        name, form = path.stacks[index], path.variants[index]
        if name == graph.NAME:
            name, form = torch_ops.NAME, torch_ops.EAGER
        leaves = gparams["stacks"][stack.key]
        weights.update(runner(name).stack_weights(plan, index, leaves, form, path.traced))
    return weights


def op_by_op(
    plan: Plan, gparams: GParams, *, condition: Tensor | None, task: int | Tensor | None
) -> dict[str, Tensor]:
    """Every generated parameter of `plan`, as the `graph` path traces them: the condition
    folded in, then each stack on the path the dispatcher chooses inside the trace (with
    `compile=False`: the graph is gbfunc's compiled code, nothing is compiled inside it)."""
    gparams, plan = folded(gparams, plan, condition, task, "gb.apply")
    stacks = gparams["stacks"]
    context = context_of(stacks, backend="torch", compile=False)
    return generated(gparams, plan, route(plan, stacks, context))
