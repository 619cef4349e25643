"""`gb.dist.save_replicated`: one checkpoint for g-nets replicated on every rank.

With replicated g-nets (data parallel), every rank holds the same `gparams`, so rank 0
writes the file and every rank reads it back with `gb.load`. Rank-owned g-nets use
`gb.dist.save_sharded` instead (`torch.distributed.checkpoint`, no gather).
"""

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._checkpoint import CheckpointError, save
from ._plan import Plan
from ._tree import GParams


def save_replicated(
    path: str | os.PathLike,
    gparams: GParams,
    plan: Plan,
    *,
    group: dist.ProcessGroup | None = None,
    buffers: nn.Module | Mapping[str, Tensor] | None = None,
    opt_state: object = None,
    step: int | None = None,
    meta: dict[str, Any] | None = None,
) -> None:
    """`gb.save` on rank 0 of `group`; every rank returns once the file is complete.

    Call it on every rank of `group` (a collective). Afterwards any rank may `gb.load` the
    file (on a file system all ranks share). If rank 0 fails to write, rank 0 raises its
    error and the other ranks raise `gb.CheckpointError`. Without an initialised process
    group this is `gb.save`.

    Args:
        path: Target file, on a file system every rank of `group` can read.
        gparams: This rank's replica (identical on every rank).
        plan: The plan that made `gparams`.
        group: Process group (default: the world).
        buffers: As in `gb.save`: the p-net's buffers (BatchNorm statistics), needed where
            the plan's model is gone or on `meta`.
        opt_state: As in `gb.save`.
        step: As in `gb.save`.
        meta: As in `gb.save`.

    Examples:
        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> # every rank
        >>> gb.dist.save_replicated("ckpt.safetensors", gb.init(plan), plan, step=7)
        >>> gb.load("ckpt.safetensors", model).step  # any rank, afterwards
        7
    """
    if not (dist.is_available() and dist.is_initialized()):
        save(path, gparams, plan, buffers=buffers, opt_state=opt_state, step=step, meta=meta)
        return
    error: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            save(path, gparams, plan, buffers=buffers, opt_state=opt_state, step=step, meta=meta)
        except Exception as e:  # reported to the other ranks, then re-raised here
            error = e
    # One collective doubles as the barrier: the file is complete when it returns.
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else None
    )
    failed = torch.tensor([0 if error is None else 1], device=device)
    dist.all_reduce(failed, group=group)
    if error is not None:
        raise error
    if failed.item():
        raise CheckpointError(
            f"gb.dist.save_replicated: {os.fspath(path)}: rank 0 failed to write the checkpoint."
        )
