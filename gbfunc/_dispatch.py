"""Which path generates each stack of a plan: the one place where gbfunc decides.

A call of `gb.apply` is described by a `Context` (device, dtype, `backend=`, `compile=`,
whether `torch.compile` traces it or a `torch.func` transform wraps it, grad mode, what the
machine offers), read once. Each path below is registered with the condition under which it
applies, as a function that returns why it does not (None: it does); a stack takes the first
path that applies, in this order, and `gb.explain` prints the verdicts.

- `triton`: fused Triton kernels, g-nets to weights, forward and backward. CUDA tensors with
  `triton` installed, or `backend="triton"` (on CPU: Triton's interpreter, eager only).
- `cpu-loops`: C++ loops from leaves to weights and back (`gbfunc.cpu`). One-layer ReLU row
  or one-output g-nets, one per tile, on CPU in float32 with the loops built; traced by
  `torch.compile`, or eager where compiling is asked for (`compiling_asked`).
- `graph`: the plan's generation compiled once as one graph, forward and backward. Eager,
  compiling asked for with gradients on, every stack fitting a graph (`fits_graph`), and not
  every stack on `cpu-loops` (those run inside the graph).
- `compiled-mlp`: the stack's tile MLP compiled once per signature, run in chunks. Eager,
  outside a graph: `compile=True`, or `None` on stacks of `AUTO_COMPILE_ELEMENTS` hidden
  activations.
- `torch`: pure torch, op by op; traced by `torch.compile`, inductor's code (on CPU calling
  the C loops' sub-ops where `gbfunc.cpu` has them built). Always applies.

Where a compile fails (e.g. no C++ compiler for inductor) the compiled paths fall back to
`torch` with one warning; the weights are the same on every path, to rounding.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ._backend import BACKENDS, HAS_TRITON, check_triton
from ._check_gparams import check_gparams
from ._compiled import dynamo_disabled
from ._condition import without_condition
from ._plan import Plan, Stack
from ._tilemlp import fits_graph
from ._tree import GParams
from .cpu import loops_state, missing_compiler, mode, refusal, unavailable_reason

# `compile=None` compiles a plan's graph from this many generated weights on: the MLP
# 784-512-512-10 (669k) pays back its compile (~10-15 s on 2 cores) in a few thousand steps;
# models of a few thousand weights (tests, examples) stay uncompiled.
AUTO_GRAPH_WEIGHTS = 1 << 18
# `compile=None` compiles a stack's tile MLP in eager mode from this many elements of its
# transient `(T, TH, Q, H)` on (about 1M): such a stack costs milliseconds per step eagerly,
# and its compile (a few seconds) pays back within a few thousand steps.
AUTO_COMPILE_ELEMENTS = 1 << 20

PATHS = ("triton", "cpu-loops", "graph", "compiled-mlp", "torch")


class Context(NamedTuple):
    """What a call of `gb.apply` decides its paths from, read once per call."""

    device: str  # the g-nets' device type
    dtype: torch.dtype  # their dtype
    backend: str  # gb.apply's `backend=`
    compile: bool | None  # gb.apply's `compile=`
    compiling: bool  # traced by torch.compile
    exporting: bool  # traced by torch.export
    transformed: bool  # inside a torch.func transform (grad, vmap...)
    grad: bool  # gradients enabled
    dynamo_off: bool  # torch._dynamo.config.disable: nothing compiles
    dispatch_mode: bool  # inside a TorchDispatchMode (FlopCounterMode...): compiled code cannot run

    @staticmethod
    def now(
        stacks: Mapping[str, Mapping[str, Tensor]], *, backend: str, compile: bool | None
    ) -> "Context":
        """The context of a call on the g-net leaves `stacks`, from the process's state
        (`backend` and `compile` checked by `check_call`)."""
        leaf = next((x for leaves in stacks.values() for x in leaves.values()), None)
        return Context(
            device="cpu" if leaf is None else leaf.device.type,
            dtype=torch.float32 if leaf is None else leaf.dtype,
            backend=backend,
            compile=compile,
            compiling=torch.compiler.is_compiling(),
            exporting=torch.compiler.is_exporting(),
            transformed=torch._C._functorch.peek_interpreter_stack() is not None,
            grad=torch.is_grad_enabled(),
            dynamo_off=dynamo_disabled(),
            dispatch_mode=not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() > 0,
        )

    @property
    def eager(self) -> bool:
        """Neither traced nor transformed: where gbfunc may run compiled code of its own."""
        return not self.compiling and not self.transformed


def check_call(
    gparams: GParams,
    plan: Plan,
    call: str,
    *,
    backend: str,
    compile: bool | None,
    values: bool = False,
) -> None:
    """Refuse a `gb.apply` call's arguments; `gb.explain` runs the same checks, so that it
    explains exactly the calls `gb.apply` accepts. `values`: also NaN and inf (`check=True`)."""
    check_gparams(gparams, plan, call, values=values)
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"{call}: compile must be True, False or None, got {compile!r}.")
    if backend not in BACKENDS:
        raise ValueError(f"{call}: backend must be one of {BACKENDS}, got {backend!r}.")


class Route(NamedTuple):
    """The paths of a call: the plan's (`triton`, `graph`, or `stacks`: each its own) and
    each stack's, in plan order."""

    plan: str
    stacks: tuple[str, ...]


class _Call(NamedTuple):
    """One stack's decision: in `plan` (None: a selection of it), with the g-nets `stacks`;
    `placed`: its parameters are selected whole; `detail`: reasons say exactly why (for
    `gb.explain`; the hot path and traced code take fixed strings)."""

    plan: Plan | None
    stack: Stack
    stacks: Mapping[str, Mapping[str, Tensor]]
    context: Context
    placed: bool
    detail: bool = False
    index: int = -1  # the stack's index in `plan`

    @property
    def leaves(self) -> Mapping[str, Tensor]:
        return self.stacks[self.stack.key]


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
    verdicts = [
        _verdicts(_Call(plan, s, stacks, context, True, detail=detail, index=i))
        for i, s in enumerate(plan.stacks)
    ]
    chosen = tuple(_first(v) for v in verdicts)
    whole = "triton" if "triton" in chosen else "graph" if "graph" in chosen else "stacks"
    return Route(whole, chosen), verdicts


def stack_path(
    stack: Stack, leaves: Mapping[str, Tensor], context: Context, *, placed: bool
) -> str:
    """The path of one stack outside a plan graph (`Selection.apply`): `cpu-loops`,
    `compiled-mlp` or `torch`. `placed`: its parameters are selected whole (the loops write
    whole weights)."""
    call = _Call(None, stack, {stack.key: leaves}, context, placed)
    for name in ("cpu-loops", "compiled-mlp"):
        if _RULES[name](call) is None:
            return name
    return "torch"


def _verdicts(call: _Call) -> dict[str, str | None]:
    """Per path, in order, why it does not generate the call's stack (None: it may); the
    first None wins."""
    return {name: _RULES[name](call) for name in PATHS}


def compiling_asked(plan: Plan, context: Context) -> bool:
    """Whether an eager call compiles (or takes the loops) for `plan`: `compile=True`; with
    `None`, plans of `AUTO_GRAPH_WEIGHTS` weights, and with gradients on also plans with a
    stack of `AUTO_COMPILE_ELEMENTS` hidden activations (evaluation generates once per use,
    where a compile does not pay, but the loops, built once per machine, do)."""
    if context.compile is not None:
        return context.compile
    large = sum(p.numel for p in plan.generated) >= AUTO_GRAPH_WEIGHTS
    if not context.grad:
        return large
    return large or any(compiles_eagerly(s, None) for s in plan.stacks)


def compiles_eagerly(stack: Stack, compile: bool | None) -> bool:
    """Whether an eager call runs this stack's tile MLP compiled (`compile=None`: stacks of
    `AUTO_COMPILE_ELEMENTS` hidden activations)."""
    if compile is not None:
        return compile
    return stack.hidden_elements >= AUTO_COMPILE_ELEMENTS


_RULES: dict[str, Callable[[_Call], str | None]] = {}


def _path(name: str) -> Callable:
    """Register the rule of path `name`: a function of the call returning why it does not
    apply, or None."""

    def register(rule: Callable[[_Call], str | None]) -> Callable[[_Call], str | None]:
        _RULES[name] = rule
        return rule

    return register


@_path("triton")
def _triton(call: _Call) -> str | None:
    context = call.context
    if context.backend == "torch":
        return "backend='torch'"
    if context.backend == "auto":
        if context.device != "cuda":
            return f"backend='auto' takes Triton for CUDA tensors; these are on {context.device}"
        if not HAS_TRITON:
            return "triton is not installed (pip install 'gbfunc[triton]')"
    if call.plan is None:
        return "a selection of a plan is generated in torch"
    check_triton(call.stack.key, call.leaves, context.backend)  # raises where it cannot run
    return None


@_path("cpu-loops")
def _cpu_loops(call: _Call) -> str | None:
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
    if context.eager and context.device == "cpu" and (missing := _missing_compiler(call)):
        return missing  # (traced: `refusal` asks the loops, which know it too)
    if call.plan is not None and _centred(call.plan, call.index):
        return "a parameter it generates is centred (center=True reads whole rows first)"
    w_out = call.leaves["w_out"]
    return refusal(call.stack, w_out.dtype, w_out.device.type, detail=call.detail)


@_path("graph")
def _graph(call: _Call) -> str | None:
    context, plan = call.context, call.plan
    if plan is None:
        return "a selection of a plan is not compiled as one graph"
    if refused := _own_compile_refused(context):
        return refused
    if context.compile is None and not context.grad:
        return "evaluation (gradients off, compile=None) compiles no graph"
    if not compiling_asked(plan, context):
        return (
            f"compile=None and the plan is small (< {AUTO_GRAPH_WEIGHTS} weights, no stack of "
            f"{AUTO_COMPILE_ELEMENTS} hidden activations)"
            if context.compile is None
            else "compile=False"
        )
    if context.device == "cpu" and (missing := _missing_compiler(call)):
        return missing
    unfit = [s.key for s in plan.stacks if not fits_graph(s)]
    if unfit:
        return f"stacks {unfit} hold too many hidden activations for one graph"
    if all(_cpu_loops(call._replace(stack=s, index=i)) is None for i, s in enumerate(plan.stacks)):
        return "every stack runs the C loops: nothing left to compile"
    return None


@_path("compiled-mlp")
def _compiled_mlp(call: _Call) -> str | None:
    context = call.context
    if refused := _own_compile_refused(context):
        return refused
    if not compiles_eagerly(call.stack, context.compile):
        if context.compile is False:
            return "compile=False"
        return f"compile=None and the stack is small (< {AUTO_COMPILE_ELEMENTS} activations)"
    if context.device == "cpu" and (missing := _missing_compiler(call)):
        return missing
    return None


@_path("torch")
def _torch(call: _Call) -> str | None:
    return None


def _own_compile_refused(context: Context) -> str | None:
    """Why gbfunc cannot run compiled code of its own for this call (None: it can)."""
    if not context.eager:
        return "traced or transformed: the caller's graph holds it"
    if context.dynamo_off:
        return "dynamo is switched off (torch._dynamo.config.disable)"
    if context.dispatch_mode:
        return "a TorchDispatchMode is active: compiled code cannot run inside it"
    return None


def _first(verdicts: Mapping[str, str | None]) -> str:
    return next(name for name, reason in verdicts.items() if reason is None)


def _missing_compiler(call: _Call) -> str | None:
    """Why nothing compiled runs on CPU (no C++ compiler), warned once where eager code would
    have compiled (traced code: the caller's compile fails first)."""
    return missing_compiler(warn=call.context.eager and not call.detail)


def _centred(plan: Plan, index: int) -> bool:
    """Whether a parameter that stack `index` of `plan` generates is centred."""
    return any(p.center for p in plan.generated if p.stack_index == index)


@dataclass(frozen=True)
class Explanation:
    """What `gb.explain` found: the route a call would take, and why; `str()` is the report.

    Attributes:
        route: The plan's path and each stack's (`Route`).
        reasons: Per stack key, per path tried before the one taken, why it was not.
        lines: The report's lines: the call's context, then per stack its path and reasons.

    Examples:
        >>> plan = gb.plan(nn.Linear(64, 32), tile=(16, 16))
        >>> why = gb.explain(gb.init(plan), plan)
        >>> why.route
        Route(plan='stacks', stacks=('torch',))
        >>> print(why.lines[2])
        stack s0_16x16: torch
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
    context = Context.now(stacks, backend=backend, compile=compile)
    chosen, verdicts = _route(plan, stacks, context, detail=True)  # afresh, not the memo
    reasons = {
        s.key: {name: reason for name, reason in v.items() if reason is not None}
        for s, v in zip(plan.stacks, verdicts, strict=True)
    }
    lines = [
        f"gb.apply(backend={backend!r}, compile={compile!r}) on {context.device} "
        f"{str(context.dtype).removeprefix('torch.')}, gradients "
        f"{'on' if context.grad else 'off'}"
        + (", traced by torch.compile" if context.compiling else "")
        + (", inside a torch.func transform" if context.transformed else ""),
        f"plan path: {chosen.plan}; CPU loops: mode {mode()!r}, "
        + (unavailable_reason() or "available"),
    ]
    for stack, taken in zip(plan.stacks, chosen.stacks, strict=True):
        lines.append(f"stack {stack.key}: {taken}")
        for name in PATHS[: PATHS.index(taken)]:
            lines.append(f"    not {name}: {reasons[stack.key][name]}")
    return Explanation(chosen, reasons, tuple(lines))
