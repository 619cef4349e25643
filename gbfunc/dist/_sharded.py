"""Sharded checkpoints of rank-owned g-nets, written and read with `torch.distributed.checkpoint`.

Every rank writes the g-nets it owns (`RankOwned`), one DCP entry per g-net (or per tile, for
tile leaves), so nothing is gathered; the free and frozen parameters, identical on every
rank, are written once. Because entries are per g-net, the checkpoint loads at any world
size: each rank reads the entries of the g-nets it owns there. Rank 0 writes a manifest
(`gbfunc.json`) beside DCP's files: the plan, the step, `meta`, and a SHA-256 of every entry,
so that loading checks the plan against the model as `gb.load` does and detects a damaged
shard, naming its file and entry. Unlike `gb.load`'s single file, DCP's data files are read
with `torch.load(weights_only=True)`: restricted unpickling, not none.
"""

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from .._tree import GParams
from .._checkpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    content_hash,
)
from .._check_model import check_module
from .._plan import TILE_LEAVES, Plan
from .._serial import plan_from_json, plan_to_json
from .._check_plan import check_plan
from ._owned import RankOwned

MANIFEST = "gbfunc.json"
FORMAT = "gbfunc.sharded"
FORMAT_VERSION = 2  # the plan JSON version inside, as in `gb.save`'s files
READABLE_VERSIONS = (1, 2)
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.bfloat16)}
_DTYPES["float16"] = torch.float16


def _rows(plan: Plan, owned: RankOwned | None) -> dict[str, dict[str, list[int]]]:
    """Per stack key and leaf, the rows (g-nets, or tiles for tile leaves) this rank holds."""
    out: dict[str, dict[str, list[int]]] = {}
    for s, stack in enumerate(plan.stacks):
        if owned is None:
            gnets, tiles = list(range(stack.num_gnets)), list(range(stack.num_tiles))
        else:
            gnets = owned.ownership.gnets(s, owned.rank)
            tiles = owned.ownership.tiles(plan, s, owned.rank)
        out[stack.key] = {
            leaf: tiles if leaf in TILE_LEAVES else gnets for leaf in stack.leaf_shapes()
        }
    return out


def _key(stack: str, leaf: str, row: int) -> str:
    return f"stacks/{stack}/{leaf}/{row}"


def _digest(key: str, t: Tensor) -> str:
    """`gb.save`'s SHA-256 (name, dtype, shape, bytes) of one entry."""
    return content_hash({key: t.detach().cpu()}, {})


def save_sharded(
    path: str | os.PathLike,
    local: GParams,
    owned: RankOwned,
    *,
    step: int | None = None,
    meta: Any = None,
) -> None:
    """Write a sharded checkpoint: every rank its own g-nets, rank 0 the manifest.

    Call it on every rank of `owned.group` (a collective), with this rank's part of the
    g-nets (`owned.shard(...)`, or as trained).

    Args:
        path: A directory, on a file system every rank can write.
        local: This rank's g-nets and the replicated free and frozen parameters.
        owned: The `RankOwned` that sharded them.
        step: Training step, an int >= 0.
        meta: Anything JSON can hold.
    """
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise TypeError(f"gb.dist.save_sharded: step must be an int >= 0 or None, got {step!r}.")
    plan = owned.plan
    state: dict[str, Tensor] = {}
    for key, leaves in _rows(plan, owned).items():
        for leaf, rows in leaves.items():
            values = local["stacks"][key][leaf].detach()
            if values.shape[0] != len(rows):
                raise ValueError(
                    f"gb.dist.save_sharded: local['stacks'][{key!r}][{leaf!r}] has "
                    f"{values.shape[0]} rows; this rank owns {len(rows)}. Pass owned.shard(...)."
                )
            for i, row in enumerate(rows):
                state[_key(key, leaf, row)] = values[i].clone()
    for kind in ("free", "frozen"):
        for name, value in local[kind].items():
            state[f"{kind}/{name}"] = value.detach()
    digests = {k: _digest(k, v) for k, v in state.items()}
    dtypes = {
        f"stacks/{key}/{leaf}": str(v.dtype).removeprefix("torch.")
        for key, leaves in local["stacks"].items()
        for leaf, v in leaves.items()
    }
    dcp.save(state, checkpoint_id=os.fspath(path), process_group=owned.group)
    every: list[Any] = [None] * owned.world  # each rank's digests; dtypes are the same
    dist.all_gather_object(every, digests, group=owned.group)
    if owned.rank == 0:
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "plan": plan_to_json(plan),
            "step": step,
            "meta": meta,
            "dtypes": dtypes,
            "sha256": {k: v for d in every for k, v in d.items()},
        }
        target = Path(path) / MANIFEST
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, sort_keys=True))
        os.replace(tmp, target)
    dist.barrier(group=owned.group)  # the manifest is there when any rank returns


def load_sharded(
    path: str | os.PathLike,
    model: nn.Module,
    owned: RankOwned | None = None,
    *,
    device: torch.device | str | None = None,
) -> Checkpoint:
    """Read a checkpoint of `save_sharded`, at any world size, checked as `gb.load` checks.

    Args:
        path: The checkpoint's directory.
        model: The p-net it is for (only names and shapes are read).
        owned: This rank's `RankOwned` (on every rank of its group: a collective); each rank
            reads only its g-nets. `None`: one process reads every g-net, no process group
            needed.
        device: Where to put the tensors (default: CPU).

    Returns:
        `Checkpoint(gparams, plan, None, step, meta)`, with this rank's part of the g-nets
        (all of them without `owned`) and the free and frozen parameters.

    Raises:
        gb.CheckpointNotFoundError: No manifest at `path`.
        gb.CheckpointVersionError: A manifest of another format or version.
        gb.CheckpointMismatchError: The checkpoint's plan does not fit `model`, or `owned`
            was made from another plan.
        gb.CheckpointCorruptError: A missing, truncated or altered shard, naming its file and
            entry.
    """
    check_module(model, "gb.dist.load_sharded")
    where = f"gb.dist.load_sharded: {os.fspath(path)}"
    manifest = _manifest(Path(path), where)
    try:
        plan = plan_from_json(manifest["plan"], manifest["format_version"])
        dtypes = {k: _DTYPES[v] for k, v in manifest["dtypes"].items()}
        digests = dict(manifest["sha256"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable manifest ({e!s:.200}).") from None
    check_plan(plan, model, where, corrupt=CheckpointCorruptError, mismatch=CheckpointMismatchError)
    if owned is not None and owned.plan.fingerprint() != plan.fingerprint():
        raise CheckpointMismatchError(f"{where}: `owned` was made from another plan.")
    state: dict[str, Tensor] = {}
    rows = _rows(plan, owned)
    for stack in plan.stacks:
        for leaf, shape in stack.leaf_shapes().items():
            dtype = dtypes.get(f"stacks/{stack.key}/{leaf}")
            if dtype is None:
                raise CheckpointCorruptError(f"{where}: no dtype for stacks/{stack.key}/{leaf}.")
            for row in rows[stack.key][leaf]:
                state[_key(stack.key, leaf, row)] = torch.empty(shape[1:], dtype=dtype)
    for p in plan.free:
        kind = "free" if p.trainable else "frozen"
        state[f"{kind}/{p.name}"] = torch.empty(p.shape, dtype=getattr(torch, p.dtype))
    try:
        with warnings.catch_warnings():  # one process reading on purpose: not worth a warning
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            group = owned.group if owned is not None else None
            dcp.load(state, checkpoint_id=os.fspath(path), process_group=group, no_dist=not group)
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        raise CheckpointCorruptError(
            f"{where}: a shard is missing or damaged ({e!s:.300})."
        ) from None
    for key, value in state.items():
        if digests.get(key) != _digest(key, value):
            raise CheckpointCorruptError(
                f"{where}: {key} in {_file_of(Path(path), key)} does not match its SHA-256: "
                "the shard was altered or damaged after it was written."
            )
    gparams = _assemble(plan, rows, state, dtypes, device)
    return Checkpoint(gparams, plan, None, manifest["step"], manifest["meta"])


def _manifest(path: Path, where: str) -> dict[str, Any]:
    target = path / MANIFEST
    if not target.is_file():
        raise CheckpointNotFoundError(f"{where}: no {MANIFEST}; not a sharded gbfunc checkpoint.")
    try:
        manifest = json.loads(target.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable {MANIFEST} ({e!s:.200}).") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{where}: {MANIFEST} is not a {FORMAT} manifest.")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointVersionError(
            f"{where}: format version {manifest.get('format_version')!r}; this gbfunc reads "
            f"versions {READABLE_VERSIONS}."
        )
    return manifest


def _file_of(path: Path, key: str) -> str:
    """The DCP data file holding entry `key` (for messages)."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
        for index, info in metadata.storage_data.items():
            if index.fqn == key:
                return str(path / info.relative_path)
    except Exception:  # the message still names the entry
        pass
    return str(path)


def _assemble(
    plan: Plan,
    rows: dict[str, dict[str, list[int]]],
    state: dict[str, Tensor],
    dtypes: dict[str, torch.dtype],
    device: torch.device | str | None,
) -> GParams:
    """`gparams` of this rank's rows from the loaded entries."""

    def ready(t: Tensor, trainable: bool) -> Tensor:
        return (t.to(device) if device is not None else t).requires_grad_(trainable)

    stacks = {}
    for stack in plan.stacks:
        stacks[stack.key] = {}
        for leaf, shape in stack.leaf_shapes().items():
            dtype = dtypes[f"stacks/{stack.key}/{leaf}"]
            picked = [state[_key(stack.key, leaf, r)] for r in rows[stack.key][leaf]]
            values = torch.stack(picked) if picked else torch.empty((0, *shape[1:]), dtype=dtype)
            stacks[stack.key][leaf] = ready(values, True)
    return {
        "stacks": stacks,
        "free": {p.name: ready(state[f"free/{p.name}"], True) for p in plan.free if p.trainable},
        "frozen": {
            p.name: ready(state[f"frozen/{p.name}"], False) for p in plan.free if not p.trainable
        },
    }
