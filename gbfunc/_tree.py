"""`gb.trainable_leaves`: the tensors an optimizer trains, taken out of a gparams pytree."""

from collections.abc import Mapping

from torch import Tensor

from ._check_gparams import TASKS

# `{"stacks": {key: {leaf: tensor}}, "free": {name: tensor}, "frozen": {name: tensor}}`, and
# `"tasks": tensor` where the plan has task embeddings
GParams = dict[str, dict]


def trainable_leaves(gparams: GParams) -> list[Tensor]:
    """Every stack leaf, then every free parameter (then the task embeddings, where the plan
    has them), as one flat list for an optimizer.

    The order is that of `gparams`' dicts (stacks, then each stack's leaves, then free
    parameters), which `gb.init`, `gb.load` and `gb.Bottleneck.gparams` all build in plan
    order; so two ranks or two runs with the same plan list the same tensors in the same
    order. Frozen parameters are left out. The list holds the leaves themselves (no copies),
    whether or not they require grad.

    Args:
        gparams: From `gb.init(plan)` (or trained from it).

    Returns:
        `[stack leaves..., free leaves...]`.

    Examples:
        >>> gparams = gb.init(gb.plan(nn.Linear(64, 32), tile=(16, 16)))
        >>> opt = torch.optim.AdamW(gb.trainable_leaves(gparams), lr=1e-3)
    """
    if not (isinstance(gparams, dict) and {"stacks", "free"} <= set(gparams)):
        got = sorted(gparams) if isinstance(gparams, dict) else type(gparams).__name__
        raise TypeError(
            "gb.trainable_leaves: gparams must be the dict made by gb.init with keys "
            f"['free', 'frozen', 'stacks'], got {got}."
        )
    stacks, free = gparams["stacks"], gparams["free"]
    if not (
        isinstance(stacks, dict)
        and all(isinstance(leaves, dict) for leaves in stacks.values())
        and isinstance(free, dict)
    ):
        raise TypeError(
            "gb.trainable_leaves: gparams['stacks'] must be a dict of dicts and "
            f"gparams['free'] a dict, as gb.init makes them; got {type(stacks).__name__} and "
            f"{type(free).__name__}."
        )
    tasks = [gparams[TASKS]] if TASKS in gparams else []
    return [*stack_leaves(stacks), *free.values(), *tasks]


def stack_leaves(stacks: Mapping[str, Mapping[str, Tensor]]) -> list[Tensor]:
    """Every leaf of the g-net stacks `{key: {leaf: tensor}}`, in their dicts' order."""
    return [t for leaves in stacks.values() for t in leaves.values()]


def first_leaf(stacks: Mapping[str, Mapping[str, Tensor]]) -> Tensor | None:
    """The first g-net leaf of `stacks` (`gparams["stacks"]`), whose device and dtype the
    stacks share (`check_gparams`); None for a plan without stacks."""
    return next((x for leaves in stacks.values() for x in leaves.values()), None)
