"""Start-up check that every rank built the same plan, naming the first difference."""

from dataclasses import asdict

import torch.distributed as dist

from .._plan import Plan, check_is_plan


def _entries(plan: Plan) -> list[tuple[str, dict[str, str]]]:
    """`(label, {field: repr})` of the plan's own field (its task embeddings), then every
    parameter, then every stack (a parameter's or stack's `kind` first)."""
    entries = [(f"parameter {p.name!r}", p) for p in plan.params] + [
        (f"stack {s.key!r}", s) for s in plan.stacks
    ]
    return [("the plan", {"tasks": repr(plan.tasks)})] + [
        (label, {"kind": type(x).__name__, **{k: repr(v) for k, v in asdict(x).items()}})
        for label, x in entries
    ]


def plan_difference(ours: Plan, theirs: Plan) -> str | None:
    """The first difference between two plans, in words, or `None` when they are equal.

    The plans' task embeddings are compared, then parameters in order, then stacks, field by
    field; `gb.dist.check_plan` names this difference in its error.

    Args:
        ours: One plan, e.g. rank 0's; its values come first in the result.
        theirs: The plan to compare it with, e.g. another rank's.

    Returns:
        The first difference: the task embeddings' count, or the first parameter or stack
            that differs and the field, with both values (each
            cut to 120 characters); or the entry one plan has beyond the other's; `None`
            when the plans are equal.

    Examples:
        >>> ours = gb.plan(nn.Linear(64, 32), tile=(16, 16))
        >>> theirs = gb.plan(nn.Linear(64, 32), tile=(16, 16), biases=True)
        >>> print(gb.dist.plan_difference(ours, theirs))
        parameter 'bias', field 'kind': Free vs Generated
        >>> print(gb.dist.plan_difference(ours, gb.plan(nn.Linear(64, 48))))
        parameter 'weight', field 'shape': (32, 64) vs (48, 64)
        >>> same = gb.plan(nn.Linear(64, 32), tile=(16, 16))
        >>> gb.dist.plan_difference(ours, same) is None
        True
    """
    check_is_plan(ours, "gb.dist.plan_difference", "ours")
    check_is_plan(theirs, "gb.dist.plan_difference", "theirs")
    a, b = _entries(ours), _entries(theirs)
    for (label_a, fields_a), (label_b, fields_b) in zip(a, b, strict=False):
        if label_a != label_b:
            return f"{label_a} where the other has {label_b}"
        for field, value in fields_a.items():
            other = str(fields_b.get(field))
            if other != value:
                return f"{label_a}, field {field!r}: {_short(value)} vs {_short(other)}"
    if len(a) != len(b):
        extra = (a if len(a) > len(b) else b)[min(len(a), len(b))][0]
        return f"{len(a)} vs {len(b)} entries; the first unmatched one is {extra}"
    return None


def _short(text: str) -> str:
    """`text`, cut to 120 characters for a message."""
    return text if len(text) <= 120 else text[:117] + "..."


def check_plan(plan: Plan, group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank unless every rank of `group` holds the same plan.

    Compares `plan.fingerprint()` across ranks (one small all-gather); on a mismatch gathers
    the plans and names the first parameter or stack where the lowest differing rank departs
    from rank 0. Call it once at start-up, on every rank.

    Args:
        plan: This rank's plan.
        group: Process group (default: the world).

    Examples:
        >>> gb.dist.check_plan(plan)  # every rank, under torchrun  # doctest: +SKIP
    """
    check_is_plan(plan, "gb.dist.check_plan")
    prints: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(prints, plan.fingerprint(), group=group)
    if len(set(prints)) == 1:
        return
    plans: list[Plan | None] = [None] * len(prints)
    dist.all_gather_object(plans, plan, group=group)
    rank = next(r for r, p in enumerate(prints) if p != prints[0])
    raise ValueError(
        f"gb.dist.check_plan: rank {rank}'s plan differs from rank 0's at "
        f"{plan_difference(plans[0], plans[rank])}. Every rank must build the same model and "
        "call gb.plan with the same arguments."
    )
