"""The `graph` path of `gb.apply`: a plan's generation, every stack's g-nets and their layout,
compiled once per plan as one graph, forward and backward.

Called op by op, a genome of cheap g-nets (row g-nets, small hidden layers) spends most of
its step laying tiles out on each weight's grid, cutting them, and in the backward of both;
compiled as one graph (AOTAutograd) those become a few fused kernels, and the tile MLP inside
runs as under an outer `torch.compile`. `gbfunc._dispatch` decides where it runs. The graph's
backward cannot be differentiated again: double backward needs `gb.apply(..., compile=False)`.
"""

import torch
from torch import Tensor

from ._check_gparams import TASKS
from ._compiled import CompiledCache
from ._plan import Plan
from ._select import Selection
from ._tiling import full_region
from ._tree import GParams

# Per plan and stack-leaf names: the plan's generation, compiled, and what it generates.
_GRAPHS = CompiledCache("gb.apply's graph")
_SELECTIONS: dict[tuple, Selection] = {}


def generate(
    plan: Plan,
    gparams: GParams,
    condition: Tensor | None = None,
    task: int | Tensor | None = None,
) -> dict[str, Tensor] | None:
    """`{name: tensor}` of every generated parameter of `plan` from the g-nets of `gparams`
    (for `condition` or `task` where the plan reads one, as `gb.apply` takes them), through
    the plan's compiled graph (the first call compiles: seconds). The condition is folded in
    inside the graph, whose inputs are the leaves, and a task id enters as a tensor (one
    graph for every task). Returns None, having warned once, where the plan cannot be
    compiled (e.g. no C++ compiler): run it op by op."""
    stacks = gparams["stacks"]
    key = (plan, tuple((k, tuple(v)) for k, v in stacks.items()))
    if key not in _SELECTIONS:
        _SELECTIONS[key] = Selection(plan, {p.name: full_region(p.shape) for p in plan.generated})
    tasks = gparams.get(TASKS) if task is not None else None
    task = torch.tensor(task) if isinstance(task, int) else task
    return _GRAPHS.call(key, _generated, _SELECTIONS[key], stacks, tasks, condition, task)


def _generated(
    selection: Selection,
    stacks: dict[str, dict[str, Tensor]],
    tasks: Tensor | None,
    condition: Tensor | None,
    task: Tensor | None,
) -> dict[str, Tensor]:
    """The generated parameters `selection` covers, from the g-nets `stacks`."""
    gparams = {"stacks": stacks, "free": {}, "frozen": {}}
    if tasks is not None:
        gparams[TASKS] = tasks
    return selection.apply(gparams, condition=condition, task=task, compile=False)
