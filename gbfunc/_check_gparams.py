"""Checks that `gparams` fit a plan, raising errors that name the leaf and the shapes."""

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from ._plan import Plan, check_is_plan, shared_dtype
from ._tracing import eager_memo

_GROUPS = ("stacks", "free", "frozen")
TASKS = "tasks"  # the task embeddings, a tensor of its own, where the plan has them


def groups(plan: Plan) -> tuple[str, ...]:
    """The top-level keys of `gb.init(plan)`."""
    return (*_GROUPS, TASKS) if plan.tasks else _GROUPS


def expected_shapes(plan: Plan) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Every leaf path of `gb.init(plan)` and its shape."""
    shapes: dict[tuple[str, ...], tuple[int, ...]] = {}
    for stack in plan.stacks:
        for leaf, shape in stack.leaf_shapes().items():
            shapes[("stacks", stack.key, leaf)] = shape
    for p in plan.free:
        shapes[("free" if p.trainable else "frozen", p.name)] = p.shape
    if plan.tasks:
        shapes[(TASKS,)] = (plan.tasks, plan.condition)
    return shapes


def _path(keys: tuple[str, ...]) -> str:
    return "gparams" + "".join(f"[{k!r}]" for k in keys)


def check_gparams(
    gparams: object, plan: Plan, where: str, *, values: bool = False, shard: bool = False
) -> None:
    """Raise if `gparams` is not shaped like `gb.init(plan)`; optionally reject NaN/inf.

    `shard=True` also accepts a rank's part (`gb.dist.RankOwned.shard`): stack leaves with
    fewer rows (g-nets or tiles) than the plan's, every other dimension as planned.
    """
    check_is_plan(plan, where)
    top = groups(plan)
    if not isinstance(gparams, dict) or set(gparams) != set(top):
        got = sorted(gparams) if isinstance(gparams, dict) else type(gparams).__name__
        raise TypeError(
            f"{where}: gparams must be the dict made by gb.init with keys {list(top)}, got {got}."
        )
    hint = "Were these gparams made by gb.init with a different plan?"
    layout = _layout(plan)
    missing = lambda path: f"{where}: {path} is missing. {hint}"
    stack_first: dict[str, tuple[tuple[str, ...], Tensor]] = {}
    stack_floats: list[tuple[tuple[str, ...], Tensor]] = []
    free_floats: list[tuple[tuple[str, ...], Tensor]] = []  # free and frozen
    for keys, shape, exact in layout.leaves:
        node = _leaf(gparams, keys, missing)
        if not isinstance(node, Tensor):
            raise TypeError(f"{where}: {_path(keys)} must be a Tensor, got {type(node).__name__}.")
        fewer_rows = shard and keys[0] == "stacks"
        if not _fits(tuple(node.shape), shape, fewer_rows):
            rows = " (a shard: at most as many rows)" if fewer_rows else ""
            raise ValueError(
                f"{where}: {_path(keys)} has shape {tuple(node.shape)}; expected {shape}{rows}. "
                f"{hint}"
            )
        floating = node.is_floating_point()
        if exact is not None and node.dtype != exact:
            raise TypeError(f"{where}: {_path(keys)} has dtype {node.dtype}; expected {exact}.")
        if exact is None and not floating:
            raise TypeError(
                f"{where}: {_path(keys)} has dtype {node.dtype}; expected a floating dtype."
            )
        if keys[0] == "stacks":  # one batched evaluation: one dtype, one device
            first_keys, first = stack_first.setdefault(keys[1], (keys, node))
            if (node.dtype, node.device) != (first.dtype, first.device):
                raise ValueError(
                    f"{where}: {_path(keys)} is {node.dtype} on {node.device} but "
                    f"{_path(first_keys)} is {first.dtype} on {first.device}; the leaves of a "
                    "stack must share dtype and device."
                )
        if floating:
            (stack_floats if keys[0] == "stacks" else free_floats).append((keys, node))
        if values and node.is_meta:
            raise ValueError(f"{where}: {_path(keys)} is on the meta device: it has no values.")
        if values and not _all_finite(node, where):
            raise ValueError(f"{where}: {_path(keys)} contains NaN or inf.")
    _check_free_dtypes(free_floats, stack_floats, plan, where)
    for keys in _paths(gparams, plan):
        if keys not in layout.paths:
            raise ValueError(f"{where}: {_path(keys)} is not in the plan. {hint}")


class _Layout(NamedTuple):
    """What `check_gparams` compares a plan's gparams with: each leaf's path, shape and exact
    dtype (None: any floating one), and the set of the paths."""

    leaves: tuple[tuple[tuple[str, ...], tuple[int, ...], torch.dtype | None], ...]
    paths: frozenset[tuple[str, ...]]


@eager_memo
def _layout(plan: Plan) -> _Layout:
    """`plan`'s expected leaves, remembered for eager calls: every `gb.apply` checks its
    gparams, and a layout costs more to build than the leaves to check."""
    # Integer and bool parameters can only be frozen; they keep the model's dtype.
    exact = {
        ("frozen", p.name): getattr(torch, p.dtype)
        for p in plan.free
        if not getattr(torch, p.dtype).is_floating_point
    }
    shapes = expected_shapes(plan)
    leaves = tuple((keys, shape, exact.get(keys)) for keys, shape in shapes.items())
    return _Layout(leaves, frozenset(shapes))


def _fits(got: tuple[int, ...], want: tuple[int, ...], fewer_rows: bool) -> bool:
    if not fewer_rows or not want:
        return got == want
    return len(got) == len(want) and got[1:] == want[1:] and got[0] <= want[0]


def check_finite(value: Tensor, name: str, where: str) -> None:
    """Raise, naming `name`, unless every value of `value` is finite."""
    if not _all_finite(value, where):
        raise ValueError(f"{where}: {name} holds NaN or inf (check=True).")


def _all_finite(node: Tensor, where: str) -> bool:
    """Whether every value of `node` is finite; a clear error where the values cannot be
    read (under `torch.func.vmap`, which refuses a Python bool of a batched tensor)."""
    try:
        return bool(torch.isfinite(node).all())
    except RuntimeError as e:
        if "data-dependent control flow" not in str(e):
            raise
        raise RuntimeError(
            f"{where}: check=True reads the leaves' values, which torch.func.vmap does not "
            "give to Python; check them before vmap (gb.apply(..., check=True) on one "
            "genome), and call it inside with check=False."
        ) from None


def _check_free_dtypes(
    free: list[tuple[tuple[str, ...], Tensor]],
    stacks: list[tuple[tuple[str, ...], Tensor]],
    plan: Plan,
    where: str,
) -> None:
    """Each free and frozen floating leaf has the model's dtype for it (`gb.init`'s default)
    or the one dtype of the stacks where they all share one (else of the first free leaf;
    `gb.init`'s `dtype=`): the generated and the free weights meet in one forward. Stacks
    may differ from each other (each is generated on its own)."""
    reference = free[0] if free else None
    if len({node.dtype for _, node in stacks}) == 1:
        reference = stacks[0]
    for keys, node in free:
        if reference is None or node.dtype == reference[1].dtype:
            continue
        own = _model_dtype(plan, keys)  # only here: every gb.apply call runs these checks
        if node.dtype == own:
            continue
        raise TypeError(
            f"{where}: {_path(keys)} has dtype {node.dtype} but {_path(reference[0])} is "
            f"{reference[1].dtype}; a free leaf has the g-nets' dtype (gb.init's dtype=) or "
            f"the model's ({own})."
        )


def _model_dtype(plan: Plan, keys: tuple[str, ...]) -> torch.dtype:
    """`gb.init`'s default dtype of the free, frozen or task-embedding leaf at `keys`."""
    if keys == (TASKS,):
        return shared_dtype(plan.generated)
    return shared_dtype(p for p in plan.free if p.name == keys[1])


def _leaf(gparams: object, keys: tuple[str, ...], missing: Callable[[str], str]) -> object:
    """The node at `keys`; raise `ValueError(missing(path))` at the first absent key."""
    node = gparams
    for depth, key in enumerate(keys):
        if not isinstance(node, dict) or key not in node:
            raise ValueError(missing(_path(keys[: depth + 1])))
        node = node[key]
    return node


def _paths(gparams: dict, plan: Plan) -> list[tuple[str, ...]]:
    """The path of every entry of gparams' groups, one level down in `"stacks"`."""
    out = [(TASKS,)] if plan.tasks else []
    for group in _GROUPS:
        for key, value in gparams[group].items():
            inner = [k for k in value if k is not None] if isinstance(value, dict) else []
            out += [(group, key, k) for k in inner] if inner else [(group, key)]
    return out


def leaves(gparams: dict, plan: Plan) -> dict[str, Tensor]:
    """Every leaf that `plan` expects in `gparams` (already checked), by its path for messages."""
    out: dict[str, Tensor] = {}
    for keys in expected_shapes(plan):
        node = gparams
        for key in keys:
            node = node[key]
        out[_path(keys)] = node
    return out
