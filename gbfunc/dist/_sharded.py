"""Sharded checkpoints of g-nets, free parameters and optimizer state, through
`torch.distributed.checkpoint` (DCP).

Every rank writes what it holds and nothing is gathered: its rank-owned g-nets (`RankOwned`),
one DCP entry per g-net (or per tile, for tile leaves), or one copy of replicated ones; free
parameters that are DTensors (FSDP2) shard by shard, replicated ones once; an optimizer's
state split like its parameters (`_optim_state`). Entries are named by g-net and parameter,
not by rank, so the checkpoint loads at any world size and any DTensor layout: each rank
reads what it holds there. Rank 0 writes a manifest (`gbfunc.json`) naming the subfolder of
DCP's files (`_layout`: a save replaces a checkpoint only once the new one is complete), with
the plan, the step, `meta`, the optimizer's settings, a SHA-256 of every whole entry and a
layout-free checksum (`_checksum`) of every free and optimizer entry, so that loading checks
the plan against the model as `gb.load` does and detects a damaged shard, naming its file and
entry, before anything is changed. Unlike `gb.load`'s single file, a sharded checkpoint is
read through pickle: DCP reads its `.metadata` with plain `pickle.load`, which runs whatever
the file says, before gbfunc can check anything. Load one only from a source you trust.
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

from .._buffers import persistent_buffers
from .._check_gparams import TASKS
from .._check_model import check_module
from .._check_plan import check_plan
from .._checkpoint import (
    BUFFERS,
    Checkpoint,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointUnreadableError,
    CheckpointVersionError,
    content_hash,
    restore_buffers,
)
from .._checkpoint_checks import check_buffer, check_restorable
from .._devices import checked_device
from .._plan import TILE_LEAVES, Plan
from .._serial import meta_from, plan_from_json
from .._tree import GParams
from ._checksum import checksum
from ._layout import MANIFEST, data_folder, entry_file, reason, sharing, short_data_file
from ._optim_state import leaves as optim_leaves, restore, staged, templates
from ._owned import RankOwned

FORMAT = "gbfunc.sharded"
# 3: layout-free checksums of free and optimizer entries (DTensor shards), optimizer state;
# 4: the p-net's buffers; 5: DCP's files in a subfolder the manifest names (`_layout`)
FORMAT_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)
# the plan JSON version inside, as in `gb.save`'s files
PLAN_VERSION_OF = {1: 1, 2: 2, 3: 2, 4: 2, 5: 2}
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
        `Checkpoint(gparams, plan, None, step, meta)`, holding `into`, or this rank's part
            of the g-nets (all of them without `owned`) and the free and frozen parameters;
            the plan names `model`, so that a save with it stores `model`'s buffers again.

    Raises:
        gb.CheckpointNotFoundError: No manifest at `path`.
        gb.CheckpointVersionError: A manifest of another format or version.
        gb.CheckpointMismatchError: The checkpoint's plan does not fit `model`, `owned` was
            made from another plan, or `optimizer` holds other parameters than were saved.
        gb.CheckpointCorruptError: A missing, truncated or altered shard, naming its file and
            entry.

    Examples:
        One process, no process group: every g-net is read.

        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> gb.dist.save_sharded("ckpt", gb.init(plan), plan=plan, step=7)
        >>> ckpt = gb.dist.load_sharded("ckpt", model)
        >>> ckpt.step, ckpt.plan == plan
        (7, True)

        Resuming in place, optimizer included (`into` and `optimizer`):

        >>> gparams = gb.init(plan)
        >>> opt = torch.optim.AdamW(gb.trainable_leaves(gparams))
        >>> gb.dist.save_sharded("ckpt", gparams, plan=plan, optimizer=opt, step=8)
        >>> into = gb.init(plan, seed=1)
        >>> opt = torch.optim.AdamW(gb.trainable_leaves(into))
        >>> ckpt = gb.dist.load_sharded("ckpt", model, into=into, optimizer=opt)
        >>> ckpt.step, ckpt.gparams is into
        (8, True)

        Under `torchrun`, each rank reading only its own g-nets, at any world size:

        >>> owned = gb.dist.RankOwned(plan)  # doctest: +SKIP
        >>> local = gb.dist.load_sharded("ckpt", model, owned).gparams  # doctest: +SKIP
    """
    where = f"gb.dist.load_sharded: {os.fspath(path)}"
    group = _read_group(owned, group, into)
    with sharing(path):  # no save removes the data folder while this reads it
        failure = None
        try:  # what each rank checks alone; the ranks agree on it before DCP's collective read
            check_module(model, "gb.dist.load_sharded")
            device = checked_device("gb.dist.load_sharded", "device", device)
            manifest = _manifest(Path(path), where)
            data = data_folder(Path(path), manifest, where)
            plan, dtypes, digests, checksums, meta = _read_manifest(manifest, where)
            check_plan(
                plan, model, where, corrupt=CheckpointCorruptError, mismatch=CheckpointMismatchError
            )
            if owned is not None and owned.plan.fingerprint() != plan.fingerprint():
                raise CheckpointMismatchError(f"{where}: `owned` was made from another plan.")
            if optimizer is not None and (into is None or manifest.get("optimizer") is None):
                raise ValueError(
                    f"{where}: restoring an optimizer needs `into` (the gparams it trains) and a "
                    "checkpoint saved with `optimizer=`."
                )
            rows = _rows(plan, owned)
            if into is not None:
                _check_into(plan, rows, into, dtypes, where)
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
        except Exception as e:
            failure = e
        agree(group, None, failure, where, unchanged="nothing was loaded")
        _read(data, state, group, where)
        _verify(data, state, digests, checksums, group, where)
    gparams = _assemble(plan, rows, state, dtypes, device)
    buffers = {k.removeprefix(BUFFERS): v for k, v in state.items() if k.startswith(BUFFERS)}
    # a failed load changes nothing: what can fail runs first, then the buffers (all or none),
    # then the optimizer's settings and state, set by assignments that cannot fail
    new = staged(manifest["optimizer"], optimizer, known, state) if optimizer is not None else []
    restore_buffers(model, buffers, where)
    if optimizer is not None:
        restore(optimizer, new)
    if into is not None:
        _fill(into, gparams)
        gparams = into
    return Checkpoint(gparams, plan.naming(model), None, manifest["step"], meta)


def agree(
    group: dist.ProcessGroup | None,
    mine: Any,
    failure: Exception | None,
    where: str,
    *,
    unchanged: str = "the checkpoint there before, if any, is unchanged",
) -> list[Any]:
    """Every rank's `mine`; where any rank failed, every rank raises instead (its own error,
    or one naming the rank that failed and saying what is `unchanged`), so that none waits
    for it in a collective."""
    message = None if failure is None else f"{failure}".removeprefix(f"{where}: ")
    every = [(mine, message)]
    if group is not None:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (mine, message), group=group)
    if failure is not None:
        raise failure
    for rank, (_, failed) in enumerate(every):
        if failed is not None:
            raise CheckpointError(f"{where}: rank {rank} failed ({failed}); {unchanged}.")
    return [m for m, _ in every]


def _read_manifest(
    manifest: dict[str, Any], where: str
) -> tuple[Plan, dict[str, torch.dtype], dict[str, str], dict[str, str], Any]:
    """The plan, the entries' dtypes, digests and checksums, and `meta` the manifest holds."""
    try:
        version = manifest["format_version"]
        plan = plan_from_json(manifest["plan"], PLAN_VERSION_OF[version])
        dtypes = {k: _DTYPES[v] for k, v in manifest["dtypes"].items()}
        digests, checksums = dict(manifest["sha256"]), dict(manifest.get("checksums") or {})
        return plan, dtypes, digests, checksums, meta_from(manifest)
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise CheckpointCorruptError(f"{where}: unreadable manifest ({e!s:.200}).") from None


def _read_group(
    owned: RankOwned | None, group: dist.ProcessGroup | None, into: GParams | None
) -> dist.ProcessGroup | None:
    """The process group of DCP's read (None: this rank reads alone), found without raising,
    so that a rank whose arguments are refused still takes part in `agree`."""
    if isinstance(owned, RankOwned):
        return owned.group
    if group is None and _has_dtensor(into):
        return dist.group.WORLD
    return group


def _has_dtensor(gparams: object) -> bool:
    return isinstance(gparams, dict) and any(
        isinstance(v, DTensor)
        for k in ("free", "frozen")
        if isinstance(gparams.get(k), dict)
        for v in gparams[k].values()
    )


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
        else:  # as saved (gb.init(dtype=) may differ from the model); older manifests: plan's
            dtype = dtypes.get(f"{kind}/{p.name}", getattr(torch, p.dtype))
            state[f"{kind}/{p.name}"] = torch.empty(p.shape, dtype=dtype)
    if plan.tasks:
        dtype = dtypes.get(TASKS)
        if dtype is None:
            raise CheckpointCorruptError(f"{where}: no dtype for {TASKS}.")
        state[TASKS] = torch.empty((plan.tasks, plan.condition), dtype=dtype)
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
    check_restorable(model, (name for name, _, _ in listed), where)
    return state


def _read(
    data: Path, state: dict[str, Tensor], group: dist.ProcessGroup | None, where: str
) -> None:
    try:
        with warnings.catch_warnings():  # one process reading on purpose: not worth a warning
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=data, process_group=group, no_dist=not group)
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        found = short_data_file(data)
        peers = "" if group is None or found else ", or a peer rank failed while reading"
        raise CheckpointCorruptError(
            f"{where}: a shard is missing or damaged{peers} ({found or reason(e)})."
        ) from e


def _check_into(
    plan: Plan,
    rows: dict[str, dict[str, list[int]]],
    into: GParams,
    dtypes: dict[str, torch.dtype],
    where: str,
) -> None:
    """`into` holds every tensor this rank reads, in its shape (global for a DTensor), one
    that can take the saved values: with storage, writable here, floating where they are."""
    wanted = [
        (("stacks", stack.key, leaf), (len(rows[stack.key][leaf]), *shape[1:]))
        for stack in plan.stacks
        for leaf, shape in stack.leaf_shapes().items()
    ]
    wanted += [(("free" if p.trainable else "frozen", p.name), p.shape) for p in plan.free]
    wanted += [((TASKS,), (plan.tasks, plan.condition))] if plan.tasks else []
    for path, shape in wanted:
        node: Any = into
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        named = f"{where}: into{''.join(f'[{k!r}]' for k in path)}"
        if not isinstance(node, Tensor) or tuple(node.shape) != tuple(shape):
            found = tuple(node.shape) if isinstance(node, Tensor) else type(node).__name__
            raise ValueError(
                f"{named} is {found}; this rank reads {tuple(shape)} there. Pass the gparams of "
                "the same plan and world size (with `owned`: `owned.shard(gparams)`)."
            )
        saved = dtypes.get("/".join(path))
        if node.is_meta:
            raise ValueError(f"{named} is on the meta device: it cannot hold the values read.")
        if node.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(
                f"{named} is an inference tensor (made under torch.inference_mode): it cannot "
                "be written outside it. Pass gparams made outside inference mode."
            )
        if saved is not None and saved.is_floating_point and not node.dtype.is_floating_point:
            raise TypeError(
                f"{named} is {node.dtype}; the checkpoint holds {saved} there, which it would "
                "truncate."
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
            f"{where}: {first} in {entry_file(path, first)} does not match its checksum: the "
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
        if TASKS in loaded:
            into[TASKS].copy_(loaded[TASKS])


def _manifest(path: Path, where: str) -> dict[str, Any]:
    target = path / MANIFEST
    try:
        found = target.is_file()  # (it raises where the folder cannot be searched)
        manifest = json.loads(target.read_text()) if found else None
    except OSError as e:
        reason = e.strerror or e
        raise CheckpointUnreadableError(f"{where}: cannot read {MANIFEST} ({reason}).") from None
    except ValueError as e:  # not UTF-8, or not JSON
        raise CheckpointCorruptError(f"{where}: unreadable {MANIFEST} ({e!s:.200}).") from None
    if not found:
        raise CheckpointNotFoundError(f"{where}: no {MANIFEST}; not a sharded gbfunc checkpoint.")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{where}: {MANIFEST} is not a {FORMAT} manifest.")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointVersionError(
            f"{where}: format version {manifest.get('format_version')!r}; this gbfunc reads "
            f"versions {READABLE_VERSIONS}."
        )
    return manifest


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
    gparams = {
        "stacks": stacks,
        "free": {p.name: ready(state[f"free/{p.name}"], True) for p in plan.free if p.trainable},
        "frozen": {
            p.name: ready(state[f"frozen/{p.name}"], False) for p in plan.free if not p.trainable
        },
    }
    if plan.tasks:
        gparams[TASKS] = ready(state[TASKS], True)
    return gparams
