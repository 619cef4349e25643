"""Which path generates each stack of a plan: the one place where gbfunc decides.

A call of `gb.apply` is described by a `Context` (device, dtype, `backend=`, `compile=`,
whether `torch.compile` traces it or a `torch.func` transform wraps it, grad mode, what the
machine offers), read once. Each path is a module of `gbfunc.generate` that owns its rule,
`refuses(call)` (why it does not apply; None: it does), its `variant(call)` (how it runs:
the form of the tile MLP, the loops' calls, the kernels' wrapper, chosen from the same
context and the stack) and its runner; a stack takes the first path that applies, in the
order of `PATHS`, and `gb.explain` prints the verdicts, and the path's variant beside it.

- `triton` (`generate/triton.py`): fused Triton kernels, g-nets to weights, forward and
  backward. CUDA tensors with `triton` installed, or `backend="triton"` (on CPU: Triton's
  interpreter, eager only).
- `cpu-loops` (`generate/cpu_loops.py`): C++ loops from leaves to weights and back
  (`gbfunc.cpu`). One-layer ReLU row or one-output g-nets, one per tile, on CPU in float32
  with the loops built; traced by `torch.compile`, or eager where compiling is asked for.
- `graph` (`generate/graph.py`): the plan's generation compiled once as one graph, forward
  and backward. Eager, compiling asked for (`compile=True`, or `None` with gradients on
  where it pays), every stack fitting a graph, and not every stack on `cpu-loops` (those
  run inside the graph).
- `compiled-mlp` (`generate/compiled_mlp.py`): the stack's tile MLP compiled once per
  signature, run in chunks. Eager, outside a graph: `compile=True`, or `None` on large stacks.
- `torch` (`generate/torch_ops.py`): pure torch, op by op; traced by `torch.compile`,
  inductor's code (on CPU calling the C loops' sub-ops where `gbfunc.cpu` has them built).
  Always applies.

Where a compile fails (e.g. no C++ compiler for inductor) the compiled paths fall back to
`torch` with one warning; the weights are the same on every path, to rounding.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd import forward_ad

from ._check_gparams import check_finite, check_gparams
from ._condition import without_condition
from ._plan import Plan, Stack
from ._tracing import dynamo_disabled, exporting, functions_traceable, transforms
from ._tree import GParams, first_leaf
from .cpu import loops_state, mode, unavailable_reason
from .generate import compiled_mlp, cpu_loops, graph, torch_ops, triton
from .generate._policy import Call, Context

BACKENDS = ("auto", "torch", "triton")
# The paths in the order they are tried; `torch` always applies.
PATHS = (triton, cpu_loops, graph, compiled_mlp, torch_ops)
NAMES = tuple(path.NAME for path in PATHS)
_BY_NAME = {path.NAME: path for path in PATHS}


def check_call(
    gparams: GParams,
    plan: Plan,
    call: str,
    *,
    backend: str,
    compile: bool | None,
    values: bool = False,
    condition: object = None,
) -> None:
    """Refuse a `gb.apply` call's arguments; `gb.explain` runs the same checks, so that it
    explains exactly the calls `gb.apply` accepts. `values`: also NaN and inf (`check=True`),
    in the g-nets and in `condition`."""
    check_gparams(gparams, plan, call, values=values)
    if values and isinstance(condition, Tensor) and condition.is_floating_point():
        check_finite(condition, "condition", call)
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"{call}: compile must be True, False or None, got {compile!r}.")
    if backend not in BACKENDS:
        raise ValueError(f"{call}: backend must be one of {BACKENDS}, got {backend!r}.")


def context_of(
    stacks: Mapping[str, Mapping[str, Tensor]], *, backend: str, compile: bool | None
) -> Context:
    """The context of a call on the g-net leaves `stacks`, from the process's state
    (`backend` and `compile` checked by `check_call`)."""
    leaf = first_leaf(stacks)
    compiling = torch.compiler.is_compiling()
    transformed = torch._C._functorch.peek_interpreter_stack() is not None
    return Context(
        device="cpu" if leaf is None else leaf.device.type,
        dtype=torch.float32 if leaf is None else leaf.dtype,
        backend=backend,
        compile=compile,
        compiling=compiling,
        exporting=exporting(),
        transformed=transformed,
        grad=torch.is_grad_enabled(),
        dynamo_off=dynamo_disabled(),
        dispatch_mode=not compiling and torch._C._len_torch_dispatch_stack() > 0,
        forward_ad=not compiling and forward_ad._current_level >= 0,
        nested=transformed and transforms() > 1,
        plain=compiling and not functions_traceable(),
    )


class Route(NamedTuple):
    """The paths of a call: the plan's (`triton`: every stack's, `graph`, or `stacks`: each its
    own, the kernels' included), each stack's, in plan order, each stack's variant of its
    path (`variant` of the path's module), and whether the call is traced
    by `torch.compile`: what the runners are given, so that none of them reads the context
    again."""

    plan: str
    stacks: tuple[str, ...]
    variants: tuple[str, ...]
    traced: bool


def route(plan: Plan, stacks: Mapping[str, Mapping[str, Tensor]], context: Context) -> Route:
    """The path of each stack of a whole-plan call (`gb.apply`) in `context`; remembered per
    plan, context, leaves' dtypes and devices and the loops' state for eager calls (traced
    ones decide once, at trace time)."""
    if context.compiling:
        return _route(plan, stacks, context)[0]
    leaves = tuple(
        (stacks[s.key]["w_out"].dtype, stacks[s.key]["w_out"].device) for s in plan.stacks
    )
    key = (plan, context, leaves, loops_state())
    found = _ROUTES.get(key)
    if found is None:
        if len(_ROUTES) >= 256:
            _ROUTES.clear()
        found = _ROUTES[key] = _route(plan, stacks, context)[0]
    return found


_ROUTES: dict[tuple, Route] = {}


def _route(
    plan: Plan,
    stacks: Mapping[str, Mapping[str, Tensor]],
    context: Context,
    *,
    detail: bool = False,
) -> tuple[Route, list[dict[str, str | None]]]:
    """The route, and per stack the verdicts it was chosen from (`detail`: exact reasons)."""
    calls = [
        Call(plan, s, stacks, context, True, detail=detail, index=i)
        for i, s in enumerate(plan.stacks)
    ]
    verdicts = [_verdicts(call) for call in calls]
    chosen = tuple(_first(v) for v in verdicts)
    if all(name == triton.NAME for name in chosen):
        whole = triton.NAME
    else:  # a stack the kernels cannot take sends the plan stack by stack (`triton.refuses`)
        whole = graph.NAME if graph.NAME in chosen else "stacks"
    if whole == graph.NAME:  # every stack runs traced, inside the plan's graph
        calls = [c._replace(context=c.context._replace(compiling=True)) for c in calls]
    variants = tuple(_BY_NAME[name].variant(c) for c, name in zip(calls, chosen, strict=True))
    return Route(whole, chosen, variants, context.compiling), verdicts


def stack_path(
    stack: Stack,
    leaves: Mapping[str, Tensor],
    context: Context,
    *,
    placed: bool,
    path: str | None = None,
) -> tuple[str, str]:
    """The path of one stack outside a plan graph (`Selection.apply`), `cpu-loops`,
    `compiled-mlp` or `torch` (or `path`, where the caller names it), and its variant.
    `placed`: its parameters are selected whole (the loops write whole weights)."""
    call = Call(None, stack, {stack.key: leaves}, context, placed)
    if path is None:
        first = (p for p in (cpu_loops, compiled_mlp) if p.refuses(call) is None)
        path = next(first, torch_ops).NAME
    return path, _BY_NAME[path].variant(call)


def runner(path: str) -> ModuleType:
    """The module of the path named `path`: its runners (`stack_weights` for a stack of a
    whole plan; `tiles` for a selection's, on the `torch` and `compiled-mlp` paths)."""
    return _BY_NAME[path]


def torch_variant(stack: Stack, leaves: Mapping[str, Tensor]) -> str:
    """The `torch` path's variant for a stack evaluated here and now, outside `gb.apply`
    (the rank-owned g-nets of `gbfunc.dist`)."""
    context = context_of({stack.key: leaves}, backend="torch", compile=False)
    return stack_path(stack, leaves, context, placed=False, path=torch_ops.NAME)[1]


def _verdicts(call: Call) -> dict[str, str | None]:
    """Per path, in order, why it does not generate the call's stack (None: it may); the
    first None wins."""
    return {path.NAME: path.refuses(call) for path in PATHS}


def _first(verdicts: Mapping[str, str | None]) -> str:
    return next(name for name, reason in verdicts.items() if reason is None)


@dataclass(frozen=True)
class Explanation:
    """What `gb.explain` found: the route a call would take, and why; `str()` is the report.

    Attributes:
        route: The plan's path and each stack's (`Route`).
        reasons: Per stack key, per path that does not take the stack, why (the paths after
            the one taken too; `lines` shows those before it).
        lines: The report's lines: the call's context, then per stack its path and reasons.

    Examples:
        >>> plan = gb.plan(nn.Linear(64, 32), tile=(16, 16))
        >>> why = gb.explain(gb.init(plan), plan)
        >>> why.route.plan, why.route.stacks, why.route.variants
        ('stacks', ('torch',), ('eager-recompute',))
        >>> print(why.lines[2])
        stack s0_16x16: torch (eager-recompute)
        >>> sorted(why.reasons["s0_16x16"])  # the paths tried before torch
        ['compiled-mlp', 'cpu-loops', 'graph', 'triton']
    """

    route: Route
    reasons: dict[str, dict[str, str]]
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return "\n".join(self.lines)


def explain(
    gparams: GParams, plan: Plan, *, backend: str = "auto", compile: bool | None = None
) -> Explanation:
    """Which path `gb.apply(gparams, plan, backend=backend, compile=compile)` would take for
    each stack if called here and now (device, dtype, grad mode, `torch.func` transforms,
    the CPU loops' state), and why the paths before it were not taken.

    Args:
        gparams: From `gb.init(plan)` (or trained from it), as `gb.apply` would be given.
        plan: The plan that made `gparams`.
        backend: `backend` of the `gb.apply` call to explain: `"torch"`, `"triton"` or
            `"auto"` (Triton for CUDA tensors, torch otherwise).
        compile: `compile` of that call: `None` (compiled code where it pays), `True`
            (wherever it can) or `False` (never).

    Returns:
        A `gb.Explanation`: `route` the paths taken, `reasons` why the others were not;
            `print(explanation)` shows the call's context and each stack's path.

    Examples:
        >>> plan = gb.plan(nn.Linear(64, 32), tile=(16, 16))
        >>> gb.explain(gb.init(plan), plan).route.stacks
        ('torch',)
    """
    check_call(gparams, plan, "gb.explain", backend=backend, compile=compile)
    plan, stacks = without_condition(plan, gparams["stacks"])  # routed as `gb.apply` routes
    return explanation(plan, stacks, context_of(stacks, backend=backend, compile=compile))


def explanation(
    plan: Plan, stacks: Mapping[str, Mapping[str, Tensor]], context: Context
) -> Explanation:
    """`gb.explain`'s report of the route of `plan`'s stacks in `context` (any context: the
    tests build a CUDA call's on CPU)."""
    chosen, verdicts = _route(plan, stacks, context, detail=True)  # afresh, not the memo
    reasons = {
        s.key: {name: reason for name, reason in v.items() if reason is not None}
        for s, v in zip(plan.stacks, verdicts, strict=True)
    }
    lines = [
        f"gb.apply(backend={context.backend!r}, compile={context.compile!r}) on {context.device} "
        f"{str(context.dtype).removeprefix('torch.')}, gradients "
        f"{'on' if context.grad else 'off'}"
        + (", traced by torch.compile" if context.compiling else "")
        + (", inside a torch.func transform" if context.transformed else ""),
        f"plan path: {chosen.plan}; CPU loops: mode {mode()!r}, "
        + (unavailable_reason() or "available"),
    ]
    for stack, taken, form in zip(plan.stacks, chosen.stacks, chosen.variants, strict=True):
        lines.append(f"stack {stack.key}: {taken} ({form})")
        for name in NAMES[: NAMES.index(taken)]:
            lines.append(f"    not {name}: {reasons[stack.key][name]}")
    return Explanation(chosen, reasons, tuple(lines))
