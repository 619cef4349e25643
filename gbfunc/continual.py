"""Continual learning with one task-conditioned genome: an output regulariser.

Tasks arrive one after another; one genome (`gb.plan(..., condition=w, tasks=n)`) generates a
weight set per task from its learned embedding. Before training task `t`, `targets` records
the weights it generates for the earlier tasks; while training, `penalty` keeps what it
generates for them where they were (von Oswald et al. 2020, "Continual learning with
hypernetworks"), so learning task `t` does not overwrite them. Only the genome and the task
embeddings are stored, whatever the number of tasks.

Examples:
    >>> model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> plan = gb.plan(model, tile="full", hidden=4, condition=4, tasks=3)
    >>> gparams = gb.init(plan)
    >>> earlier = gb.continual.targets(gparams, plan, tasks=[0, 1])  # before task 2
    >>> x = torch.randn(5, 16)
    >>> out = functional_call(model, gb.apply(gparams, plan, task=2), (x,))
    >>> loss = out.square().mean() + gb.continual.penalty(gparams, plan, earlier)
"""

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor
from torch.func import vmap

from ._apply import apply
from ._check_gparams import check_gparams
from ._condition import task_number
from ._numbers import real
from ._plan import Plan
from ._tree import GParams

# hypnettorch's default `beta` for its output regulariser (`hnet_regularizer`), on the same
# sum of squares: a strength that transfers between the two libraries.
STRENGTH = 0.01


def targets(gparams: GParams, plan: Plan, tasks: Iterable[int]) -> dict[int, dict[str, Tensor]]:
    """The p-net parameters generated now for each of `tasks`, detached: what `penalty`
    keeps them at while later tasks train.

    Args:
        gparams: The genome (`gb.init` of a plan with `tasks=`), trained so far.
        plan: Its plan.
        tasks: The earlier tasks' ids (ints, or a 1-d integer tensor).
    """
    check_gparams(gparams, plan, "gb.continual.targets")
    if not isinstance(tasks, Iterable) or (isinstance(tasks, Tensor) and tasks.dim() == 0):
        one = " (a 0-d tensor: one id; pass [id])" if isinstance(tasks, Tensor) else ""
        raise TypeError(
            f"gb.continual.targets: tasks must be an iterable of task ids (e.g. [0, 1]), got "
            f"{type(tasks).__name__}{one}."
        )
    ids = _task_ids(tasks, plan, "gb.continual.targets")
    with torch.no_grad():
        return {
            t: {k: v.detach().clone() for k, v in apply(gparams, plan, task=t).items()} for t in ids
        }


def penalty(
    gparams: GParams,
    plan: Plan,
    targets: Mapping[int, Mapping[str, Tensor]],
    *,
    strength: float = STRENGTH,
) -> Tensor:
    """`strength` times the mean over the tasks of `targets` of the squared distance
    (summed over every floating-point p-net parameter) between what `gparams` generate for
    the task now and its target. Generated in one `vmap`ped call over the tasks.

    Args:
        gparams: The genome being trained.
        plan: Its plan.
        targets: From `targets`, taken before the current task.
        strength: The regulariser's weight against the task loss (hypnettorch's `beta`):
            larger keeps earlier tasks better and leaves less room for the new one. Sweep
            it (e.g. 0.001, 0.01, 0.1) where forgetting or the new task's loss matters.
    """
    check_gparams(gparams, plan, "gb.continual.penalty")
    strength = real("gb.continual.penalty", "strength", strength, minimum=0)
    if not isinstance(targets, Mapping):
        raise TypeError(
            "gb.continual.penalty: targets must map task ids to parameters (from "
            f"gb.continual.targets), got {type(targets).__name__}."
        )
    ids = _task_ids(targets, plan, "gb.continual.penalty")
    _check_targets(targets, plan)
    if not ids:
        return gparams["tasks"].new_zeros(())
    index = torch.tensor(ids, device=gparams["tasks"].device)
    now = vmap(lambda t: apply(gparams, plan, task=t))(index)
    total = 0
    for name, values in now.items():
        if not values.is_floating_point():  # a frozen mask or count: never trained, never moved
            continue
        wanted = torch.stack([target[name] for target in targets.values()]).to(values)
        total = total + (values - wanted).square().sum()
    return strength * total / len(ids)


def _check_targets(targets: Mapping[int, Mapping[str, Tensor]], plan: Plan) -> None:
    """Each task's targets hold every floating-point parameter of the plan at its shape: one
    missing would raise a bare `KeyError`, one of another shape broadcast silently."""
    for task, params in targets.items():
        for p in plan.params:
            if not getattr(torch, p.dtype).is_floating_point:
                continue
            value = params.get(p.name) if isinstance(params, Mapping) else None
            if isinstance(value, Tensor) and tuple(value.shape) == p.shape:
                continue
            got = f"shape {tuple(value.shape)}" if isinstance(value, Tensor) else f"{value!r:.100}"
            raise ValueError(
                f"gb.continual.penalty: targets[{task}][{p.name!r}] must be a tensor of shape "
                f"{p.shape}, got {got}; take targets with gb.continual.targets(gparams, plan, "
                "tasks)."
            )


def _task_ids(ids: Iterable[object], plan: Plan, where: str) -> list[int]:
    """`ids` as Python ints (Python's or numpy's integers, as `gb.apply` takes, or 0-d
    integer tensors, which iterating `torch.arange(n)` gives), each checked against the
    plan's tasks."""
    if not plan.tasks:
        raise ValueError(
            f"{where}: the plan has no task embeddings; make it with "
            "gb.plan(..., condition=<width>, tasks=<n>)."
        )
    return [task_number(t, plan.tasks, where) for t in ids]
