"""`gb.dist.save_sharded`: each rank writes its shards into a new data folder, then rank 0
switches the checkpoint's manifest to it (`_layout`), so that a failed or killed save leaves
the previous checkpoint loadable.

Everything that can be checked is checked on every rank before the first byte is written
(the arguments, the path, `meta` as JSON, the optimizer's settings), and the ranks agree on
the outcome: every rank goes on to write, or every rank raises; none is left waiting in a
collective for a rank that gave up.
"""

import json
import os
import warnings
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from .._check_gparams import TASKS, check_gparams
from .._checkpoint import BUFFERS, CheckpointError, buffers_to_save
from .._files import check_no_meta
from .._numbers import integer
from .._plan import Plan, check_is_plan
from .._serial import meta_fields, plan_to_json
from .._tree import GParams
from ._checksum import checksum
from ._layout import discard, new_folder, publish, reason, sharing, target
from ._optim_state import OPTIM, leaves as optim_leaves, state_entries
from ._owned import RankOwned
from ._sharded import FORMAT, FORMAT_VERSION, _digest, _key, _rows, agree


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
    each rank writes its shard, and they reshard on load). What several ranks hold (replicated
    parameters, buffers) is written from the lowest rank's copy: where a parameter's copies
    differ between ranks, a `RuntimeWarning` names it.

    The new checkpoint is written beside the one already at `path`, which is replaced only
    once the new one is complete: a save that raises or is killed leaves the previous
    checkpoint loadable. Files in the directory that are not the checkpoint's stay. Once the
    new checkpoint is switched in, a failure to sync the directory or to remove the replaced
    files is a `RuntimeWarning` (the next save removes them), not an error.

    Args:
        path: A directory, on a file system every rank can write.
        local: This rank's gparams.
        owned: The `RankOwned` that sharded the g-nets (or give `plan`).
        plan: The plan, for g-nets replicated on every rank of `group` (default: all ranks;
            no process group at all: one process writes everything).
        buffers: The p-net's buffers, as in `gb.save` (default: those of the model the plan
            was made from, while it is alive); rank 0's are written (BatchNorm's statistics
            differ between ranks unless synchronised, e.g. by `nn.SyncBatchNorm`).
        optimizer: A `torch.optim` optimizer over `local`'s trainable leaves; its state is
            written sharded like its parameters and restored by `load_sharded(optimizer=)`.
        step: Training step, an int >= 0.
        meta: As `gb.save` takes it; `load_sharded` returns it equal.

    Raises:
        gb.CheckpointError: `path` is a file or holds a NUL byte, or it cannot be written
            (the reason, e.g. no space left, in the message); or another rank failed.
        TypeError: An argument of the wrong type (e.g. `meta` that JSON cannot hold), named;
            nothing is written.
        ValueError: An argument of the wrong value, named; nothing is written.

    Examples:
        One process, no process group: g-nets replicated (`plan=`), written whole.

        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> gparams = gb.init(plan)
        >>> opt = torch.optim.AdamW(gb.trainable_leaves(gparams))
        >>> gb.dist.save_sharded("ckpt", gparams, plan=plan, optimizer=opt, step=7)
        >>> gb.dist.load_sharded("ckpt", model).step
        7

        Under `torchrun`, on every rank, each writing its own g-nets:

        >>> owned = gb.dist.RankOwned(plan)  # doctest: +SKIP
        >>> local = owned.shard(gb.init(plan, seed=0))  # doctest: +SKIP
        >>> gb.dist.save_sharded("ckpt", local, owned, step=7)  # doctest: +SKIP
    """
    where = "gb.dist.save_sharded"
    group = _group(owned, group)
    mine, failure = None, None
    try:
        plan = _plan(owned, plan, where)
        directory = target(path, where)
        rows = _rows(plan, owned)
        state, manifest = _prepare(
            plan, rows, local, buffers, optimizer, step, meta, where, sharded=owned is not None
        )
        digests = {k: _digest(k, v) for k, v in state.items() if not isinstance(v, DTensor)}
        mine = (digests, new_folder())
    except Exception as e:
        failure = e
    every = agree(group, mine, failure, where)
    name = every[0][1]  # the data folder rank 0 named
    # g-net rows (and their optimizer state) are held whole by one rank: a SHA-256 suffices.
    whole = ("stacks/", f"{OPTIM}stacks/")
    checksums = {k: checksum(v) for k, v in state.items() if not k.startswith(whole)}
    held = [digests for digests, _ in every]  # each rank's plain entries and their digests
    writer = _writers(held)
    rank = 0 if group is None else dist.get_rank(group)
    state = {k: v for k, v in state.items() if isinstance(v, DTensor) or writer[k] == rank}
    # the leading rank holds the directory's lock from before its write to its clean-up
    with sharing(directory, saving=True) if _leads(group) else nullcontext() as lock:
        try:
            with warnings.catch_warnings():  # one process writing on purpose: not worth a warning
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                dcp.save(
                    state,
                    checkpoint_id=directory / name,
                    process_group=group,
                    no_dist=group is None,
                )
        except (OSError, dcp.CheckpointException) as e:  # the latter is a BaseException
            if _leads(group):  # DCP raises on every rank once all have stopped writing
                discard(directory, name)
            raise _unwritable(where, directory, e) from e
        if _leads(group):
            manifest["sha256"] = {k: held[r][k] for k, r in writer.items()}
            _warn_differing(held, manifest["sha256"], where)
            manifest["checksums"] = checksums
            manifest["data"] = name
            try:
                late = publish(directory, name, json.dumps(manifest, sort_keys=True), lock)
            except Exception as e:  # the manifest is the previous one; no rank left waiting
                discard(directory, name)
                failure = _unwritable(where, directory, e) if isinstance(e, OSError) else e
            else:
                if late is not None:  # the new checkpoint is in place: no failure of the save
                    warnings.warn(
                        f"{where}: {os.fspath(directory)}: the new checkpoint is complete and "
                        f"loadable, but {late}; the files of the one it replaced stay until the "
                        "next save.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
    agree(group, None, failure, where)  # the manifest is there when any rank returns


def _writers(every: list[dict[str, str]]) -> dict[str, int]:
    """The rank that writes each plain entry: the lowest that holds it. DCP would write an
    entry that several ranks hold from any of them, and record no digest of the others."""
    writer: dict[str, int] = {}
    for rank, digests in enumerate(every):
        for key in digests:
            writer.setdefault(key, rank)
    return writer


def _warn_differing(every: list[dict[str, str]], written: dict[str, str], where: str) -> None:
    """Warn where a parameter that several ranks hold (free, frozen, replicated g-nets, their
    optimizer state) differs between them: training let the copies drift, and only the lowest
    rank's is saved. Buffers are left out: BatchNorm's statistics differ between ranks unless
    synchronised, and rank 0's are kept, as DDP's `broadcast_buffers` keeps them."""
    differing = sorted(
        {
            key
            for digests in every
            for key, digest in digests.items()
            if digest != written[key] and not key.startswith(BUFFERS)
        }
    )
    if differing:
        more = f" and {len(differing) - 3} more" if differing[3:] else ""
        warnings.warn(
            f"{where}: {', '.join(differing[:3])}{more} differ between the ranks that hold "
            "them; the lowest rank's copy is saved. Are their gradients all-reduced "
            "(gb.dist.GradSync)?",
            RuntimeWarning,
            stacklevel=3,
        )


def _group(owned: object, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The process group of the collective (None: one process on its own), found without
    raising, so that a rank whose arguments are refused still takes part in `agree`."""
    if isinstance(owned, RankOwned):
        return owned.group
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    return group


def _plan(owned: RankOwned | None, plan: Plan | None, where: str) -> Plan:
    """The plan of the g-nets saved, from `owned` or `plan=` (exactly one of them)."""
    if plan is not None and owned is None:
        return check_is_plan(plan, where)
    if owned is not None and plan is None:
        if not isinstance(owned, RankOwned):
            raise TypeError(f"{where}: owned must be a RankOwned, got {type(owned).__name__}.")
        return owned.plan
    raise TypeError(
        f"{where}: pass `owned` (rank-owned g-nets) or `plan=` (g-nets replicated on every "
        "rank of `group`), exactly one of them."
    )


def _prepare(
    plan: Plan,
    rows: dict[str, dict[str, list[int]]],
    local: GParams,
    buffers: nn.Module | dict[str, Tensor] | None,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    meta: Any,
    where: str,
    *,
    sharded: bool,
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """This rank's entries, and the manifest but for what depends on every rank's; `local`
    checked against the plan first (a rank's part where `sharded`), as `gb.save` checks it."""
    step = integer(where, "step", step, minimum=0, optional=True)
    kept_meta = meta_fields(meta, where)  # refused here, before any shard is written
    check_gparams(local, plan, where, shard=sharded)
    state = _value_entries(local, rows, where)
    kept = buffers_to_save(buffers, plan, where, stacklevel=3)  # save_sharded's caller
    state.update({BUFFERS + name: t for name, t in kept.items()})
    described = None
    if optimizer is not None:
        entries, described = state_entries(optimizer, optim_leaves(plan, local, rows), where)
        state.update(entries)
    check_no_meta({f"entry {k!r}": v for k, v in state.items()}, where)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "plan": plan_to_json(plan),
        "step": step,
        **kept_meta,
        "dtypes": {
            f"stacks/{key}/{leaf}": str(v.dtype).removeprefix("torch.")
            for key, leaves in local["stacks"].items()
            for leaf, v in leaves.items()
        }
        | {
            f"{kind}/{name}": str(v.dtype).removeprefix("torch.")
            for kind in ("free", "frozen")
            for name, v in local[kind].items()
        }
        | ({TASKS: str(local[TASKS].dtype).removeprefix("torch.")} if TASKS in local else {}),
        "buffers": {
            n: [str(t.dtype).removeprefix("torch."), list(t.shape)] for n, t in kept.items()
        },
        "optimizer": described,
    }
    return state, manifest


def _value_entries(
    local: GParams, rows: dict[str, dict[str, list[int]]], where: str
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
    if TASKS in local:  # replicated, as the free parameters
        state[TASKS] = local[TASKS].detach()
    return state


def _leads(group: dist.ProcessGroup | None) -> bool:
    """Whether this rank names the data folder and writes the manifest."""
    return group is None or dist.get_rank(group) == 0


def _unwritable(where: str, path: os.PathLike, error: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{where}: {os.fspath(path)}: cannot be written ({reason(error)}); the checkpoint "
        "there before, if any, is unchanged."
    )
