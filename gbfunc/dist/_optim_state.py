"""A `torch.optim` optimizer's state as sharded-checkpoint entries, named like the parameters.

The optimizer's parameters are the leaves of a rank's gparams: g-net stack leaves, whose
first dim is this rank's g-nets (or tiles), and free parameters, plain or DTensor. State
tensors shaped like their parameter are split the same way (one entry per g-net row, or the
whole tensor, sharded as the parameter is), so the state reshards to another world size with
the parameters; other tensors (AdamW's `step`) are one entry per parameter, and plain values
go into the manifest. Entries are named after parameters, not after their positions, so a
checkpoint restores into a new optimizer built over the same gparams on any number of ranks;
its groups must hold the parameters in the saved order, which the load checks by name.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._check_gparams import TASKS
from .._checkpoint import CheckpointMismatchError
from .._checkpoint_checks import optimizer_class
from .._plan import Plan
from .._tree import GParams

OPTIM = "optim/"


@dataclass(frozen=True)
class Leaf:
    """Where a gparams leaf sits: its entry name, and its rows for a stack leaf (else None)."""

    name: str
    rows: list[int] | None


def leaves(plan: Plan, local: GParams, rows: dict[str, dict[str, list[int]]]) -> dict[int, Leaf]:
    """`{id(tensor): Leaf}` of every trainable leaf of `local`."""
    out = {}
    for stack in plan.stacks:
        for leaf, value in local["stacks"][stack.key].items():
            out[id(value)] = Leaf(f"stacks/{stack.key}/{leaf}", rows[stack.key][leaf])
    for name, value in local["free"].items():
        out[id(value)] = Leaf(f"free/{name}", None)
    if TASKS in local:
        out[id(local[TASKS])] = Leaf(TASKS, None)
    return out


def _leaf_of(param: Tensor, known: dict[int, Leaf], where: str) -> Leaf:
    leaf = known.get(id(param))
    if leaf is None:
        raise ValueError(
            f"{where}: the optimizer holds a tensor of shape {tuple(param.shape)} that is not a "
            "trainable leaf of the gparams given; build it over those leaves."
        )
    return leaf


def state_entries(
    optimizer: torch.optim.Optimizer, known: dict[int, Leaf], where: str
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """`(entries, description)`: the state's tensors by entry name, and what the manifest keeps
    to rebuild it (the optimizer's class, groups' settings and parameter names, each state
    value's kind)."""
    entries: dict[str, Tensor] = {}
    groups, kinds = [], {}
    for group in optimizer.param_groups:
        names = [_leaf_of(p, known, where).name for p in group["params"]]
        settings = {k: _plain(v, where, k) for k, v in group.items() if k != "params"}
        groups.append({"params": names, "settings": settings})
        for param in group["params"]:
            leaf = known[id(param)]
            kinds[leaf.name] = {}
            for key, value in optimizer.state.get(param, {}).items():
                described = kinds[leaf.name][key] = _describe(value, param, leaf, key, where)
                kind = described["kind"]
                if kind == "rows":
                    for i, row in enumerate(leaf.rows or ()):
                        entries[f"{OPTIM}{leaf.name}/{row}/{key}"] = value[i].detach().clone()
                elif kind != "value":
                    entries[f"{OPTIM}{leaf.name}/{key}"] = value.detach()
    return entries, {"class": optimizer_class(optimizer), "groups": groups, "state": kinds}


def _describe(value: object, param: Tensor, leaf: Leaf, key: str, where: str) -> dict[str, Any]:
    """What the manifest keeps of one state value: its kind, and a tensor's dtype and shape.

    Raises `ValueError` for a g-net leaf's state tensor of another shape than the leaf's: a
    factored state (Adafactor's `row_var`, `col_var`) is not split by the leaf's rows, so it
    could not follow them to another rank or world size; each rank's would be saved as one.
    """
    if not isinstance(value, Tensor):
        return {"kind": "value", "value": _plain(value, "optimizer state", leaf.name)}
    kind = "tensor"
    if value.shape == param.shape:
        kind = "rows" if leaf.rows is not None else "like"
    elif leaf.rows is not None and value.dim() > 0:
        raise ValueError(
            f"{where}: optimizer state {key!r} of {leaf.name} has shape {tuple(value.shape)}, "
            f"not its parameter's {tuple(param.shape)}: state that is not split by the g-nets' "
            "rows (a factored optimizer's, such as Adafactor's) cannot follow them across "
            "ranks. Use an optimizer whose state is shaped like its parameters (Adam, AdamW, "
            "SGD), or gb.dist.save_replicated for g-nets replicated on every rank."
        )
    dtype = str(value.dtype).removeprefix("torch.")
    return {"kind": kind, "dtype": dtype, "shape": list(value.shape)}


def _plain(value: object, where: str, key: str) -> object:
    """A JSON-ready copy of an optimizer setting or value (tensors as numbers, tuples as lists)."""
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, tuple | list):
        return [_plain(v, where, key) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise ValueError(f"{where}: optimizer setting {key!r} is {type(value).__name__}; not saved.")


def templates(
    description: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    known: dict[int, Leaf],
    where: str,
) -> dict[str, Tensor]:
    """Empty tensors for every saved state entry of `optimizer`'s parameters, to load into.

    Raises `CheckpointMismatchError` unless the optimizer is of the saved one's class (where
    the manifest names it: since 2026-11-30) and its groups hold the saved parameters.
    """
    saved_class = description.get("class")
    if saved_class not in (None, optimizer_class(optimizer)):
        raise CheckpointMismatchError(
            f"{where}: its optimizer state is {saved_class}'s and the optimizer given is "
            f"{optimizer_class(optimizer)}; pass the optimizer class it was saved with."
        )
    saved = [g["params"] for g in description["groups"]]
    ours = [[_leaf_of(p, known, where).name for p in g["params"]] for g in optimizer.param_groups]
    if saved != ours:
        raise CheckpointMismatchError(
            f"{where}: the optimizer's parameter groups {_short(ours)} are not the checkpoint's "
            f"{_short(saved)}."
        )
    out: dict[str, Tensor] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            leaf = known[id(param)]
            for key, d in description["state"][leaf.name].items():
                if d["kind"] == "rows":
                    for row in leaf.rows or ():
                        out[f"{OPTIM}{leaf.name}/{row}/{key}"] = torch.empty(
                            param.shape[1:], dtype=_dtype(d)
                        )
                elif d["kind"] == "like":
                    out[f"{OPTIM}{leaf.name}/{key}"] = torch.empty_like(param, dtype=_dtype(d))
                elif d["kind"] == "tensor":
                    out[f"{OPTIM}{leaf.name}/{key}"] = torch.empty(d["shape"], dtype=_dtype(d))
    return out


def staged(
    description: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    known: dict[int, Leaf],
    loaded: dict[str, Tensor],
) -> list[tuple[dict[str, Any], dict[str, Any], dict[Tensor, dict[str, object]]]]:
    """Every group's new settings and every parameter's new state, from the checked entries
    `loaded`, `optimizer` unchanged: whatever can fail (moving tensors to devices) runs here,
    before `restore` sets them."""
    out = []
    for group, saved in zip(optimizer.param_groups, description["groups"], strict=True):
        settings = {
            key: tuple(value) if isinstance(group.get(key), tuple) else value
            for key, value in saved["settings"].items()
        }
        states = {}
        for param in group["params"]:
            leaf = known[id(param)]
            state = {}
            for key, d in description["state"][leaf.name].items():
                if d["kind"] == "value":
                    state[key] = d["value"]
                elif d["kind"] == "rows":
                    rows = [loaded[f"{OPTIM}{leaf.name}/{r}/{key}"] for r in leaf.rows or ()]
                    state[key] = torch.stack(rows) if rows else torch.empty_like(param)
                else:
                    state[key] = loaded[f"{OPTIM}{leaf.name}/{key}"]
            states[param] = {k: _on(v, param) for k, v in state.items()}
        out.append((group, settings, states))
    return out


def restore(
    optimizer: torch.optim.Optimizer,
    new: list[tuple[dict[str, Any], dict[str, Any], dict[Tensor, dict[str, object]]]],
) -> None:
    """Set `optimizer`'s settings and state to those `staged` computed: plain assignments,
    which cannot fail part-way."""
    for group, settings, states in new:
        group.update(settings)
        for param, state in states.items():
            optimizer.state[param] = state


def _on(value: object, param: Tensor) -> object:
    """State tensors shaped like `param` go to its device; others (AdamW's step) stay put."""
    if isinstance(value, Tensor) and value.shape == param.shape:
        return value.to(param.device)
    return value


def _dtype(described: dict[str, Any]) -> torch.dtype:
    return getattr(torch, described["dtype"])


def _short(groups: list[list[str]]) -> str:
    return str([g[:2] + (["..."] if len(g) > 2 else []) for g in groups])
