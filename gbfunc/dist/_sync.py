"""Gradient synchronisation: flat buckets, all-reduced asynchronously while backward runs.

Every rank ends backward holding a *partial* gradient of the global loss: its own batch
shard (data parallel), its own tiles (tensor parallel), its own layers (pipeline). Summing
over every rank and dividing by the number of data-parallel replicas gives the gradient of
the mean loss, the same on every rank, so identical optimizer steps keep replicated g-nets
bitwise identical.
"""

import datetime
import functools
import hashlib
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .._numbers import integer
from ._mesh import dim_size

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer rank probably died or hung."""


def wait_or_raise(work: dist.Work, what: str) -> None:
    """`work.wait()`, turning a backend failure into a `CollectiveError` that says what failed."""
    try:
        work.wait()
    except RuntimeError as error:
        raise CollectiveError(failure_message(what, error)) from error


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """How long `group`'s collectives wait before raising (None where this torch does not
    say: then a new group gets torch's default). Torch keeps it in the backend's options."""
    device = torch.device("cpu" if dist.get_backend(group) == "gloo" else "cuda")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def same_on_every_rank(values: Tensor, what: str, group: dist.ProcessGroup | None = None) -> bool:
    """Whether the 1-D `values` are equal on every rank of `group`: one all-reduce of their
    maxima and their negatives' (equal everywhere iff max == min); `what` names it if the
    collective fails."""
    extremes = torch.cat([values, -values])
    wait_or_raise(dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group, async_op=True), what)
    return torch.equal(extremes, torch.cat([values, -values]))


def failure_message(what: str, error: Exception) -> str:
    """Says which collective failed, where, and the likely cause, then the backend's words."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (
        f"gb.dist: {what} failed on rank {rank}: a peer rank probably died, or hung past the "
        f"process-group timeout. Backend error: {error}"
    )


def _check_same_leaves(leaves: list[Tensor]) -> None:
    """Raise on every rank unless every rank passed leaves of the same number, shapes, dtypes
    and `requires_grad`, naming the first that differs: the buckets' all-reduces would add
    unrelated gradients, or abort in the backend, where they do not. One all-reduce of a
    digest; the leaves themselves are gathered only where the digests differ."""
    described = [(tuple(t.shape), str(t.dtype), t.requires_grad) for t in leaves]
    digest = int.from_bytes(hashlib.sha256(repr(described).encode()).digest()[:7], "big")
    if leaves:
        device = leaves[0].device
    else:  # (no leaf to follow: NCCL reduces CUDA tensors only)
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    if not same_on_every_rank(torch.tensor([digest], device=device), "the leaves' check"):
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, described)
        ours = dist.get_rank()
        for rank, theirs in enumerate(every):
            if theirs == described:
                continue
            first = next(
                (i for i, (a, b) in enumerate(zip(described, theirs, strict=False)) if a != b),
                min(len(described), len(theirs)),
            )

            def leaf(of: list, i: int = first) -> str:
                return "none" if i >= len(of) else "shape {}, {}, requires_grad={}".format(*of[i])

            raise ValueError(
                f"gb.dist.GradSync: the ranks passed different leaves: leaf {first} is "
                f"{leaf(described)} on rank {ours} and {leaf(theirs)} on rank {rank} "
                f"({len(described)} and {len(theirs)} leaves). Pass the same trainable leaves, "
                "in the same order, on every rank (gb.trainable_leaves of replicated gparams; "
                "a RankOwned shard's g-nets are reduced by RankOwned itself)."
            )


class GradSync:
    """Sum gradients over every rank in flat buckets as they are produced, divided by the dp size.

    Post-accumulate-grad hooks start each bucket's asynchronous all-reduce as soon as all its
    leaves have gradients, in the same bucket order on every rank; `wait()` starts the rest
    (leaves without a gradient count as zeros), waits and writes the results into `.grad`. A
    leaf that no rank gave a gradient keeps `.grad` None, as in one process, so that an
    optimizer skips it.

    Args:
        leaves: Trainable tensors, identical in shape and order on every rank (see
            `gb.trainable_leaves`).
        mesh: The mesh spanning every rank; gradients are divided by its `"dp"` size. Default:
            pure data parallel over the world.
        bucket_bytes: Target size of one bucket.
        overlap: Start each bucket's all-reduce during backward. `False`: all in `wait()`,
            once per step, whatever the number of backward passes before it (gradient
            accumulation, or several pipeline stages on one rank, whose gradients a reduce
            started after the first pass would miss).

    Examples:
        On every rank, under `torchrun`:

        >>> sync = GradSync(gb.trainable_leaves(gparams), mesh)  # doctest: +SKIP
        >>> loss.backward(); sync.wait(); opt.step(); opt.zero_grad()  # doctest: +SKIP
    """

    def __init__(
        self,
        leaves: Iterable[Tensor],
        mesh: DeviceMesh | None = None,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        overlap: bool = True,
    ) -> None:
        world = dist.get_world_size()
        if mesh is not None and mesh.size() != world:
            raise ValueError(
                f"gb.dist.GradSync: mesh has {mesh.size()} ranks but the world has {world}; "
                "pass the mesh from gb.dist.init_mesh, which spans every rank."
            )
        self.divisor = world if mesh is None else dim_size(mesh, "dp", "gb.dist.GradSync")
        leaves = _checked_leaves(leaves)
        bucket_bytes = integer("gb.dist.GradSync", "bucket_bytes", bucket_bytes, minimum=1)
        if not isinstance(overlap, bool):
            raise TypeError(f"gb.dist.GradSync: overlap must be a bool, got {overlap!r:.100}.")
        _check_same_leaves(leaves)
        frozen = next((i for i, t in enumerate(leaves) if not t.requires_grad), None)
        if overlap and frozen is not None:
            raise ValueError(
                f"gb.dist.GradSync: leaf {frozen} (shape {tuple(leaves[frozen].shape)}) does "
                "not require grad, so no hook can start its all-reduce; pass leaves that "
                "require grad (gb.init's default), or overlap=False to reduce the .grad you set."
            )
        # Gradients arrive roughly in reverse order of use: bucket from the end, like DDP.
        self._buckets: list[list[Tensor]] = []
        size = bucket_bytes
        for leaf in reversed(leaves):
            nbytes = leaf.numel() * leaf.element_size()
            fits = self._buckets and self._buckets[-1][0].dtype == leaf.dtype
            if not fits or size + nbytes > bucket_bytes:
                self._buckets.append([])
                size = 0
            self._buckets[-1].append(leaf)
            size += nbytes
        self._bucket_of = {id(t): i for i, bucket in enumerate(self._buckets) for t in bucket}
        # The hooks hold this object weakly, and go with it: a GradSync dropped (or closed)
        # and rebuilt over the same leaves leaves no hook of its own behind.
        hook = functools.partial(_on_gradient, weakref.ref(self))
        self._hooks = (
            [leaf.register_post_accumulate_grad_hook(hook) for b in self._buckets for leaf in b]
            if overlap
            else []
        )
        weakref.finalize(self, _remove, self._hooks)
        self.comm_bytes = 0  # gradient payload all-reduced by the last `wait()`
        self._all_had: dict[int, Tensor] = {}  # per bucket: every leaf had a gradient
        self._reset()

    def close(self) -> None:
        """Remove the hooks from the leaves now (they go when this object does, too)."""
        _remove(self._hooks)

    def _reset(self) -> None:
        self._pending = [len(b) for b in self._buckets]
        self._seen: set[int] = set()
        self._works: list[tuple[dist.Work, Tensor]] = []

    def _ready(self, leaf: Tensor) -> None:
        if id(leaf) in self._seen:
            raise RuntimeError(
                "gb.dist.GradSync: a gradient was accumulated twice before sync.wait() "
                "(gradient accumulation, or several pipeline stages on this rank): build it "
                "with overlap=False, which all-reduces once, in wait()."
            )
        self._seen.add(id(leaf))
        index = self._bucket_of[id(leaf)]
        self._pending[index] -= 1
        while len(self._works) < len(self._buckets) and self._pending[len(self._works)] == 0:
            self._launch(len(self._works))

    def _launch(self, index: int) -> None:
        bucket = self._buckets[index]
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in bucket]
        # One flag per leaf after its values: whether this rank had a gradient for it (made
        # on the device: a list copied from the host would wait for the backward so far).
        if all(t.grad is not None for t in bucket):  # the hooks' case: made once
            if index not in self._all_had:
                self._all_had[index] = bucket[0].new_ones(len(bucket))
            had = self._all_had[index]
        else:
            had = torch.cat(
                [
                    g.new_ones(1) if t.grad is not None else g.new_zeros(1)
                    for t, g in zip(bucket, grads, strict=True)
                ]
            )
        flat = torch.cat([*(g.reshape(-1) for g in grads), had]).div_(self.divisor)
        try:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        except RuntimeError as error:
            raise CollectiveError(failure_message("the gradient all-reduce", error)) from error
        self._works.append((work, flat))

    def wait(self) -> None:
        """Finish every bucket's all-reduce and write the reduced gradients into `.grad`."""
        while len(self._works) < len(self._buckets):
            self._launch(len(self._works))
        self.comm_bytes = 0
        for bucket, (work, flat) in zip(self._buckets, self._works, strict=True):
            wait_or_raise(work, "the gradient all-reduce")
            self.comm_bytes += (flat.numel() - len(bucket)) * flat.element_size()
            # Read the flags (a host sync) only where this rank lacked a gradient.
            unused = [False] * len(bucket)
            if any(t.grad is None for t in bucket):
                unused = (flat[-len(bucket) :] == 0).tolist()
            offset = 0
            for t, no_rank_had_one in zip(bucket, unused, strict=True):
                g = flat[offset : offset + t.numel()].view_as(t)
                offset += t.numel()
                if no_rank_had_one:
                    continue  # its `.grad` stays None, as in one process
                if t.grad is None:
                    t.grad = g.clone()
                else:
                    t.grad.copy_(g)
        self._reset()


def _remove(hooks: list) -> None:
    """Remove every hook handle in `hooks`, emptying the list."""
    for handle in hooks:
        handle.remove()
    hooks.clear()


def _checked_leaves(leaves: object) -> list[Tensor]:
    """`leaves` as a list of tensors, else a TypeError naming what to pass (a gparams dict
    iterates over its keys)."""
    if isinstance(leaves, Tensor | Mapping | str) or not isinstance(leaves, Iterable):
        got = type(leaves).__name__
    else:
        leaves = list(leaves)
        bad = next((x for x in leaves if not isinstance(x, Tensor)), None)
        if bad is None:
            return leaves
        got = f"an iterable holding {type(bad).__name__!r}"
    raise TypeError(
        f"gb.dist.GradSync: leaves must be an iterable of tensors "
        f"(gb.trainable_leaves(gparams)), got {got}."
    )


def _on_gradient(sync: "weakref.ref[GradSync]", leaf: Tensor) -> None:
    """A leaf's post-accumulate-grad hook: tell its `GradSync`, if it is still alive."""
    if (owner := sync()) is not None:
        owner._ready(leaf)
