"""The `graph` path: a plan's generation, every stack's g-nets and their layout, compiled once
per plan as one graph, forward and backward.

Called op by op, a genome of cheap g-nets (row g-nets, small hidden layers) spends most of
its step laying tiles out on each weight's grid, cutting them, and in the backward of both;
compiled as one graph (AOTAutograd) those become a few fused kernels, and the tile MLP inside
runs as under an outer `torch.compile` (the `cpu-loops` stacks run their loops inside it).
Taken eagerly where compiling is asked for and every stack fits one graph: `compile=True`,
or `None` with gradients on and a plan where it pays (`compiling_asked`).
The graph's compiled backward cannot be differentiated again nor take batched gradients
(`is_grads_batched`): there, the gradient is made op by op from the graph's inputs
(`_Gradient`), so that gradient penalties, MAML and Jacobians work whatever path
`compile=None` chose.
"""

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from .._check_gparams import TASKS
from .._condition import task_number
from .._plan import Plan, Stack
from .._tiling import parameters
from .._tracing import legacy_batched
from .._tree import GParams, first_leaf
from ..cpu import loops_state
from . import compiled_mlp, cpu_loops, triton
from ._compiled import CompiledCache
from ._policy import (
    AUTO_COMPILE_ELEMENTS,
    AUTO_GRAPH_WEIGHTS,
    Call,
    compiler_missing,
    compiling_asked,
    own_compile_refused,
)
from ._traced_forms import tile_form

NAME = "graph"

# Per plan and stack-leaf names: the plan's generation, compiled.
_GRAPHS = CompiledCache("gb.apply's graph")


def refuses(call: Call) -> str | None:
    """Why the plan of the call is not compiled as one graph (None: it is)."""
    context, plan = call.context, call.plan
    if plan is None:
        return "a selection of a plan is not compiled as one graph"
    if refused := own_compile_refused(context):
        return refused
    kernels = [s.key for i, s in enumerate(plan.stacks) if _on_kernels(call, i, s)]
    if kernels:
        return f"stacks {kernels} run the Triton kernels"
    if context.compile is None and not context.grad:
        return "evaluation (gradients off, compile=None) compiles no graph"
    if not compiling_asked(plan, context):
        return (
            f"compile=None and the plan is small (< {AUTO_GRAPH_WEIGHTS} weights, no stack of "
            f"{AUTO_COMPILE_ELEMENTS} hidden activations)"
            if context.compile is None
            else "compile=False"
        )
    if context.device == "cpu" and (missing := compiler_missing(call)):
        return missing
    unfit = [s.key for s in plan.stacks if not fits_graph(s)]
    if unfit:
        return f"stacks {unfit} hold too many hidden activations for one graph"
    loops = (cpu_loops.refuses(call._replace(stack=s, index=i)) for i, s in enumerate(plan.stacks))
    if all(refused is None for refused in loops):
        return "every stack runs the C loops: nothing left to compile"
    return None


def _on_kernels(call: Call, index: int, stack: Stack) -> bool:
    """Whether stack `index` of the call's plan takes the Triton kernels, which no graph of
    ours holds."""
    if call.context.backend == "torch":
        return False
    return triton.refuses(call._replace(stack=stack, index=index)) is None


def fits_graph(stack: Stack) -> bool:
    """Whether one compiled graph may hold a stack's tile MLP whole: inductor fuses it into
    reductions (one hidden layer, one output), or its transient `(T, TH, Q, H)` is no larger
    than one compiled chunk (`compiled_mlp.COMPILED_CHUNK_ELEMENTS`)."""
    return stack.one_reduction or stack.hidden_elements <= compiled_mlp.COMPILED_CHUNK_ELEMENTS


def variant(call: Call) -> str:
    """The form the stack's tile MLP takes inside the graph: the `torch` path's, traced
    (`_traced_forms.forward_form`)."""
    return tile_form(call.stack, call.leaves["w_in"], traced=True, exporting=False)


def generate(
    plan: Plan,
    gparams: GParams,
    condition: Tensor | None,
    task: int | Tensor | None,
    op_by_op: Callable[..., dict[str, Tensor]],
) -> dict[str, Tensor] | None:
    """Every parameter of `plan` from `gparams` (for `condition` or `task` where the plan
    reads one, as `gb.apply` takes them), the generated ones through the plan's compiled graph
    (the first call compiles: seconds). `op_by_op(plan, gparams, condition=, task=)`
    is what the graph holds: the plan's generated parameters op by op
    (`gb.apply`'s, which asks the dispatcher for each stack's path at trace time). The
    condition is folded in inside the graph, whose inputs are the leaves, and a task id
    enters as a tensor (one graph for every task).
    Returns None, having warned once, where the plan cannot be compiled (e.g. no C++
    compiler): run it op by op."""
    stacks = gparams["stacks"]
    # What dynamo would otherwise recompile one code object for, past its limit of 8 (each
    # key compiles its own copy): the grad mode and each leaf's dtype and requires_grad.
    leaves = tuple(
        (k, tuple((n, t.dtype, t.requires_grad) for n, t in v.items())) for k, v in stacks.items()
    )
    # The loops' state too: a graph traced with them keeps calling them (dynamo's guards on
    # it are dropped), so switching them off would not reach it.
    key = (plan, leaves, torch.is_grad_enabled(), loops_state())
    tasks = gparams.get(TASKS) if task is not None else None
    if task is not None and not isinstance(task, Tensor):  # numpy's integers too, checked
        task = torch.tensor(task_number(task, plan.tasks, "gb.apply"))
    # Where gradients flow, the graph runs on leaves of its own, tied to these by `_Gradient`.
    grads_on = torch.is_grad_enabled()
    inputs: list[Tensor] = []  # the leaves that require grad, in order
    own: list[Tensor] = []  # the graph's own leaves standing for them

    def own_leaf(x: Tensor | None) -> Tensor | None:
        if not (grads_on and x is not None and x.requires_grad):
            return x
        inputs.append(x)
        own.append(x.detach().requires_grad_())
        return own[-1]

    traced = (
        {k: {n: own_leaf(t) for n, t in v.items()} for k, v in stacks.items()},
        own_leaf(tasks),
        own_leaf(condition),
    )
    differentiable = bool(inputs)
    # On the g-nets' device whatever the default (`with torch.device("meta")`, FSDP2's way to
    # build a model, put the constants the trace makes, the code tables, on meta).
    leaf = first_leaf(stacks)
    device = torch.device("cpu") if leaf is None else leaf.device
    # (entered only where needed: the context is a torch function mode, which every torch
    # call in the compiled code's Python wrappers would go through; with no function mode on,
    # the default is the CPU, known without `torch.get_default_device`'s 10 us)
    with nullcontext() if _default_is(device) else device:
        graph = _GRAPHS.call(key, _generated, op_by_op, plan, *traced, task)
    if graph is None:
        return None
    if differentiable:

        def eager(*leaves: Tensor) -> tuple[Tensor, ...]:
            swap = dict(zip(map(id, own), leaves, strict=True))
            other = lambda x: swap.get(id(x), x)
            made = _generated(
                op_by_op,
                plan,
                {k: {n: other(t) for n, t in v.items()} for k, v in traced[0].items()},
                other(traced[1]),
                other(traced[2]),
                task,
            )
            return tuple(made[p.name] for p in plan.generated)

        outputs = tuple(graph[p.name] for p in plan.generated)
        compiled = _Compiled(outputs, own, eager)
        tied = _Gradient.apply(compiled, *(o.detach() for o in outputs), *inputs)
        graph = {p.name: w for p, w in zip(plan.generated, tied, strict=True)}
    return parameters(plan.params, gparams, graph)


def _default_is(device: torch.device) -> bool:
    """Whether `device` is torch's default device (`torch.set_default_device`'s or a `with
    torch.device(...)`'s, both torch function modes)."""
    if torch._C._len_torch_function_stack() == 0:
        return device.type == "cpu"
    return torch.get_default_device() == device


class _Compiled:
    """One call's graph as `_Gradient` needs it: its outputs, the leaves of its own that it
    ran on, and how to make the outputs op by op from other leaves (`eager`)."""

    def __init__(
        self,
        outputs: tuple[Tensor, ...],
        leaves: list[Tensor],
        eager: Callable[..., tuple[Tensor, ...]],
    ) -> None:
        self.outputs: tuple[Tensor, ...] | None = outputs
        self.leaves, self.eager = leaves, eager

    def gradients(self, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        """The leaves' gradients through the compiled backward, which runs once: its graph
        is freed then, as a plain backward frees it."""
        outputs, self.outputs = self.outputs, None
        return _vjp(outputs, self.leaves, grads)


def _vjp(
    outputs: tuple[Tensor, ...], leaves: Sequence[Tensor], grads: tuple[Tensor | None, ...]
) -> tuple[Tensor | None, ...]:
    """The gradients of `leaves` from `outputs`' gradients `grads` (None: that output's is
    zero), differentiable again where gradients are enabled (a double backward's)."""
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
    return torch.autograd.grad(
        [o for o, _ in pairs],
        leaves,
        [g for _, g in pairs],
        create_graph=torch.is_grad_enabled(),
        allow_unused=True,
    )


class _Gradient(torch.autograd.Function):
    """The graph's outputs (computed already, passed detached), tied to the leaves it read.
    The backward gives the leaves their gradients through the compiled backward; where that
    cannot take them (a double backward's `create_graph=True`, batched gradients, a second
    backward of a retained graph) it makes them op by op from the leaves instead,
    differentiable again and batched where the outputs' gradients are."""

    @staticmethod
    def forward(ctx: Any, compiled: _Compiled, *tensors: Tensor) -> tuple[Tensor, ...]:
        count = len(compiled.leaves)
        ctx.compiled = compiled
        ctx.save_for_backward(*tensors[-count:])
        return tensors[:-count]

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        compiled, leaves = ctx.compiled, ctx.saved_tensors
        eager = torch.is_grad_enabled() or legacy_batched(grads)
        if not eager and compiled.outputs is not None:
            return (None, *(None for _ in grads), *compiled.gradients(grads))
        with torch.enable_grad():
            outputs = compiled.eager(*leaves)
        return (None, *(None for _ in grads), *_vjp(outputs, leaves, grads))


def _generated(
    op_by_op: Callable[..., dict[str, Tensor]],
    plan: Plan,
    stacks: dict[str, dict[str, Tensor]],
    tasks: Tensor | None,
    condition: Tensor | None,
    task: Tensor | None,
) -> dict[str, Tensor]:
    """The generated parameters of `plan` that `op_by_op` gives, from the g-nets `stacks`."""
    gparams = {"stacks": stacks, "free": {}, "frozen": {}}
    if tasks is not None:
        gparams[TASKS] = tasks
    return op_by_op(plan, gparams, condition=condition, task=task)
