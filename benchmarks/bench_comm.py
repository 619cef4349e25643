"""Bytes communicated per training step: replicated g-nets, rank-owned g-nets and torchGB.

The estimators (`replicated_traffic`, `rank_owned_traffic`, `torchgb_traffic`) compute the
collectives of one step from the plan alone. `payload` counts the tensors handed to
collectives (the all-reduced buffer, the gathered output, the reduce-scattered input);
`per_rank` converts that to what one rank receives under bandwidth-optimal ring algorithms:
`2 (W-1)/W` of an all-reduce, `(W-1)/W` of an all-gather, a reduce-scatter or a set of
broadcasts from every rank. The tests check them against the bytes measured on gloo.

Computed for the demo GPT and for GPT-2-small-shaped plans built on the meta device; for the
demo GPT also measured, by running one step of each strategy as rank 0 of a fake process
group and counting what is handed to collectives.

With `--scale`, the cost model at scale (`Sizes`, `per_rank_bytes`, `generation_share`):
GPT-2 1.5B and Llama-shaped 7B and 70B models, DP x TP x PP meshes up to 1024 ranks, each
gbfunc strategy against dense DDP and FSDP; writes `results/bench_comm_scale.{md,png}`.

    python -m benchmarks.bench_comm [--world 8]   # writes results/bench_comm.md
    python -m benchmarks.bench_comm --scale
    python -m benchmarks.bench_comm --scale --plot   # only the plot, the .md left as it is
"""

import argparse
import inspect
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call
from torch.testing._internal.distributed.fake_pg import FakeStore

import gbfunc as gb
import gbfunc.dist as gbd
from benchmarks._meta import (
    FIGURE_WIDTH,
    RESULTS,
    generation_flops,
    header_md,
    markdown_table,
    provenance_line,
    recorded,
    save_figure,
    stamp,
    write_results,
)
from examples.gpt import GPT, GPTConfig, loss_fn

DEMO = GPTConfig(vocab=64, dim=64, layers=2, heads=4, seq=32)
GPT2_SMALL = GPTConfig(vocab=50304, dim=768, layers=12, heads=12, seq=1024)
MIB = 2**20
BUCKET_BYTES = inspect.signature(gbd.GradSync).parameters["bucket_bytes"].default


def _ring(kind: str, n: int) -> float:
    """Bytes one rank receives per payload byte of a collective over `n` ranks (ring)."""
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n


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
        return sum(_ring(kind, self.world_size) * n for kind, n in self.collectives)


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
            * math.prod(stack.window)
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


# ---------------------------------------------------------------- the cost model at scale


class Mesh(gbd.MeshShape):
    """Data-, tensor- and pipeline-parallel degrees (`gbd.MeshShape`), and what the cost model
    reads of them."""

    @property
    def shards(self) -> int:
        """Ranks one data-parallel replica is split over (TP and PP)."""
        return self.tp * self.pp


@dataclass(frozen=True)
class Sizes:
    """What the cost model needs of a plan: parameter counts and generation FLOPs."""

    params: int  # the dense model's
    generated: int  # weights the g-nets generate
    gnet: int  # g-net parameters (with tables and tile embeddings)
    free: int  # trainable parameters left free
    generation_flops: float  # one forward generation of every weight

    @classmethod
    def of(cls, plan: gb.Plan) -> "Sizes":
        report = gb.report(plan)
        return cls(
            report.dense_params,
            report.generated_weights,
            report.gnet_params,
            report.free_params,
            generation_flops(plan),
        )


STRATEGIES = ("dense DDP", "dense FSDP", "replicated g-nets", "rank-owned g-nets", "torchGB")


def per_rank_bytes(strategy: str, sizes: Sizes, mesh: Mesh, itemsize: int = 4) -> float:
    """Bytes one rank receives per training step for parameters and their gradients.

    TP and PP split every weight and free parameter evenly over `mesh.shards` ranks; their
    activation traffic is the same for every strategy, so it is not counted. The collectives:

    - dense DDP: an all-reduce of the shard's gradients over dp;
    - dense FSDP (ZeRO-3 over dp): two all-gathers of the shard (forward, backward) and a
      reduce-scatter of its gradients;
    - replicated g-nets: every rank generates its shard, so g-net gradients are summed over
      all ranks (an all-reduce over the world); free gradients all-reduced over dp;
    - rank-owned g-nets: the dp ranks of a shard own its g-nets, all-gather the generated
      weights and reduce-scatter their gradients; free gradients all-reduced over dp;
    - torchGB: each generated tensor broadcast from its owner, then DDP's all-reduce of every
      p-net gradient of the shard over dp.
    With `mesh.shards == 1` these are `replicated_traffic(...).per_rank` and the others of
    this file, whose payloads the tests check against bytes measured on gloo.
    """
    dp, world, k = mesh.dp, mesh.world_size, mesh.shards
    shard, generated, free = sizes.params / k, sizes.generated / k, sizes.free / k
    if strategy == "dense DDP":
        total = _ring("all_reduce", dp) * shard
    elif strategy == "dense FSDP":
        total = 3 * _ring("all_gather", dp) * shard
    elif strategy == "replicated g-nets":
        total = _ring("all_reduce", world) * sizes.gnet + _ring("all_reduce", dp) * free
    elif strategy == "rank-owned g-nets":
        total = 2 * _ring("all_gather", dp) * generated + _ring("all_reduce", dp) * free
    elif strategy == "torchGB":
        total = _ring("broadcast", dp) * generated + _ring("all_reduce", dp) * shard
    else:
        raise ValueError(f"per_rank_bytes: strategy must be one of {STRATEGIES}, got {strategy!r}")
    return total * itemsize


def generation_share(strategy: str, sizes: Sizes, mesh: Mesh, tokens_per_rank: int) -> float:
    """Generation FLOPs of one rank per step over its model FLOPs (6 * params * tokens).

    Generation forward and its recomputing backward cost about 3x the forward. A replicated
    rank generates its whole shard; a rank-owned or torchGB rank only its own g-nets' part.
    """
    if strategy.startswith("dense"):
        return 0.0
    owners = mesh.shards if strategy == "replicated g-nets" else mesh.world_size
    generation = 3 * sizes.generation_flops / owners
    model = 6 * sizes.params / mesh.shards * tokens_per_rank
    return generation / model


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)


class _LlamaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        kv = dim // heads * kv_heads
        self.q, self.o = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.k, self.v = nn.Linear(dim, kv, bias=False), nn.Linear(dim, kv, bias=False)
        self.mlp = _SwiGLU(dim, ffn)
        self.norm1, self.norm2 = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))


def llama_shaped(dim: int, layers: int, heads: int, kv_heads: int, ffn: int) -> nn.Module:
    """The parameters of a Llama-2-shaped model (no forward: the cost model reads shapes)."""
    model = nn.Module()
    model.embed = nn.Embedding(32000, dim)
    model.blocks = nn.ModuleList(_LlamaBlock(dim, heads, kv_heads, ffn) for _ in range(layers))
    model.norm = nn.Parameter(torch.ones(dim))
    model.head = nn.Linear(dim, 32000, bias=False)
    return model


SCALE_MODELS = {
    "GPT-2 1.5B": lambda: GPT(GPTConfig(vocab=50304, dim=1600, layers=48, heads=25, seq=1024)),
    "Llama 7B": lambda: llama_shaped(4096, 32, 32, 32, 11008),
    "Llama 70B": lambda: llama_shaped(8192, 80, 64, 8, 28672),
}
# The genome of the cost model: (256, 256) tiles, the main job's tiled g-nets, embeddings
# and output layer generated too.
SCALE_PLAN = {"tile": (256, 256), "hidden": 8, "outputs": 8, "embeddings": True}
MESHES = (
    Mesh(8),
    Mesh(64),
    Mesh(1024),
    Mesh(8, tp=8),
    Mesh(32, tp=8, pp=4),
    Mesh(128, tp=8),
    Mesh(16, tp=8, pp=8),
)
TOKENS_PER_RANK = 8 * 2048  # one step's tokens per data-parallel rank: 8 sequences of 2048


def scale_rows(name: str, sizes: Sizes) -> list[list[str]]:
    """Table rows of one model: per mesh, each strategy's MiB per rank and generation share."""
    rows = []
    for mesh in MESHES:
        best = min(STRATEGIES, key=lambda s: per_rank_bytes(s, sizes, mesh))
        for strategy in STRATEGIES:
            mib = per_rank_bytes(strategy, sizes, mesh) / MIB
            share = generation_share(strategy, sizes, mesh, TOKENS_PER_RANK)
            rows.append(
                [
                    name,
                    f"{mesh.dp}x{mesh.tp}x{mesh.pp} ({mesh.world_size})",
                    strategy + (" (fewest bytes)" if strategy == best else ""),
                    f"{mib:,.0f}",
                    f"{100 * share:.2f}%" if share else "-",
                ]
            )
    return rows


def crossovers(sized: dict[str, Sizes]) -> str:
    """Per model: the model-parallel degree from which dense DDP sends fewer bytes than
    replicated g-nets (whose gradients are summed over every rank, the model's only over dp)."""
    lines = []
    for name, sizes in sized.items():
        shards = next(
            (
                k
                for k in (2**i for i in range(15))
                if per_rank_bytes("dense DDP", sizes, Mesh(8, tp=k))
                < per_rank_bytes("replicated g-nets", sizes, Mesh(8, tp=k))
            ),
            None,
        )
        where = f"from {shards} TP x PP shards per replica on" if shards else "never (up to 16384)"
        ratio = sizes.generated / sizes.gnet
        share = max(
            generation_share("replicated g-nets", sizes, m, TOKENS_PER_RANK) for m in MESHES
        )
        lines.append(
            f"- **{name}** ({ratio:.0f}x on the generated weights): replicated g-nets send the "
            f"fewest bytes at every mesh above; dense DDP sends fewer {where} (8-way dp). "
            "Rank-owned g-nets send about as much as dense DDP, and torchGB as much as FSDP; "
            "they would pay only where generation, not bandwidth, limits a step, and a "
            f"replicated rank's generation is at most {100 * share:.2f}% of its model FLOPs."
        )
    return "\n".join(lines)


def scale_plot(sized: dict[str, Sizes], path: Path) -> None:
    """MiB per rank against TP x PP shards per replica (8-way dp), one panel per model in a
    2 x 2 grid, the legend in the fourth cell.

    Dense strategies are wide dashed lines: rank-owned g-nets lie on dense DDP and torchGB
    on FSDP.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = math.ceil((len(sized) + 1) / 2)  # the panels and the legend, two per row
    fig, grid = plt.subplots(
        cells, 2, figsize=(FIGURE_WIDTH, 2.75 * cells + 0.4), sharey=True, layout="constrained"
    )
    axes = list(grid.flat)
    shards = [2**k for k in range(13)]
    for ax, (name, sizes) in zip(axes, sized.items(), strict=False):
        for strategy in STRATEGIES:
            mib = [per_rank_bytes(strategy, sizes, Mesh(8, tp=k)) / MIB for k in shards]
            if strategy.startswith("dense"):  # wide and pale, under the g-net lines on them
                ax.plot(shards, mib, "--", label=strategy, linewidth=5, alpha=0.45)
            else:
                ax.plot(shards, mib, "-", marker="o", label=strategy, markersize=3)
        ax.set(xscale="log", yscale="log", xlabel="TP × PP shards per replica (dp = 8)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.tick_params(labelsize=9, labelleft=True)
    for ax in axes[::2]:
        ax.set_ylabel("MiB received per rank per step")
    for ax in axes[len(sized) :]:
        ax.axis("off")
    axes[len(sized)].legend(
        *axes[0].get_legend_handles_labels(), loc="center left", fontsize=9, frameon=False
    )
    foot = stamp(fig, provenance_line())
    fig.get_layout_engine().set(rect=(0, foot, 1, 1 - foot))  # left, bottom, width, height
    save_figure(fig, path)
    plt.close(fig)


def scale_sizes() -> dict[str, Sizes]:
    """The weights of each model at scale under `SCALE_PLAN`, from plans on the meta device."""
    sized = {}
    for name, build in SCALE_MODELS.items():
        with torch.device("meta"):
            model = build()
        sized[name] = Sizes.of(gb.plan(model, **SCALE_PLAN))
    return sized


def scale_report() -> None:
    sized = scale_sizes()
    sizes_table = markdown_table(
        [("model", "l")] + [(t, "r") for t in ("params", "generated", "g-net", "free")],
        (
            [name, *(f"{n:,}" for n in (s.params, s.generated, s.gnet, s.free))]
            for name, s in sized.items()
        ),
    )
    columns = [("model", "l"), ("mesh dp x tp x pp (ranks)", "l"), ("strategy", "l")]
    columns += [("MiB per rank per step", "r"), ("generation / model FLOPs", "r")]
    rows = [row for name, sizes in sized.items() for row in scale_rows(name, sizes)]
    text = (
        header_md("Bytes per step at scale: gbfunc's strategies against dense DDP and FSDP")
        + f"- plan: `gb.plan(model, **{SCALE_PLAN})`; fp32 gradients and weights\n"
        + f"- generation share: {TOKENS_PER_RANK:,} tokens per data-parallel rank per step\n"
        + "- TP/PP activation traffic is the same for every strategy and is not counted\n\n"
        + sizes_table
        + "\n"
        + markdown_table(columns, rows)
    )
    text += "\n## Where each strategy wins\n\n" + crossovers(sized) + "\n"
    print(text)
    path = RESULTS / "bench_comm_scale.md"
    write_results(path, text)
    scale_plot(sized, path.with_suffix(".png"))


def measured(model: GPT, plan: gb.Plan, world: int) -> dict[str, int]:
    """Payload bytes one step of each strategy hands to collectives, as rank 0 of `world`."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        x = torch.randint(0, DEMO.vocab, (2, DEMO.seq))
        gparams = gb.init(plan, seed=0)
        sync = gbd.GradSync(gb.trainable_leaves(gparams))
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
    parser.add_argument("--scale", action="store_true", help="the cost model at scale")
    parser.add_argument(
        "--plot",
        action="store_true",
        help="with --scale: only redraw its PNG (from the plans, seconds), not its .md",
    )
    args = parser.parse_args()
    if args.scale and args.plot:
        scale_plot(scale_sizes(), RESULTS / "bench_comm_scale.png")
        return
    if args.scale:
        scale_report()
        return
    with recorded(RESULTS / "bench_comm.md", "Bytes per training step, per strategy"):
        step_report(args.world)


def step_report(worlds: list[int]) -> None:
    """Print, per plan and world size, the bytes each strategy hands to collectives in one
    step and what a rank receives: the demo GPT (also measured) and GPT-2 small's shapes."""
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
        for world in worlds:
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
