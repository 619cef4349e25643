"""The `graph` path: a plan's generation, every stack's g-nets and their layout, compiled once
per plan as one graph, forward and backward.

Called op by op, a genome of cheap g-nets (row g-nets, small hidden layers) spends most of
its step laying tiles out on each weight's grid, cutting them, and in the backward of both;
compiled as one graph (AOTAutograd) those become a few fused kernels, and the tile MLP inside
runs as under an outer `torch.compile` (the `cpu-loops` stacks run their loops inside it).
Taken eagerly where compiling is asked for and every stack fits one graph: `compile=True`,
or `None` with gradients on and a plan where it pays (`compiling_asked`).
The graph runs on the g-nets' leaves themselves. Its compiled backward cannot be differentiated
again nor take batched gradients (`is_grads_batched`): there, hooks on its autograd node
make the gradient op by op from the same leaves (`_OpByOpWhereNeeded`), so that gradient
penalties, MAML and Jacobians work whatever path `compile=None` chose; every other backward
costs the compiled one alone.
"""

import weakref
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor
from torch._dynamo.utils import counters
from torch.autograd.graph import Node, get_gradient_edge

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
    signature = tuple(
        (k, tuple((n, t.dtype, t.requires_grad) for n, t in v.items())) for k, v in stacks.items()
    )
    # The loops' state too: a graph traced with them keeps calling them (dynamo's guards on
    # it are dropped), so switching them off would not reach it.
    key = (plan, signature, torch.is_grad_enabled(), loops_state())
    tasks = gparams.get(TASKS) if task is not None else None
    if task is not None and not isinstance(task, Tensor):  # numpy's integers too, checked
        task = torch.tensor(task_number(task, plan.tasks, "gb.apply"))
    # On the g-nets' device whatever the default (`with torch.device("meta")`, FSDP2's way to
    # build a model, put the constants the trace makes, the code tables, on meta).
    leaf = first_leaf(stacks)
    device = torch.device("cpu") if leaf is None else leaf.device
    # (entered only where needed: the context is a torch function mode, which every torch
    # call in the compiled code's Python wrappers would go through; with no function mode on,
    # the default is the CPU, known without `torch.get_default_device`'s 10 us)
    with nullcontext() if _default_is(device) else device:
        compiles = _compiles()
        graph = _GRAPHS.call(key, _generated, op_by_op, plan, stacks, tasks, condition, task)
    if graph is None:
        return None
    # The compiled node's outputs, in the order of the dict it returns (stack by stack).
    outputs = list(graph.values())
    node = next((o.grad_fn for o in outputs if o.grad_fn is not None), None)
    # Nothing to differentiate, or op-by-op outputs (`torch.compile` replaced, in tests)
    # that take every backward (AOTAutograd's node: a name private to torch, which
    # `tests/test_compose.py`'s double backward through the graph would see change).
    if type(node).__name__ != "CompiledFunctionBackward":
        return parameters(plan.params, gparams, graph)
    # What the op-by-op gradient reads, fixed now (the caller may change its dicts later).
    args = (op_by_op, plan, {k: dict(v) for k, v in stacks.items()}, tasks, condition, task)
    leaves = _leaves(*args[2:5])
    refused = _misaligned(node, outputs)
    if refused is None and _compiles() != compiles:  # a new graph (or a recompile of one)
        refused = _compile_backward_keeping_graphs(outputs, leaves)
    if refused is not None:
        _GRAPHS.forget(key, f"{_GRAPHS.what} is not used ({refused})")
        return None
    _OpByOpWhereNeeded(node, leaves, lambda: _generated(*args))
    return parameters(plan.params, gparams, graph)


def _misaligned(node: Node, outputs: list[Tensor]) -> str | None:
    """Why the op-by-op gradients cannot be hooked onto the graph's backward `node` (None:
    they can): every output that requires grad must come straight from it, in order."""
    for i, output in enumerate(outputs):
        if output.grad_fn is not None and (output.grad_fn is not node or output.output_nr != i):
            return f"output {i} is not the compiled graph's own (a view?)"
    return None


def _default_is(device: torch.device) -> bool:
    """Whether `device` is torch's default device (`torch.set_default_device`'s or a `with
    torch.device(...)`'s, both torch function modes)."""
    if torch._C._len_torch_function_stack() == 0:
        return device.type == "cpu"
    return torch.get_default_device() == device


def _compiles() -> int:
    """How many graphs dynamo has compiled in this process."""
    return counters["stats"]["unique_graphs"]


def _leaves(
    stacks: dict[str, dict[str, Tensor]], tasks: Tensor | None, condition: Tensor | None
) -> list[Tensor]:
    """The graph's inputs that require grad, in order."""
    tensors = [t for v in stacks.values() for t in v.values()] + [tasks, condition]
    return [t for t in tensors if t is not None and t.requires_grad]


def _compile_backward_keeping_graphs(outputs: list[Tensor], leaves: list[Tensor]) -> str | None:
    """Run a new graph's first backward with its graph retained (gradient zero, discarded);
    why the graph cannot be used where that fails (None: it can).
    AOTAutograd compiles the backward on its first run, and one that frees the graph lets it
    reuse the saved tensors' memory ("donated buffers"), after which every backward that
    keeps the graph (a retained graph's second, a double backward) raises. Compiled this way,
    the backward donates nothing; the outputs' graph stays whole for the caller's backward
    (hooks on the leaves see that zero gradient once, on the call that compiles).
    A backward that donates already (loaded from AOTAutograd's cache, written by a gbfunc
    before 2026-12-02 for this graph) raises here."""
    live = [o for o in outputs if o.grad_fn is not None]
    zeros = [torch.zeros_like(o) for o in live]
    try:
        torch.autograd.grad(live, leaves, zeros, retain_graph=True, allow_unused=True)
    except RuntimeError as error:
        if "donated buffer" not in str(error):
            raise
        return "its compiled backward reuses the saved tensors' memory (donated buffers)"
    return None


class _OpByOpWhereNeeded:
    """Hooks on one call's compiled backward `node` for what a compiled backward cannot do: a
    double backward (gradients enabled in the backward: `create_graph=True`) and batched
    gradients (`is_grads_batched`). There, the node's gradients are replaced by ones made op
    by op (`op_by_op()`, the graph's outputs from the same `leaves`): differentiable again,
    batched where the outputs' gradients are. The compiled backward is handed zeros then and
    its result dropped. Every other backward is the compiled one alone."""

    def __init__(
        self, node: Node, leaves: list[Tensor], op_by_op: Callable[[], dict[str, Tensor]]
    ) -> None:
        self.leaves, self.op_by_op = leaves, op_by_op
        self.grads: tuple[Tensor | None, ...] | None = None
        self.node = weakref.ref(node)  # the node holds this object: no cycle through it
        node.register_prehook(self.before)
        node.register_hook(self.after)

    def before(self, grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...] | None:
        """Keep the outputs' gradients where the compiled backward cannot take them, and hand
        it zeros instead."""
        # Set on every call: a stash left by a backward that failed must not reach the next.
        needed = torch.is_grad_enabled() or legacy_batched(grads)
        self.grads = grads if needed else None
        if not needed:
            return None
        return tuple(
            None if g is None else torch.zeros(g.shape, dtype=g.dtype, device=g.device)
            for g in grads
        )

    def after(
        self, grad_inputs: tuple[Tensor | None, ...], grad_outputs: tuple[Tensor | None, ...]
    ) -> tuple[Tensor | None, ...] | None:
        """The node's gradients made op by op, where `before` kept the outputs'."""
        grads, self.grads = self.grads, None
        node = self.node()
        if grads is None or node is None:
            return None
        with torch.enable_grad():
            made = self.op_by_op()
        # The node's gradients go to its edges, each leaf's to the first edge that is its
        # (dynamo passes a tensor given twice once).
        edge_of = {_edge(x): x for x in reversed(self.leaves)}
        targets = [edge_of.pop(edge, None) for edge in node.next_functions]
        wanted = [x for x in targets if x is not None]
        user = grads[: len(made)]  # the graph's outputs come first (`_misaligned`)
        pairs = [(o, g) for o, g in zip(made.values(), user, strict=True) if g is not None]
        if not (wanted and pairs):
            return tuple(None for _ in targets)
        leaf_grads = torch.autograd.grad(
            [o for o, _ in pairs],
            wanted,
            [g for _, g in pairs],
            create_graph=torch.is_grad_enabled(),
            allow_unused=True,
        )
        by_leaf = dict(zip(map(id, wanted), leaf_grads, strict=True))
        return tuple(None if x is None else by_leaf[id(x)] for x in targets)


def _edge(tensor: Tensor) -> tuple[Node, int]:
    """Where autograd sends `tensor`'s gradient: a node (compared by identity) and its input."""
    edge = get_gradient_edge(tensor)
    return edge.node, edge.output_nr


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
