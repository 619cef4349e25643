"""Bytes each strategy communicates per training step, computed from the plan alone.

`payload` counts the tensors handed to collectives (the all-reduced buffer, the gathered
output, the reduce-scattered input). `per_rank` converts that to what one rank receives under
bandwidth-optimal ring algorithms: `2 (W-1)/W` of an all-reduce, `(W-1)/W` of an all-gather,
a reduce-scatter or a set of broadcasts from every rank.
"""

import math
from collections import Counter
from dataclasses import dataclass

from .._plan import Plan
from ._owned import assign
from ._sync import BUCKET_BYTES

_RING = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "broadcast": 1.0}


@dataclass(frozen=True)
class Traffic:
    """Collectives of one training step.

    Attributes:
        strategy: Name of the strategy.
        world_size: Ranks it was computed for.
        collectives: `(kind, payload bytes)` per collective kind.
        calls: About how many collective calls a step makes (gradient all-reduces counted in
            25 MiB buckets); many small calls are latency-bound.
    """

    strategy: str
    world_size: int
    collectives: tuple[tuple[str, int], ...]
    calls: int

    @property
    def payload(self) -> int:
        return sum(n for _, n in self.collectives)

    @property
    def per_rank(self) -> float:
        w = self.world_size
        return sum(_RING[kind] * (w - 1) / w * n for kind, n in self.collectives)


def _free_numel(plan: Plan) -> int:
    return sum(p.numel for p in plan.free if p.trainable)


def _buckets(nbytes: int) -> int:
    return -(-nbytes // BUCKET_BYTES)


def replicated_traffic(plan: Plan, world_size: int, itemsize: int = 4) -> Traffic:
    """Replicated g-nets: one all-reduce of every g-net and free-parameter gradient."""
    numel = sum(s.num_params for s in plan.stacks) + _free_numel(plan)
    nbytes = numel * itemsize
    return Traffic(
        "replicated g-nets", world_size, (("all_reduce", nbytes),), calls=_buckets(nbytes)
    )


def rank_owned_traffic(plan: Plan, world_size: int, itemsize: int = 4) -> Traffic:
    """Rank-owned g-nets: all-gather generated tiles (padded to the busiest rank), reduce-scatter
    their gradients, all-reduce the free parameters' gradients."""
    ownership = assign(plan, world_size)
    tiles = 0
    for s, stack in enumerate(plan.stacks):
        per_rank = Counter(
            ownership.owners[s][g] for g in stack.gnet_of_tile
        )
        tiles += (
            world_size
            * max(per_rank.values())
            * stack.tile[0]
            * stack.tile[1]
            * math.prod(stack.kernel)
        )
    gathered, free = tiles * itemsize, _free_numel(plan) * itemsize
    collectives = (("all_gather", gathered), ("reduce_scatter", gathered), ("all_reduce", free))
    return Traffic(
        "rank-owned g-nets", world_size, collectives, calls=2 * len(plan.stacks) + _buckets(free)
    )


def torchgb_traffic(plan: Plan, world_size: int, itemsize: int = 4) -> Traffic:
    """torchGB: one broadcast per generated tensor from its owner, then DDP all-reduces every
    p-net gradient (generated and free)."""
    generated = sum(p.numel for p in plan.generated) * itemsize
    reduced = generated + _free_numel(plan) * itemsize
    collectives = (("broadcast", generated), ("all_reduce", reduced))
    return Traffic(
        "torchGB", world_size, collectives, calls=len(plan.generated) + _buckets(reduced)
    )
