"""Sharded checkpoints of g-nets, free parameters and optimizer state, through
`torch.distributed.checkpoint` (DCP).

Every rank writes what it holds and nothing is gathered: its rank-owned g-nets (`RankOwned`),
one DCP entry per g-net (or per tile, for tile leaves), or one copy of replicated ones; free
parameters that are DTensors (FSDP2) shard by shard, replicated ones once; an optimizer's
state split like its parameters (`_optim_state`). Entries are named by g-net and parameter,
not by rank, so the checkpoint loads at any world size and any DTensor layout: each rank
reads what it holds there. Rank 0 writes a manifest (`gbfunc.json`) beside DCP's files: the
plan, the step, `meta`, the optimizer's settings, a SHA-256 of every whole entry and a
layout-free checksum (`_checksum`) of every free and optimizer entry, so that loading checks
the plan against the model as `gb.load` does and detects a damaged shard, naming its file and
entry, before anything is changed. Unlike `gb.load`'s single file, DCP's data files are read
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
from torch.distributed.tensor import DTensor

from .._check_model import check_module
from .._check_plan import check_plan
from .._checkpoint import (
    BUFFERS,
    Checkpoint,
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointVersionError,
    buffers_to_save,
    check_buffer,
    content_hash,
    persistent_buffers,
    restore_buffers,
)
from .._numbers import integer
from .._plan import TILE_LEAVES, Plan
from .._serial import plan_from_json, plan_to_json
from .._tree import GParams
from ._checksum import checksum
from ._optim_state import OPTIM, leaves as optim_leaves, restore, state_entries, templates
from ._owned import RankOwned

MANIFEST = "gbfunc.json"
FORMAT = "gbfunc.sharded"
# 3: layout-free checksums of free and optimizer entries (DTensor shards), optimizer state;
# 4: the p-net's buffers
FORMAT_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
PLAN_VERSION_OF = {1: 1, 2: 2, 3: 2, 4: 2}  # the plan JSON version inside, as in `gb.save`'s files
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


def _context(
    owned: RankOwned | None, plan: Plan | None, group: dist.ProcessGroup | None, where: str
) -> tuple[Plan, dist.ProcessGroup | None]:
    """The plan, and the process group of the collective (None: one process on its own)."""
    if (owned is None) == (plan is None):
        raise TypeError(
            f"{where}: pass `owned` (rank-owned g-nets) or `plan=` (g-nets replicated on every "
            "rank of `group`), exactly one of them."
        )
    if owned is not None:
        return owned.plan, owned.group
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    return plan, group


def _value_entries(
    plan: Plan, local: GParams, rows: dict[str, dict[str, list[int]]], where: str
) -> dict[str, Tensor]:
    """The entries of `local`'s values: one per g-net row, one per free or frozen tensor."""
    state: dict[str, Tensor] = {}
    for key, leaves in rows.items():
        for leaf, mine in leaves.items():
            values = local["stacks"][key][leaf].detach()
            if values.shape[0] != len(mine):
                raise ValueError(
                    f"{where}: local['stacks'][{key!r}][{leaf!r}] has {values.shape[0]} rows; "
                    f"this rank holds {len(mine)}. Pass owned.shard(...)."
                )
            for i, row in enumerate(mine):
                state[_key(key, leaf, row)] = values[i].clone()
    for kind in ("free", "frozen"):
        for name, value in local[kind].items():
            state[f"{kind}/{name}"] = value.detach()
    return state


def save_sharded(
    path: str | os.PathLike,
    local: GParams,
    owned: RankOwned | None = None,
    *,
    plan: Plan | None = None,
    group: dist.ProcessGroup | None = None,
    buffers: nn.Module | dict[str, Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    meta: Any = None,
) -> None:
    """Write a sharded checkpoint: every rank its own shards, rank 0 the manifest.

    Call it on every rank (a collective), with this rank's gparams as trained: rank-owned
    g-nets (`owned.shard(...)`) or replicated ones (`plan=`), and free or frozen parameters
    that are plain tensors (replicated) or DTensors (e.g. `gb.dist.ShardedFree.state(...)`:
    each rank writes its shard, and they reshard on load).

    Args:
        path: A directory, on a file system every rank can write.
        local: This rank's gparams.
        owned: The `RankOwned` that sharded the g-nets; or
        plan: the plan, for g-nets replicated on every rank of `group` (default: all ranks;
            no process group at all: one process writes everything).
        buffers: The p-net's buffers, replicated on every rank, as in `gb.save` (default:
            those of the model the plan was made from, while it is alive).
        optimizer: A `torch.optim` optimizer over `local`'s trainable leaves; its state is
            written sharded like its parameters and restored by `load_sharded(optimizer=)`.
        step: Training step, an int >= 0.
        meta: Anything JSON can hold.
    """
    where = "gb.dist.save_sharded"
    step = integer(where, "step", step, minimum=0, optional=True)
    plan, group = _context(owned, plan, group, where)
    rows = _rows(plan, owned)
    state = _value_entries(plan, local, rows, where)
    kept = buffers_to_save(buffers, plan, where)
    state.update({BUFFERS + name: t for name, t in kept.items()})
    described = None
    if optimizer is not None:
        entries, described = state_entries(optimizer, optim_leaves(plan, local, rows), where)
        state.update(entries)
    digests = {k: _digest(k, v) for k, v in state.items() if not isinstance(v, DTensor)}
    # g-net rows (and their optimizer state) are held whole by one rank: a SHA-256 suffices.
    whole = ("stacks/", f"{OPTIM}stacks/")
    checksums = {k: checksum(v) for k, v in state.items() if not k.startswith(whole)}
    with warnings.catch_warnings():  # one process writing on purpose: not worth a warning
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, checkpoint_id=os.fspath(path), process_group=group, no_dist=group is None)
    every: list[Any] = [digests]
    if group is not None:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, digests, group=group)
    if group is None or dist.get_rank(group) == 0:
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "plan": plan_to_json(plan),
            "step": step,
            "meta": meta,
            "dtypes": _stack_dtypes(local),
            "buffers": {
                n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in kept.items()
            },
            "sha256": {k: v for d in every for k, v in d.items()},
            "checksums": checksums,
            "optimizer": described,
        }
        target = Path(path) / MANIFEST
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, sort_keys=True))
        os.replace(tmp, target)
    if group is not None:
        dist.barrier(group=group)  # the manifest is there when any rank returns


def _stack_dtypes(local: GParams) -> dict[str, str]:
    return {
        f"stacks/{key}/{leaf}": str(v.dtype).removeprefix("torch.")
        for key, leaves in local["stacks"].items()
        for leaf, v in leaves.items()
    }


def load_sharded(
    path: str | os.PathLike,
    model: nn.Module,
    owned: RankOwned | None = None,
    *,
    into: GParams | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> Checkpoint:
    """Read a checkpoint of `save_sharded`, at any world size, checked as `gb.load` checks.

    Everything is read and checked before anything given is changed.

    Args:
        path: The checkpoint's directory.
        model: The p-net it is for: its names and shapes are checked, and its buffers
            receive the stored ones once everything is read and checked.
        owned: This rank's `RankOwned` (on every rank of its group: a collective); each rank
            reads only its g-nets. `None`: every g-net is read.
        into: gparams to fill in place, e.g. those of a restarted run, where free parameters
            may be DTensors of another layout than the saved one (`ShardedFree.state(...)`):
            each rank reads its shard. Default: new tensors, DTensors read whole.
        optimizer: An optimizer over `into`'s trainable leaves whose state `save_sharded`
            wrote: its settings and state are restored.
        group: The process group of `into`'s DTensors when `owned` is None (default: all
            ranks if `into` holds a DTensor; else each process reads on its own).
        device: Where to put new tensors (default: CPU).

    Returns:
        `Checkpoint(gparams, plan, None, step, meta)`: `into`, or this rank's part of the
        g-nets (all of them without `owned`) and the free and frozen parameters.

    Raises:
        gb.CheckpointNotFoundError: No manifest at `path`.
        gb.CheckpointVersionError: A manifest of another format or version.
        gb.CheckpointMismatchError: The checkpoint's plan does not fit `model`, `owned` was
            made from another plan, or `optimizer` holds other parameters than were saved.
        gb.CheckpointCorruptError: A missing, truncated or altered shard, naming its file and
            entry.
    """
    check_module(model, "gb.dist.load_sharded")
    where = f"gb.dist.load_sharded: {os.fspath(path)}"
    manifest = _manifest(Path(path), where)
    plan, dtypes, digests, checksums = _read_manifest(manifest, where)
    check_plan(plan, model, where, corrupt=CheckpointCorruptError, mismatch=CheckpointMismatchError)
    if owned is not None and owned.plan.fingerprint() != plan.fingerprint():
        raise CheckpointMismatchError(f"{where}: `owned` was made from another plan.")
    if optimizer is not None and (into is None or manifest.get("optimizer") is None):
        raise ValueError(
            f"{where}: restoring an optimizer needs `into` (the gparams it trains) and a "
            "checkpoint saved with `optimizer=`."
        )
    if owned is not None:
        group = owned.group
    elif group is None and into is not None and _has_dtensor(into):
        group = dist.group.WORLD
    rows = _rows(plan, owned)
    if into is not None:
        _check_into(plan, rows, into, where)
    state = _templates(plan, rows, dtypes, into, where)
    state.update(_buffer_templates(manifest, model, where))
    known = optim_leaves(plan, into, rows) if optimizer is not None else {}
    if optimizer is not None:
        try:
            state.update(templates(manifest["optimizer"], optimizer, known, where))
        except (KeyError, TypeError, AttributeError) as e:
            raise CheckpointCorruptError(
                f"{where}: unreadable optimizer state ({e!r:.200})."
            ) from None
    _read(path, state, group, where)
    _verify(Path(path), state, digests, checksums, group, where)
    if optimizer is not None:
        restore(manifest["optimizer"], optimizer, known, state)
    gparams = _assemble(plan, rows, state, dtypes, device)
    restore_buffers(
        model, {k.removeprefix(BUFFERS): v for k, v in state.items() if k.startswith(BUFFERS)}
    )
    if into is not None:
        _fill(into, gparams)
        gparams = into
    return Checkpoint(gparams, plan, None, manifest["step"], manifest["meta"])


def _read_manifest(
    manifest: dict[str, Any], where: str
) -> tuple[Plan, dict[str, torch.dtype], dict[str, str], dict[str, str]]:
    try:
        version = manifest["format_version"]
        plan = plan_from_json(manifest["plan"], PLAN_VERSION_OF[version])
        dtypes = {k: _DTYPES[v] for k, v in manifest["dtypes"].items()}
        return plan, dtypes, dict(manifest["sha256"]), dict(manifest.get("checksums") or {})
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable manifest ({e!s:.200}).") from None


def _has_dtensor(gparams: GParams) -> bool:
    return any(isinstance(v, DTensor) for k in ("free", "frozen") for v in gparams[k].values())


def _templates(
    plan: Plan,
    rows: dict[str, dict[str, list[int]]],
    dtypes: dict[str, torch.dtype],
    into: GParams | None,
    where: str,
) -> dict[str, Tensor]:
    """Empty tensors for every entry this rank reads; DTensors where `into` has them."""
    state: dict[str, Tensor] = {}
    for stack in plan.stacks:
        for leaf, shape in stack.leaf_shapes().items():
            dtype = dtypes.get(f"stacks/{stack.key}/{leaf}")
            if dtype is None:
                raise CheckpointCorruptError(f"{where}: no dtype for stacks/{stack.key}/{leaf}.")
            for row in rows[stack.key][leaf]:
                state[_key(stack.key, leaf, row)] = torch.empty(shape[1:], dtype=dtype)
    for p in plan.free:
        kind = "free" if p.trainable else "frozen"
        target = into[kind][p.name] if into is not None else None
        if isinstance(target, DTensor):
            state[f"{kind}/{p.name}"] = torch.empty_like(target.detach())
        else:
            state[f"{kind}/{p.name}"] = torch.empty(p.shape, dtype=getattr(torch, p.dtype))
    return state


def _buffer_templates(manifest: dict[str, Any], model: nn.Module, where: str) -> dict[str, Tensor]:
    """Empty tensors for the p-net buffers the manifest lists, each checked against `model`'s
    (manifests before version 4 list none)."""
    try:
        listed = [
            (name, getattr(torch, dtype, None), tuple(shape))
            for name, (dtype, shape) in (manifest.get("buffers") or {}).items()
        ]
    except (AttributeError, TypeError, ValueError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable buffer list ({e!s:.200}).") from None
    mine = persistent_buffers(model)
    state = {}
    for name, dtype, shape in listed:
        if not isinstance(dtype, torch.dtype):
            raise CheckpointCorruptError(f"{where}: unreadable buffer list (buffer {name!r}).")
        check_buffer(name, dtype, shape, mine, where)
        state[BUFFERS + name] = torch.empty(shape, dtype=dtype)
    return state


def _read(
    path: str | os.PathLike, state: dict[str, Tensor], group: dist.ProcessGroup | None, where: str
) -> None:
    try:
        with warnings.catch_warnings():  # one process reading on purpose: not worth a warning
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=os.fspath(path), process_group=group, no_dist=not group)
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        raise CheckpointCorruptError(
            f"{where}: a shard is missing or damaged ({e!s:.300})."
        ) from None


def _check_into(
    plan: Plan, rows: dict[str, dict[str, list[int]]], into: GParams, where: str
) -> None:
    """`into` holds every tensor this rank reads, in its shape (global for a DTensor)."""
    wanted = [
        (("stacks", stack.key, leaf), (len(rows[stack.key][leaf]), *shape[1:]))
        for stack in plan.stacks
        for leaf, shape in stack.leaf_shapes().items()
    ]
    wanted += [(("free" if p.trainable else "frozen", p.name), p.shape) for p in plan.free]
    for path, shape in wanted:
        node: Any = into
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, Tensor) or tuple(node.shape) != tuple(shape):
            found = tuple(node.shape) if isinstance(node, Tensor) else type(node).__name__
            raise ValueError(
                f"{where}: into{''.join(f'[{k!r}]' for k in path)} is {found}; this rank reads "
                f"{tuple(shape)} there. Pass the gparams of the same plan and world size."
            )


def _verify(
    path: Path,
    state: dict[str, Tensor],
    digests: dict[str, str],
    checksums: dict[str, str],
    group: dist.ProcessGroup | None,
    where: str,
) -> None:
    """Compare every entry read with what the manifest recorded when it was written.

    Plain entries first, then DTensors (collectives, in the same order on every rank); the
    ranks then agree on the first damaged entry, so that all raise and none is left waiting.
    """
    plain = [(k, v) for k, v in state.items() if not isinstance(v, DTensor)]
    sharded = [(k, v) for k, v in state.items() if isinstance(v, DTensor)]
    damaged = [k for k, v in [*plain, *sharded] if not _matches(k, v, digests, checksums)]
    first = damaged[0] if damaged else None
    if group is not None:
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, first, group=group)
        first = next((k for k in every if k is not None), None)
    if first is not None:
        raise CheckpointCorruptError(
            f"{where}: {first} in {_file_of(path, first)} does not match its checksum: the "
            "shard was altered or damaged after it was written."
        )


def _matches(key: str, value: Tensor, digests: dict[str, str], checksums: dict[str, str]) -> bool:
    if key in digests and not isinstance(value, DTensor):
        return digests[key] == _digest(key, value)
    if key in checksums:
        return checksums[key] == checksum(value)  # a collective for a DTensor
    if key in digests:  # written whole by an older version, read sharded
        return digests[key] == _digest(key, value.full_tensor())
    return False


def _fill(into: GParams, loaded: GParams) -> None:
    """Copy the checked values of `_assemble` into `into`'s tensors (`_check_into` made sure
    it has every one of them), leaf by leaf."""
    with torch.no_grad():
        for key, leaves in loaded["stacks"].items():
            for leaf, value in leaves.items():
                into["stacks"][key][leaf].copy_(value)
        for kind in ("free", "frozen"):
            for name, value in loaded[kind].items():
                into[kind][name].copy_(value)


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
