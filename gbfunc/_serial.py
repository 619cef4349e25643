"""Plans and pytrees to JSON and back, without pickle.

A plan becomes a JSON object that rebuilds an equal `Plan`. A pytree (an optimizer's
`state_dict()`, for instance) becomes a JSON skeleton plus a flat `{key: Tensor}` dict; the
skeleton tags what JSON cannot tell apart (tuples from lists, int keys from str keys).
"""

import json
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch import Tensor

from ._files import check_readable_back
from ._genome import Genome
from ._plan import Block, Free, Generated, Plan, Stack, stack_fields
from ._rules import weight_fan_in

PLAN_VERSION = 2  # the plan JSON `plan_to_json` writes
# Fields that plan JSON version 1 named otherwise: `kernel` meant two things there.
_RENAMED_SINCE_V1 = {
    "genome": {"kernel": "window_in"},
    "stack": {"kernel": "window"},
    "generated": {"stack": "stack_index"},
}


def plan_to_json(plan: Plan) -> str:
    """Canonical JSON of `plan`; `plan_from_json` turns it back into an equal `Plan`."""
    params = [{"kind": type(p).__name__.lower(), **_fields(p)} for p in plan.params]
    stacks = [stack_fields(s) for s in plan.stacks]
    tasks = {"tasks": plan.tasks} if plan.tasks else {}  # plans without them: JSON unchanged
    return json.dumps(
        {"params": params, "stacks": stacks, **tasks}, sort_keys=True, separators=(",", ":")
    )


def _fields(p: Generated | Free) -> dict:
    """`p`'s fields; a generated parameter's `start` only where it is not 1 (plans written
    before it existed have none, and their JSON stays the same)."""
    d = asdict(p)
    if isinstance(p, Generated) and p.start == 1.0:
        del d["start"]
    return d


def plan_from_json(text: str, version: int = PLAN_VERSION) -> Plan:
    """Rebuild the `Plan` that `plan_to_json` wrote, in plan JSON `version` (1 or 2); raises
    `ValueError` on malformed input."""
    try:
        data = json.loads(text)
        params = tuple(_param(_tuples(p), version) for p in data["params"])
        stacks = tuple(_stack(_tuples(s), version) for s in data["stacks"])
        tasks = data.get("tasks", 0)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ValueError(f"malformed plan JSON ({type(e).__name__}: {e})") from None
    return Plan(params, stacks, tasks=tasks)


def _tuples(x: object) -> object:
    """Every JSON list in a plan is a tuple field."""
    if isinstance(x, list):
        return tuple(_tuples(v) for v in x)
    if isinstance(x, dict):
        return {k: _tuples(v) for k, v in x.items()}
    return x


def _param(d: dict, version: int) -> Generated | Free:
    kind = d.pop("kind")
    if kind == "generated":
        d = _renamed(d, "generated", version)
        if "fan_in" not in d:  # written before plans had it: torch's reading of the shape
            shape = d.get("shape")
            whole = isinstance(shape, tuple) and all(isinstance(n, int) for n in shape)
            d["fan_in"] = weight_fan_in(shape) if whole else 1  # a bad shape: check_plan's
        return Generated(**{**d, "blocks": tuple(Block(**b) for b in d["blocks"])})
    if kind == "free":
        return Free(**d)
    raise ValueError(f"unknown parameter kind {kind!r}")


def _stack(d: dict, version: int) -> Stack:
    d = _renamed(d, "stack", version)
    return Stack(**{**d, "genome": Genome(**_renamed(d["genome"], "genome", version))})


def _renamed(d: dict, kind: str, version: int) -> dict:
    """`d` with the field names of plan JSON `version` brought up to date."""
    if version == 1:
        names = _RENAMED_SINCE_V1[kind]
        return {names.get(k, k): v for k, v in d.items()}
    return d


_SCALARS = (bool, int, float, str, type(None))


def meta_fields(meta: object, where: str) -> dict[str, object]:
    """`meta` as a checkpoint stores it: `{"meta": meta}` where JSON returns it as it is;
    else `{"meta": None, "meta_tagged": skeleton}`, `flatten`'s skeleton, which keeps tuples
    and int keys (JSON would return lists and string keys). TypeError, naming the place, for
    what JSON cannot hold at all (a tensor, an object)."""
    if _plain_json(meta, "meta", where):
        return {"meta": meta}
    skeleton, _ = flatten(meta, "meta", f"{where}: meta")  # `_plain_json` refused tensors
    return {"meta": None, "meta_tagged": skeleton}


def meta_from(fields: dict[str, object]) -> object:
    """The `meta` that `meta_fields` stored in `fields`."""
    tagged = fields.get("meta_tagged")
    return fields.get("meta") if tagged is None else unflatten(tagged, _no_tensor)


def _no_tensor(key: str) -> Tensor:
    raise ValueError(f"meta names a tensor ({key!r}); meta holds none")


def _plain_json(node: object, path: str, where: str) -> bool:
    """Whether JSON returns `node` as it is (no tuples, only string keys); TypeError naming
    `path` for what it cannot hold."""
    if isinstance(node, list | tuple):
        inner = [_plain_json(v, f"{path}[{i}]", where) for i, v in enumerate(node)]
        return isinstance(node, list) and all(inner)
    if isinstance(node, dict):
        inner = [_plain_json(v, f"{path}[{k!r}]", where) for k, v in node.items()]
        return all(inner) and all(isinstance(k, str) for k in node)
    if isinstance(node, _SCALARS):
        return True
    raise TypeError(
        f"{where}: meta must be JSON-serialisable: {path} is a {type(node).__name__} (dicts, "
        "lists, tuples, strings, numbers, booleans and None are)."
    )


def flatten(tree: object, prefix: str, where: str) -> tuple[object, dict[str, Tensor]]:
    """Split `tree` into a JSON-able skeleton and its tensors, keyed `prefix/0`, `prefix/1`, ...

    Args:
        tree: Nested dicts (str or int keys), lists, tuples, tensors, numbers, strings, None.
        prefix: Key prefix of the tensors.
        where: Names the argument in errors, e.g. `"gb.save: opt_state"`.
    """
    tensors: dict[str, Tensor] = {}

    def walk(node: object, path: str) -> object:
        if isinstance(node, Tensor):
            if node.layout != torch.strided:
                raise TypeError(
                    f"{path} is a {str(node.layout).removeprefix('torch.')} tensor; only dense "
                    "(strided) tensors can be saved: convert it with .to_dense()."
                )
            check_readable_back({path: node})
            key = f"{prefix}/{len(tensors)}"
            tensors[key] = node
            return {"$tensor": key}
        if isinstance(node, _SCALARS):
            return node
        if isinstance(node, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return {"$tuple": [walk(v, f"{path}[{i}]") for i, v in enumerate(node)]}
        if isinstance(node, dict):
            bad = [k for k in node if not isinstance(k, str | int) or isinstance(k, bool)]
            if bad:
                raise TypeError(f"{path} has key {bad[0]!r}; only str and int keys can be saved.")
            return {"$dict": [[k, walk(v, f"{path}[{k!r}]")] for k, v in node.items()]}
        raise TypeError(
            f"{path} is a {type(node).__name__}; only tensors, numbers, strings, None, lists, "
            "tuples and dicts can be saved."
        )

    return walk(tree, where), tensors


def unflatten(skeleton: object, tensor: Callable[[str], Tensor]) -> object:
    """Inverse of `flatten`: `tensor(key)` returns the tensor stored under `key`."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensor) for v in skeleton]
    if isinstance(skeleton, dict):
        (tag, value), *rest = skeleton.items()
        if rest or tag not in ("$tensor", "$tuple", "$dict"):
            raise ValueError(f"malformed pytree node {skeleton!r}")
        if tag == "$tensor":
            return tensor(value)
        if tag == "$tuple":
            return tuple(unflatten(v, tensor) for v in value)
        return {k: unflatten(v, tensor) for k, v in value}
    return skeleton
