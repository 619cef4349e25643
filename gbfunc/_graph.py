"""Eager `gb.apply` as one compiled graph per plan: every stack's g-nets and their layout.

Called op by op, a genome whose g-nets are cheap (row g-nets, small hidden layers) spends
most of its step outside them: laying tiles out on each weight's grid, cutting them, and the
backward of both (zero-filled gradients, concatenations). Compiled once per plan as a single
graph, forward and backward (AOTAutograd), those become a few fused kernels; the tile MLP
inside runs as it does under an outer `torch.compile`. Measured on the MLP 784-512-512-10
(2 threads, AVX2): row g-nets 1.5-1.7x the plain eager step -> 1.2-1.3x; torchGB's genome at
`compression=10` 2.4-2.7x -> 2.1-2.3x.

Plans whose stacks are all row g-nets or one-output g-nets of one ReLU layer (on CPU, in
float32) skip the graph: C loops take their leaves to the weights and back
(`gbfunc._relu_rows`, `gbfunc._relu_tiles`), without the wrappers AOTAutograd puts around a
graph.

A graph holds a stack's hidden activations (`T * TH * Q * H` elements) whole. Where they are
matmul operands (several outputs or hidden layers: the backward, and the forward of more than
16 outputs or of hidden layers) and larger than `COMPILED_CHUNK_ELEMENTS`, the stacks run
through the tile MLP's compiled bodies instead, in chunks (`gbfunc._tilemlp`), which bounds
the step's peak memory. The graph's backward cannot be differentiated again: double backward
(`create_graph=True`) needs `gb.apply(..., compile=False)`.
"""

import torch
from torch import Tensor

from . import _tilemlp
from ._compiled import CompiledCache
from ._evaluate import compiles_eagerly
from ._plan import Plan, Stack
from ._select import Selection, full_region

# `gb.apply(compile=None)` compiles a plan's graph from this many generated weights on: the
# MLP 784-512-512-10 (669k) pays back its compile (~10-15 s on 2 cores) in a few thousand
# steps; models of a few thousand weights (tests, examples) stay uncompiled.
AUTO_GRAPH_WEIGHTS = 1 << 18

# Per plan and stack-leaf names: the plan's generation, compiled, and what it generates.
_GRAPHS = CompiledCache("gb.apply's graph")
_SELECTIONS: dict[tuple, Selection] = {}


def fits_graph(stack: Stack) -> bool:
    """Whether a graph may hold this stack whole: inductor fuses its MLP into reductions (one
    hidden layer, one output) or its transient is no larger than one compiled chunk."""
    if stack.one_reduction:
        return True
    return stack.hidden_elements <= _tilemlp.COMPILED_CHUNK_ELEMENTS


def runs_as_graph(plan: Plan, compile: bool | None) -> bool:
    """Whether eager `gb.apply(compile=compile)` generates `plan` through its compiled graph
    (`None`: with gradients enabled, for plans large enough to pay for the compile)."""
    if compile is False or not plan.stacks or not all(fits_graph(s) for s in plan.stacks):
        return False
    if compile:
        return True
    if not torch.is_grad_enabled():
        return False  # evaluation, export: one generation per use, not worth a compile
    return _large(plan) or any(compiles_eagerly(s, None) for s in plan.stacks)


def evaluates_through_loops(plan: Plan, compile: bool | None) -> bool:
    """Whether eager `gb.apply(compile=compile)`, compiling no graph for evaluation (`None`,
    gradients off), still takes a plan of `AUTO_GRAPH_WEIGHTS` weights or more through the C
    loops where all its stacks suit them (`Selection.runs_direct`): the loops build in seconds
    once per machine (cached on disk) and generate faster than op by op (1M weights of
    one-output g-nets, one thread: 1.2 ms against 3.1)."""
    return compile is None and not torch.is_grad_enabled() and _large(plan)


def _large(plan: Plan) -> bool:
    """Whether `plan` generates `AUTO_GRAPH_WEIGHTS` weights or more."""
    return sum(p.numel for p in plan.generated) >= AUTO_GRAPH_WEIGHTS


def eager_compiles(plan: Plan, compile: bool | None) -> bool:
    """Whether eager `gb.apply(compile=compile)` runs compiled code for `plan`: its graph, or
    the tile MLP of some stack."""
    return runs_as_graph(plan, compile) or any(compiles_eagerly(s, compile) for s in plan.stacks)


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
