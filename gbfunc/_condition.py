"""Conditional genomes: one genome, a weight set per condition (a task, an input's features).

A condition `z` (width `plan.condition`) enters each conditioned g-net's first layer as
`z @ w_cond`, a shift of that layer's bias shared by all the g-net's tiles. So a call folds
it into `b_in` once and every generation path (torch, graph, C loops, Triton) runs the plan
without a condition, unchanged: forward, backward (into `w_cond` and `z`) and under
`torch.func.vmap` over conditions alike.
"""

from collections.abc import Mapping
from dataclasses import replace

import torch
from torch import Tensor

from ._check_gparams import TASKS
from ._numbers import as_integer
from ._plan import Plan
from ._tracing import eager_memo, transforms
from ._tree import GParams

COND_LEAF = "w_cond"


def condition_of(
    gparams: GParams,
    plan: Plan,
    condition: Tensor | None,
    task: int | Tensor | None,
    where: str,
) -> Tensor | None:
    """The condition vector of a call (`condition=` given, or the task embedding `task=`
    names), checked against `plan`; None for a plan without a condition."""
    if condition is not None and task is not None:
        raise ValueError(f"{where}: pass condition= or task=, not both.")
    width = plan.condition
    if not width:
        if condition is not None or task is not None:
            given = "condition=" if condition is not None else "task="
            raise ValueError(
                f"{where}: {given} was given, but the plan's g-nets read no condition; make "
                "the plan with gb.plan(..., condition=<width>)."
            )
        return None
    if task is not None:
        embedding = _task_embedding(gparams, plan, task, where)
        _check_device(embedding, "gparams['tasks']", gparams, plan, where)
        return embedding
    if condition is None:
        tasks = f" or task= (0..{plan.tasks - 1})" if plan.tasks else ""
        raise ValueError(
            f"{where}: the plan's g-nets read a condition of width {width}: pass "
            f"condition= (a tensor of shape ({width},)){tasks}."
        )
    if not isinstance(condition, Tensor):
        raise TypeError(
            f"{where}: condition must be a Tensor of shape ({width},), got "
            f"{type(condition).__name__}."
        )
    if tuple(condition.shape) != (width,) or not condition.is_floating_point():
        raise ValueError(
            f"{where}: condition has shape {tuple(condition.shape)} and dtype "
            f"{condition.dtype}; expected a floating tensor of shape ({width},) (for many "
            "conditions at once, torch.func.vmap over them)."
        )
    _check_device(condition, "condition", gparams, plan, where)
    return condition


def _check_device(z: Tensor, what: str, gparams: GParams, plan: Plan, where: str) -> None:
    """Raise unless `z`, the condition vector, is on the device of the g-nets that read it
    (one on `meta` multiplied with CPU weights gave zeros without a word)."""
    for stack in plan.stacks:
        w_cond = gparams["stacks"][stack.key].get(COND_LEAF) if stack.genome.condition else None
        if w_cond is not None and z.device != w_cond.device:
            raise ValueError(
                f"{where}: {what} is on {z.device} but the g-nets of stack "
                f"{stack.key!r} that read it are on {w_cond.device}; move it there."
            )


def _task_embedding(gparams: GParams, plan: Plan, task: int | Tensor, where: str) -> Tensor:
    """Row `task` of `gparams["tasks"]`; an int is range-checked, and so is a 0-d integer
    tensor where reading it is free (eager, on the CPU, also the ids a `vmap` batches);
    traced, where the graph runs (`_traced_row`); eagerly on a GPU (a host sync) it is
    indexed as it is."""
    if not plan.tasks:
        raise ValueError(
            f"{where}: task= needs learned task embeddings; make the plan with "
            "gb.plan(..., condition=<width>, tasks=<n>), or pass condition= vectors of your own."
        )
    table = gparams[TASKS]
    if isinstance(task, Tensor):
        not_integer = not _integer_tensor(task)
        if task.dim() != 0 or not_integer:
            raise (TypeError if not_integer else ValueError)(
                f"{where}: task must be an int or a 0-d integer tensor, got a {task.dtype} "
                f"tensor of shape {tuple(task.shape)} (for many tasks, torch.func.vmap over "
                "their ids)."
            )
        if task.device.type == "meta" and table.device.type != "meta":
            raise ValueError(
                f"{where}: task is on meta (no value) but gparams['tasks'] is on "
                f"{table.device}; pass it there, or as an int."
            )
        if task.device.type == "cpu" and not torch.compiler.is_compiling():
            ids = _unwrapped(task)  # every id of a vmapped batch, or the one
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= plan.tasks:
                raise ValueError(
                    f"{where}: task must be in 0..{plan.tasks - 1}, got "
                    f"tensor({low if low < 0 else high})."
                )
        index = task.reshape(1).to(table.device, torch.int64)  # index_select takes int64
        if torch.compiler.is_compiling():
            return _traced_row(table, index, plan.tasks, where)
        return table.index_select(0, index).squeeze(0)
    return table[task_number(task, plan.tasks, where)]


def _traced_row(table: Tensor, index: Tensor, tasks: int, where: str) -> Tensor:
    """Row `index` of `table`, traced: an id out of range raises where the graph runs (an
    assertion; under `vmap`, which has no rule for one, the row is NaN instead), where
    compiled CPU code indexing out of range aborted the process."""
    inside = (index >= 0) & (index < tasks)
    if transforms() == 0:
        torch._assert_async(inside.all(), f"{where}: task must be in 0..{tasks - 1}")
    row = table.index_select(0, index.clamp(0, tasks - 1)).squeeze(0)
    return torch.where(inside, row, torch.nan)


def _unwrapped(tensor: Tensor) -> Tensor:
    """The plain tensor under torch.func's wrappers: a `vmap`ped batch's every value."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(tensor):
        tensor = functorch.get_unwrapped(tensor)
    return tensor


def task_number(task: object, tasks: int, where: str) -> int:
    """`task` as an int in `0..tasks - 1` (Python's or numpy's integers, a 0-d integer tensor;
    not a bool): a `TypeError` for another kind, a `ValueError` for an integer tensor of
    another shape or one out of range, each beginning with `where`."""
    number = as_integer(task)
    if number is None or not 0 <= number < tasks:
        kind = number is None and not (isinstance(task, Tensor) and _integer_tensor(task))
        raise (TypeError if kind else ValueError)(
            f"{where}: task must be an int in 0..{tasks - 1}, got {task!r:.100}."
        )
    return number


def _integer_tensor(task: Tensor) -> bool:
    """Whether a task tensor holds integers (not floats, complex numbers or bools)."""
    return not (task.is_floating_point() or task.is_complex() or task.dtype == torch.bool)


def without_condition(
    plan: Plan, stacks: Mapping[str, Mapping[str, Tensor]]
) -> tuple[Plan, Mapping[str, Mapping[str, Tensor]]]:
    """The plan and g-net leaves a call is routed on: for a conditioned plan, the plan
    without its condition and the leaves without `w_cond`, which is what every path runs
    once the condition is folded in (`conditioned`)."""
    if not plan.condition:
        return plan, stacks
    leaves = {k: {n: t for n, t in v.items() if n != COND_LEAF} for k, v in stacks.items()}
    return unconditioned(plan), leaves


def conditioned(gparams: GParams, plan: Plan, z: Tensor) -> tuple[GParams, Plan]:
    """`(gparams, plan)` for the condition `z` as a plan without one: each conditioned
    stack's `b_in` shifted by `z @ w_cond`, `w_cond` and the task embeddings dropped."""
    stacks = {}
    for stack in plan.stacks:
        leaves = gparams["stacks"][stack.key]
        if stack.genome.condition:
            leaves = dict(leaves)
            w_cond = leaves.pop(COND_LEAF)  # (G, width, H), on z's device (`condition_of`)
            shift = torch.einsum("w,gwh->gh", z.to(w_cond.dtype), w_cond)
            leaves["b_in"] = leaves["b_in"] + shift
        stacks[stack.key] = leaves
    rest = {"stacks": stacks, "free": gparams["free"], "frozen": gparams["frozen"]}
    return rest, unconditioned(plan)


def folded(
    gparams: GParams,
    plan: Plan,
    condition: Tensor | None,
    task: int | Tensor | None,
    where: str,
) -> tuple[GParams, Plan]:
    """`(gparams, plan)` with a call's `condition` or `task` folded in (`conditioned`), or as
    they are for a plan without a condition (the arguments checked by `condition_of`)."""
    if plan.condition or condition is not None or task is not None:
        z = condition_of(gparams, plan, condition, task, where)
        if z is not None:
            return conditioned(gparams, plan, z)
    return gparams, plan


@eager_memo
def unconditioned(plan: Plan) -> Plan:
    """`plan` with no condition: its stacks' genomes read none and it has no task
    embeddings, naming no model (generation reads none). One object per plan for eager
    calls, as for a plan without a condition."""
    stacks = tuple(
        replace(s, genome=replace(s.genome, condition=0)) if s.genome.condition else s
        for s in plan.stacks
    )
    return replace(plan, stacks=stacks, tasks=0, source=None, buffer_names=())
