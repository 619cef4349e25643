"""The `graph` path of `gb.apply`: a plan's generation, every stack's g-nets and their layout,
compiled once per plan as one graph, forward and backward.

Called op by op, a genome of cheap g-nets (row g-nets, small hidden layers) spends most of
its step laying tiles out on each weight's grid, cutting them, and in the backward of both;
compiled as one graph (AOTAutograd) those become a few fused kernels, and the tile MLP inside
runs as under an outer `torch.compile`. `gbfunc._dispatch` decides where it runs. The graph's
backward cannot be differentiated again: double backward needs `gb.apply(..., compile=False)`.
"""

from torch import Tensor

from ._compiled import CompiledCache
from ._plan import Plan
from ._select import Selection, full_region

# Per plan and stack-leaf names: the plan's generation, compiled, and what it generates.
_GRAPHS = CompiledCache("gb.apply's graph")
_SELECTIONS: dict[tuple, Selection] = {}


def generate(plan: Plan, stacks: dict[str, dict[str, Tensor]]) -> dict[str, Tensor] | None:
    """`{name: tensor}` of every generated parameter of `plan` from its g-nets `stacks`,
    through the plan's compiled graph (the first call compiles: seconds). Returns None, having
    warned once, where the plan cannot be compiled (e.g. no C++ compiler): run it op by op."""
    key = (plan, tuple((k, tuple(v)) for k, v in stacks.items()))
    if key not in _SELECTIONS:
        _SELECTIONS[key] = Selection(plan, {p.name: full_region(p.shape) for p in plan.generated})
    return _GRAPHS.call(key, _generated, _SELECTIONS[key], stacks)


def _generated(selection: Selection, stacks: dict[str, dict[str, Tensor]]) -> dict[str, Tensor]:
    """The generated parameters `selection` covers, from the g-nets `stacks`."""
    return selection.apply({"stacks": stacks, "free": {}, "frozen": {}}, compile=False)
