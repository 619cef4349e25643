"""Bytes communicated per training step: replicated g-nets, rank-owned g-nets and torchGB.

The estimators (`replicated_traffic`, `rank_owned_traffic`, `torchgb_traffic`) compute the
collectives of one step from the plan alone. `payload` counts the tensors handed to
collectives (the all-reduced buffer, the gathered output, the reduce-scattered input);
`per_rank` converts that to what one rank receives under bandwidth-optimal ring algorithms:
`2 (W-1)/W` of an all-reduce, `(W-1)/W` of an all-gather, a reduce-scatter or a set of
broadcasts from every rank. The tests check them against the bytes measured on gloo.

Computed for the demo GPT and for GPT-2-small-shaped
plans built on the meta device; for the demo GPT also measured, by running one step of each
strategy as rank 0 of a fake process group and counting what is handed to collectives.

    python -m benchmarks.bench_comm [--world 8]
"""

import argparse
import inspect
import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.func import functional_call
from torch.testing._internal.distributed.fake_pg import FakeStore

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, loss_fn

DEMO = GPTConfig(vocab=64, dim=64, layers=2, heads=4, seq=32)
GPT2_SMALL = GPTConfig(vocab=50304, dim=768, layers=12, heads=12, seq=1024)
MIB = 2**20
BUCKET_BYTES = inspect.signature(gbd.GradSync).parameters["bucket_bytes"].default

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


def _free_numel(plan: gb.Plan) -> int:
    return sum(p.numel for p in plan.free if p.trainable)


def _buckets(nbytes: int) -> int:
    return -(-nbytes // BUCKET_BYTES)


def replicated_traffic(plan: gb.Plan, world_size: int, itemsize: int = 4) -> Traffic:
    """Replicated g-nets: one all-reduce of every g-net and free-parameter gradient."""
    numel = sum(s.num_params for s in plan.stacks) + _free_numel(plan)
    nbytes = numel * itemsize
    return Traffic(
        "replicated g-nets", world_size, (("all_reduce", nbytes),), calls=_buckets(nbytes)
    )


def rank_owned_traffic(plan: gb.Plan, world_size: int, itemsize: int = 4) -> Traffic:
    """Rank-owned g-nets: all-gather generated tiles (padded to the busiest rank), reduce-scatter
    their gradients, all-reduce the free parameters' gradients."""
    ownership = gbd.assign(plan, world_size)
    tiles = 0
    for s, stack in enumerate(plan.stacks):
        per_rank = Counter(ownership.owners[s][g] for g in stack.gnet_of_tile)
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


def torchgb_traffic(plan: gb.Plan, world_size: int, itemsize: int = 4) -> Traffic:
    """torchGB: one broadcast per generated tensor from its owner, then DDP all-reduces every
    p-net gradient (generated and free)."""
    generated = sum(p.numel for p in plan.generated) * itemsize
    reduced = generated + _free_numel(plan) * itemsize
    collectives = (("broadcast", generated), ("all_reduce", reduced))
    return Traffic(
        "torchGB", world_size, collectives, calls=len(plan.generated) + _buckets(reduced)
    )


def measured(model: GPT, plan: gb.Plan, world: int) -> dict[str, int]:
    """Payload bytes one step of each strategy hands to collectives, as rank 0 of `world`."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        x = torch.randint(0, DEMO.vocab, (2, DEMO.seq))
        gparams = gb.init(plan, seed=0)
        sync = gbd.GradSync(gbd.trainable_leaves(gparams))
        loss_fn(functional_call(model, gb.apply(gparams, plan), (x,)), x).backward()
        sync.wait()
        owned = gbd.RankOwned(plan)
        local = owned.shard(gb.init(plan, seed=0))
        free_sync = gbd.GradSync(list(local["free"].values()))
        loss_fn(functional_call(model, owned.apply(local), (x,)), x).backward()
        free_sync.wait()
        return {
            "replicated g-nets": sync.comm_bytes,
            "rank-owned g-nets": owned.comm_bytes + free_sync.comm_bytes,
        }
    finally:
        dist.destroy_process_group()


def rows(name: str, plan: gb.Plan, world: int, model: GPT | None) -> list[tuple[str, ...]]:
    traffic = [f(plan, world) for f in (replicated_traffic, rank_owned_traffic, torchgb_traffic)]
    measures = measured(model, plan, world) if model is not None else {}
    base = traffic[0].per_rank
    return [
        (
            name,
            str(world),
            t.strategy,
            f"{t.payload / MIB:.3f}",
            f"{measures[t.strategy] / MIB:.3f}" if t.strategy in measures else "-",
            f"{t.per_rank / MIB:.3f}",
            str(t.calls),
            f"{t.per_rank / base:.1f}x",
        )
        for t in traffic
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 8])
    args = parser.parse_args()
    with torch.device("meta"):
        demo, gpt2 = GPT(DEMO), GPT(GPT2_SMALL)
    demo_plan = gb.plan(demo, tile=(32, 32))
    plans = [
        ("demo GPT 32x32 tiles", demo_plan, demo),
        ("GPT-2 small 100x100, wte free", gb.plan(gpt2, tile=(100, 100)), None),
        (
            "GPT-2 small 100x100, wte generated",
            gb.plan(gpt2, tile=(100, 100), embeddings=True),
            None,
        ),
    ]
    table = [
        (
            "plan",
            "W",
            "strategy",
            "payload MiB",
            "measured MiB",
            "per rank MiB",
            "calls",
            "vs replicated",
        )
    ]
    for name, plan, model in plans:
        report = gb.report(plan)
        print(
            f"{name}: {report.dense_params:,} p-net params, {report.gnet_params:,} g-net params, "
            f"{report.free_params:,} free, {sum(s.num_tiles for s in plan.stacks):,} tiles"
        )
        for world in args.world:
            table += rows(name, plan, world, model)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    print()
    for i, row in enumerate(table):
        print(
            "  ".join(
                c.ljust(w) if j < 3 else c.rjust(w)
                for j, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if i == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
