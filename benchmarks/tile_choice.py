"""What `gb.plan(compression=...)`'s tile choice buys: the squarest tile against the one it picks.

Among the tiles within 2% of the target ratio, `gb.plan` takes the squarest unless one about
as square has its g-nets evaluate at least 5% fewer vectors (`gbfunc._search.vector_work`: on
CPU no partial vector at the end of a tile row, and less overhang past a weight's edge). This
runs both choices side by side, the squarest forced by setting `WORK_GAIN` to 0. That is the
squarest among today's candidates, which include multiples of 16 since the change: for the
plans here, the tile the search picked before it; elsewhere it can differ by a row or a
column (the MLP at `compression=12`: 86x80, where it picked 86x79).

- speed: `benchmarks/bench_step.py`'s training step, eager and compiled, in interleaved
  rounds, as ratios to the plain model in the same rounds;
- quality: `benchmarks/equal_params.py`'s protocol (its tasks, steps, batches and seeds) on
  the digits MLP and the character transformer, both choices at the same learning rates,
  each scored at its best mean over the seeds.

    python -m benchmarks.tile_choice            # ~12 minutes on 2 cores
    python -m benchmarks.tile_choice --quick    # speed only, fewer rounds
    python -m benchmarks.tile_choice --baselines   # a narrower model and low rank, ~7 minutes

Writes what it prints to `benchmarks/results/tile_choice.md` (`--baselines`:
`tile_choice_baselines.md`).
"""

import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

import gbfunc as gb
from benchmarks import equal_params
from benchmarks._meta import RESULTS, benchmark_parser, recorded
from benchmarks.bench_step import (
    Timing,
    cross_entropy,
    dense_steps,
    gb_steps,
    round_ms,
    workloads,
)
from gbfunc import _search

CHOICES = ("squarest", "searched")
# (workload title prefix, gb.plan options): the step's models are bench_step's.
SPEED = (
    ("MLP", {"compression": 10}),
    ("MLP", {"compression": 10, "hidden": 8}),
    ("MLP", {"compression": 20}),
    ("main job's character transformer", {"compression": 20, "hidden": 8}),
)
# Rates of the baselines on the transformer, one each as the gbfunc arms have one: the best of
# their sweeps in `benchmarks/equal_params.py` (narrow at ~20x; low rank in the main job).
# None: the task's own sweep.
BASELINE_LRS: dict[str, dict[str, tuple[float, ...]] | None] = {
    "mlp": None,
    "charlm": {"narrow": (0.06,), "low rank": (0.01,)},
}
# (equal_params task, gb.plan options, learning rates, seeds). 9 seeds on the MLP: seeds 0-2
# alone gave the squarest tile a 1.8-point lead (0.9231 against 0.9056 at the best rate),
# seeds 3-8 alone 0.9088 against 0.9097.
QUALITY = (
    ("mlp", {"compression": 20}, (0.01, 0.03, 0.1), 9),
    ("charlm", {"compression": 20, "hidden": 8}, (0.02,), 2),
)


@contextlib.contextmanager
def squarest_tiles() -> Iterator[None]:
    """`gb.plan(compression=...)` choosing the squarest tile within 2% of the target, as it
    did before it counted vectors."""
    saved = _search.WORK_GAIN
    _search.WORK_GAIN = 0.0
    try:
        yield
    finally:
        _search.WORK_GAIN = saved


def choosing(choice: str) -> contextlib.AbstractContextManager:
    """Plans made inside pick their tiles by `choice` (one of `CHOICES`)."""
    return squarest_tiles() if choice == "squarest" else contextlib.nullcontext()


def planned(model: nn.Module, choice: str, options: dict) -> gb.Plan:
    """`gb.plan(model, **options)` under the tile choice `choice`."""
    with choosing(choice):
        return gb.plan(model, compression_of="generated", **options)  # the ratio it was tuned on


def tiles(plan: gb.Plan) -> str:
    """The plan's distinct tiles, e.g. `57x96, 10x96`."""
    return ", ".join(f"{h}x{w}" for h, w in sorted({s.tile for s in plan.stacks}, reverse=True))


def speed(rounds: int, inner: int) -> None:
    models = {title: (model, batch) for title, model, batch, _ in workloads()}
    print(f"\n## Step time (x the plain step in the same rounds; {rounds} x {inner} steps)")
    print("model | options | tiles: squarest -> searched | eager | compiled")
    for prefix, options in SPEED:
        title = next(t for t in models if t.startswith(prefix))
        model, batch = models[title]
        steps, shown = {}, []
        steps["plain eager"], steps["plain compiled"] = dense_steps(model, batch, cross_entropy)
        for choice in CHOICES:
            plan = planned(model, choice, options)
            shown.append(tiles(plan))
            steps[f"{choice} eager"], steps[f"{choice} compiled"] = gb_steps(
                model, plan, batch, cross_entropy
            )
        samples, _ = round_ms(steps, rounds, inner)
        cells = []
        for mode in ("eager", "compiled"):
            ratio = [Timing.of(samples[f"{c} {mode}"], samples[f"plain {mode}"]) for c in CHOICES]
            cells.append(f"{ratio[0].ratio:.2f}x -> {ratio[1].ratio:.2f}x")
        print(
            f"{title.split(' (')[0]} | {options} | {shown[0]} -> {shown[1]} | " + " | ".join(cells)
        )


def quality() -> None:
    print("\n## Quality (equal_params' protocol; the best learning rate's mean ± sd over seeds)")
    print("task | options | choice | tiles | trainable params | lr | score")
    for name, options, lrs, seeds in QUALITY:
        task = equal_params.TASKS[name]
        data = task.data()
        for choice in CHOICES:
            scores: dict[float, list[float]] = {lr: [] for lr in lrs}
            for seed in range(seeds):
                for lr in lrs:
                    with choosing(choice):
                        arm, plan = equal_params.gbfunc_arm(task, choice, options, seed, data)
                    scores[lr].append(_score(task, arm, lr, data, seed))
            print(f"{task.name} | {options} | {choice} | {tiles(plan)} | {arm.params:,} | ", end="")
            print(_best(task, scores))


def baselines() -> None:
    """A narrower model and low rank at the searched plan's trainable parameters, under the
    same protocol and seeds (`equal_params.arms_at`), each at its best rate of `BASELINE_LRS`
    (the task's own sweep where that is None)."""
    print("\n## Baselines at the searched plan's trainable parameters (same protocol and seeds)")
    print("task | family | arm | trainable params | lr | score")
    for name, options, _, seeds in QUALITY:
        task = equal_params.TASKS[name]
        data = task.data()
        for family in ("narrow", "low rank"):
            lrs = (BASELINE_LRS.get(name) or task.lrs)[family]
            scores: dict[float, list[float]] = {lr: [] for lr in lrs}
            for seed in range(seeds):
                for lr in lrs:  # a fresh arm per run: training updates its tree in place
                    arms = equal_params.arms_at(task, "searched", options, seed, data)
                    arm = next(a for a in arms if a.family == family)
                    scores[lr].append(_score(task, arm, lr, data, seed))
            print(f"{task.name} | {family} | {arm.label} | {arm.params:,} | {_best(task, scores)}")


def _score(task: equal_params.Task, arm: equal_params.Arm, lr: float, data, seed: int) -> float:
    """The arm's validation score after the task's protocol at rate `lr`."""
    loss, acc = equal_params.train(arm, lr, data, task.steps, task.batch, seed)
    return acc if task.metric == "val_acc" else loss


def _best(task: equal_params.Task, scores: dict[float, list[float]]) -> str:
    """`lr of (lrs) | score mean ± sd (runs)` at the rate with the best mean over seeds."""
    lrs = tuple(scores)
    means = {lr: statistics.mean(runs) for lr, runs in scores.items()}
    best = lrs[0]
    for lr in lrs[1:]:
        best = lr if task.better(means[lr], means[best]) else best
    runs = scores[best]
    spread = statistics.stdev(runs) if len(runs) > 1 else 0.0
    unit = "accuracy" if task.metric == "val_acc" else "val loss (nats)"
    return (
        f"{best} of {lrs} | {unit} {means[best]:.4f} ± {spread:.4f} "
        f"({', '.join(f'{r:.4f}' for r in runs)})"
    )


def main() -> None:
    parser = benchmark_parser(
        __doc__,
        quick="speed only, fewer rounds",
        baselines="only a narrower model and low rank at the searched plans' parameter counts",
    )
    parser.add_argument("--out", type=Path, help="default: results/tile_choice[_baselines].md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.baselines:
        out = args.out or RESULTS / "tile_choice_baselines.md"
        with recorded(out, "compression='s tile choice: the baselines at its parameter counts"):
            baselines()
        return
    with recorded(
        args.out or RESULTS / "tile_choice.md",
        "compression='s tile choice against the squarest tile",
    ):
        speed(*((5, 5) if args.quick else (15, 10)))
        if not args.quick:
            quality()


if __name__ == "__main__":
    main()
