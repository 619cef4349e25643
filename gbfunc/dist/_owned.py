"""Rank-owned g-nets: each g-net lives on one rank, which generates its tiles for everyone.

The unit of ownership is the g-net: one tile, or with `share=True` all the tiles of one
parameter (a shared g-net's gradient must not be split across ranks). Whole stacks would be
far too coarse: a stack groups every weight with the same tile shape, so a model often has
one or two. G-nets go to ranks longest first (LPT), each to the least-loaded rank, which
keeps the most-loaded rank within one g-net's cost of the mean.
"""

import heapq
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from .._check_gparams import check_gparams
from .._condition import condition_of, conditioned
from .._dispatch import torch_variant
from .._numbers import integer
from .._plan import TILE_LEAVES, Plan, Stack, check_is_plan
from .._tiling import assemble, parameters
from .._tracing import autocast_off, functions_traceable
from .._tree import GParams, first_leaf
from ..generate.torch_ops import evaluate_stack
from ._sync import (
    CollectiveError,
    failure_message,
    group_timeout,
    same_on_every_rank,
    wait_or_raise,
)

# Renamed in torch 2.13 (the old names warn); keep both working.
_all_gather = (
    getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
)
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Ownership:
    """Which rank owns each g-net of a plan.

    Attributes:
        world_size: Number of ranks.
        owners: Per stack, the owning rank of each g-net.
        loads: Estimated generation FLOPs per rank.
    """

    world_size: int
    owners: tuple[tuple[int, ...], ...]
    loads: tuple[float, ...]

    @property
    def imbalance(self) -> float:
        """Most-loaded rank over the mean load (1.0 is perfect balance)."""
        return max(self.loads) * self.world_size / sum(self.loads)

    def gnets(self, stack: int, rank: int) -> list[int]:
        """The g-nets of `stack` that `rank` owns, ascending."""
        return [g for g, r in enumerate(self.owners[stack]) if r == rank]

    def tiles(self, plan: Plan, stack: int, rank: int) -> list[int]:
        """The tiles of `stack` that `rank` generates, ascending."""
        owner = self.owners[stack]
        return [t for t, g in enumerate(plan.stacks[stack].gnet_of_tile) if owner[g] == rank]


def assign(plan: Plan, world_size: int) -> Ownership:
    """Give every g-net of `plan` to a rank: longest first, each to the least-loaded rank.

    Ties go to the lower stack, g-net and rank, so every rank computes the same assignment.

    Args:
        plan: The plan.
        world_size: Number of ranks.

    Examples:
        >>> model = nn.Sequential(nn.Linear(100, 300), nn.ReLU(), nn.Linear(300, 10))
        >>> plan = gb.plan(model, tile=(64, 64))  # 10 + 5 g-nets of two sizes
        >>> round(assign(plan, 4).imbalance, 3)  # the busiest rank over the mean
        1.099
    """
    check_is_plan(plan, "gb.dist.assign")
    world_size = integer("gb.dist.assign", "world_size", world_size, minimum=1)
    items = [
        (-n * stack.tile_flops, s, g)
        for s, stack in enumerate(plan.stacks)
        for g, n in enumerate(stack.tiles_per_gnet)
    ]
    owners = [[0] * stack.num_gnets for stack in plan.stacks]
    heap = [(0.0, r) for r in range(world_size)]
    for cost, s, g in sorted(items):
        load, rank = heapq.heappop(heap)
        owners[s][g] = rank
        heapq.heappush(heap, (load - cost, rank))
    loads = [0.0] * world_size
    for load, rank in heap:
        loads[rank] = load
    return Ownership(world_size, tuple(map(tuple, owners)), tuple(loads))


class RankOwned:
    """Generate only this rank's g-nets' tiles; all-gather them so every rank has every weight.

    The all-gathers start asynchronously, one per stack, as each stack's tiles are ready, and
    their backward reduce-scatters weight gradients back to the owners (divided by the world
    size: the mean over data-parallel ranks). Free parameters stay replicated; synchronise
    them with `GradSync`.

    Args:
        plan: The plan, identical on every rank.
        group: Process group of the data-parallel ranks (default: the world), say the dp
            dimension's of a dp x tp mesh. A private copy is made, by its members alone, so
            these collectives never interleave with others on `group`.

    Examples:
        Under `torchrun`, on every rank; `local` holds this rank's g-nets only:

        >>> owned = RankOwned(plan)  # doctest: +SKIP
        >>> local = owned.shard(gb.init(plan, seed=0))  # doctest: +SKIP
        >>> out = functional_call(model, owned.apply(local), (x,))  # doctest: +SKIP
    """

    def __init__(self, plan: Plan, group: dist.ProcessGroup | None = None) -> None:
        self.plan = check_is_plan(plan, "gb.dist.RankOwned")
        # each dp group's members make its copy (other ranks copy theirs): local
        # synchronisation, which names the copy by its ranks, not by a world-wide count
        parent = group or dist.group.WORLD
        ranks = dist.get_process_group_ranks(parent)
        # with the parent's timeout: a dead peer raises, as on `init_mesh`'s groups
        timeout = group_timeout(parent)
        self.group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.ownership = assign(plan, self.world)
        self._gnets = [self.ownership.gnets(s, self.rank) for s in range(len(plan.stacks))]
        self._tiles = [self.ownership.tiles(plan, s, self.rank) for s in range(len(plan.stacks))]
        self._rows: list[int] = []  # tiles per rank in the padded all-gather, per stack
        self._position: list[Tensor] = []  # row of each tile of the stack in the gathered tensor
        for s in range(len(plan.stacks)):
            per_rank = [self.ownership.tiles(plan, s, r) for r in range(self.world)]
            rows = max(len(t) for t in per_rank)
            position = [0] * plan.stacks[s].num_tiles
            for r, tiles in enumerate(per_rank):
                for i, t in enumerate(tiles):
                    position[t] = r * rows + i
            self._rows.append(rows)
            self._position.append(torch.tensor(position, device="cpu"))  # moved where used
        self.comm_bytes = 0  # payload all-gathered and reduce-scattered in the last step

    def _local_stack(self, s: int) -> Stack:
        stack = self.plan.stacks[s]
        return replace(stack, tiles_per_gnet=tuple(stack.tiles_per_gnet[g] for g in self._gnets[s]))

    def shard(self, gparams: GParams) -> GParams:
        """This rank's part of full `gparams`: its g-nets (as new leaves), the rest as it is."""
        check_gparams(gparams, self.plan, "gb.dist.RankOwned.shard")
        stacks = {}
        for s, stack in enumerate(self.plan.stacks):
            leaves = gparams["stacks"][stack.key]
            device = leaves["w_in"].device
            rows = {
                name: torch.tensor(  # int64 even where this rank owns none of the stack
                    self._tiles[s] if name in TILE_LEAVES else self._gnets[s],
                    dtype=torch.long,
                    device=device,
                )
                for name in leaves
            }
            stacks[stack.key] = {
                name: v.detach().index_select(0, rows[name]).requires_grad_(v.requires_grad)
                for name, v in leaves.items()
            }
        return _with_rest(stacks, gparams)

    def apply(
        self,
        local: GParams,
        *,
        condition: Tensor | None = None,
        task: int | Tensor | None = None,
    ) -> dict[str, Tensor]:
        """Every parameter of the p-net, from this rank's g-nets and its peers' (differentiable).

        A collective: every rank of the group calls it, and every rank's loss uses its
        weights (a stack one rank's loss leaves out still gets that rank's zero gradient).
        A conditioned plan takes `condition` or `task` as `gb.apply` does; it must be the same
        on every rank (each g-net generates its tiles for all of them; checked, one small
        all-reduce), and its gradient (into the task embeddings) is summed over the ranks,
        each of which holds the part its own g-nets give, so that every rank ends with the
        whole of it.
        """
        where = "gb.dist.RankOwned.apply"
        if torch.compiler.is_compiling() and not functions_traceable():
            raise ValueError(
                f"{where}: torch.compile of a gradient of a gradient, of forward mode (jvp, "
                "jacfwd, hessian) or of a grad inside a vmap is not supported through the "
                "rank-owned g-nets, whose gathers have autograd rules dynamo mis-traces there "
                "(torch 2.13); call it eagerly, or compile a first-order step."
            )
        check_gparams(local, self.plan, where, shard=True)
        self._check_shard(local)
        with autocast_off(first_leaf(local["stacks"])):  # as `gb.apply`: in the g-nets' dtype
            z = condition_of(local, self.plan, condition, task, where)
            if z is not None:
                _check_same_condition(z, self.group)
                local, _ = conditioned(local, self.plan, _summed_gradient(z, self.group))
            self.comm_bytes = 0
            gathered = [self._generate_and_gather(s, local) for s in range(len(self.plan.stacks))]
        tiles = []
        for g in gathered:
            if isinstance(g, funcol.AsyncCollectiveTensor):
                try:
                    g = g.wait()
                except RuntimeError as error:
                    raise CollectiveError(failure_message("the tile all-gather", error)) from error
            nbytes = g.numel() * g.element_size()
            self.comm_bytes += nbytes
            if g.requires_grad:  # its gradient is reduce-scattered back to the owners
                g.register_hook(lambda grad, nbytes=nbytes: self._count(nbytes))
            tiles.append(g)
        if any(t.requires_grad for t in tiles):
            tiles = list(_EveryStack.apply(*tiles))
        tiles = [t.index_select(0, self._position[s].to(t.device)) for s, t in enumerate(tiles)]
        generated = {
            p.name: assemble(p, self.plan.stacks[p.stack_index], tiles[p.stack_index])
            for p in self.plan.generated
        }
        return parameters(self.plan.params, local, generated)

    def _check_shard(self, local: GParams) -> None:
        """Raise unless `local` holds this rank's g-nets of every stack (as `shard` makes
        it): the whole gparams made a negative dimension deep inside the all-gather."""
        stacks = local.get("stacks") if isinstance(local, dict) else None
        for s, stack in enumerate(self.plan.stacks):
            leaves = stacks.get(stack.key) if isinstance(stacks, dict) else None
            w_in = leaves.get("w_in") if isinstance(leaves, dict) else None
            held = w_in.shape[0] if isinstance(w_in, Tensor) else None
            if held != len(self._gnets[s]):
                raise ValueError(
                    f"gb.dist.RankOwned.apply: local['stacks'][{stack.key!r}]['w_in'] holds "
                    f"{held} g-nets; rank {self.rank} owns {len(self._gnets[s])} of the "
                    f"stack's {stack.num_gnets}. Pass owned.shard(gparams), not the whole "
                    "gparams."
                )

    def _generate_and_gather(self, s: int, local: GParams) -> Tensor:
        """Start the all-gather of this rank's tiles of stack `s` (padded to the busiest rank)."""
        stack = self.plan.stacks[s]
        leaves = local["stacks"][stack.key]
        shape = (self._rows[s], stack.tile[0], stack.tile[1] * math.prod(stack.window))
        if self._gnets[s]:
            local_stack = self._local_stack(s)
            form = torch_variant(local_stack, leaves)
            own = evaluate_stack(local_stack, leaves, form=form)  # (T_own, TH, TW*K)
        else:  # nothing owned here: no rows, but tied to the leaves as the owners' tiles are
            own = _no_tiles(leaves, shape[1:])
        if own.requires_grad:
            own.register_hook(lambda grad: grad / self.world)  # mean over data-parallel ranks
        padded = torch.cat([own, own.new_zeros((shape[0] - own.shape[0], *shape[1:]))])
        return _all_gather(padded, 0, self.group)

    def _count(self, nbytes: int) -> None:
        self.comm_bytes += nbytes

    def gather(self, local: GParams) -> GParams:
        """Full `gparams` on every rank, from every rank's part (e.g. to save a checkpoint)."""
        stacks = {}
        for s, stack in enumerate(self.plan.stacks):
            per_rank = [self.ownership.gnets(s, r) for r in range(self.world)]
            per_rank_tiles = [self.ownership.tiles(self.plan, s, r) for r in range(self.world)]
            stacks[stack.key] = {
                name: self._gather_rows(v, per_rank_tiles if name in TILE_LEAVES else per_rank)
                for name, v in local["stacks"][stack.key].items()
            }
        return _with_rest(stacks, local)

    def _gather_rows(self, mine: Tensor, per_rank: list[list[int]]) -> Tensor:
        rows = max(len(r) for r in per_rank)
        padded = torch.cat([mine.detach(), mine.new_zeros((rows - mine.shape[0], *mine.shape[1:]))])
        out = padded.new_empty((self.world * rows, *mine.shape[1:]))
        wait_or_raise(
            _all_gather_into(out, padded, group=self.group, async_op=True),
            "the g-net all-gather",
        )
        order = [r * rows + i for r, idx in enumerate(per_rank) for i in range(len(idx))]
        full = torch.empty_like(out[: len(order)])
        full[torch.tensor([i for idx in per_rank for i in idx], device=out.device)] = out[
            torch.tensor(order, device=out.device)
        ]
        return full.requires_grad_(mine.requires_grad)


def _no_tiles(leaves: dict[str, Tensor], tile_shape: tuple[int, ...]) -> Tensor:
    """Zero tiles `(0, *tile_shape)` for a rank that owns no g-net of a stack, tied to its
    (empty) leaves so that it joins the backward collectives exactly where an owner does:
    the tiles' reduce-scatter wherever the leaves need gradients (not where the g-nets are
    frozen), and the condition's all-reduce, which reaches a conditioned stack's `b_in`."""
    none = leaves["w_in"].new_zeros((0, *tile_shape))
    tied = [v.sum() for v in leaves.values() if v.requires_grad]
    return none + sum(tied) if tied and torch.is_grad_enabled() else none


def _with_rest(stacks: dict[str, dict[str, Tensor]], gparams: GParams) -> GParams:
    """`gparams` with `stacks` in place of its own: the replicated groups are shared."""
    return {**gparams, "stacks": stacks}


class _EveryStack(torch.autograd.Function):
    """The identity on every stack's gathered tiles, whose backward gives each a gradient
    (zeros where the loss left it out): so every rank runs every stack's reduce-scatter, in
    one order, also where its own loss used some stacks only (a per-rank head, routing);
    otherwise the ranks' reduce-scatters paired up across stacks, or hung."""

    @staticmethod
    def forward(ctx: Any, *tiles: Tensor) -> tuple[Tensor, ...]:
        return tuple(t.view_as(t) for t in tiles)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, ...]:
        return grads  # materialised: zeros for the outputs no loss reached


def _check_same_condition(z: Tensor, group: dist.ProcessGroup) -> None:
    """Raise on every rank unless `z`, the condition `apply` generates for, is the same on
    every rank of `group`: each g-net's tiles serve them all, so different tasks per rank
    would mix tiles of several tasks in every weight."""
    values = z.detach().reshape(-1).to(torch.float64)
    if not same_on_every_rank(values, "the condition check", group):
        raise ValueError(
            "gb.dist.RankOwned.apply: the ranks passed different conditions (or tasks); each "
            "g-net generates its tiles for every rank, so every rank must generate for the "
            "same one. For a task per rank, use replicated g-nets (gb.apply with GradSync)."
        )


class _SumGradient(torch.autograd.Function):
    """The identity, whose backward sums the gradient over `group`'s ranks."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        wait_or_raise(
            dist.all_reduce(grad, group=ctx.group, async_op=True), "the condition's all-reduce"
        )
        return grad, None


def _summed_gradient(z: Tensor, group: dist.ProcessGroup) -> Tensor:
    """`z`, whose gradient is summed over `group` (a no-op where nothing needs it)."""
    return _SumGradient.apply(z, group) if z.requires_grad else z
