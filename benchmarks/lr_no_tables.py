"""Whether ReLU g-nets without tables want a rate other than the default, per p-net.

Issue 54's image miss (transfer's `digits-rows`: the digits MLP's ReLU row g-nets without
hashed tables, best at 2-3x the default) asks for a rule that `gb.optim` could take: the
g-nets of a stack without a table at twice the default, say. A rule by genome holds only if
the same kind of genome wants the same factor on every p-net, so this trains three p-nets
with ReLU genomes without tables on transfer's protocol (its data, steps, warm-up over a
quarter of them, free tensors at the main job's dense rate) at the default rates and at
multiples of them, and prints each factor's mean and its gap to the default, paired by seed:

- the digits MLP 64-800-10 with transfer's `digits-rows` genome (32x32 tiles, 8 outputs);
- the digits CNN with `equal_params`' tiled genome (64x64 tiles, 8 hidden units, 8 outputs);
- the main job's character transformer with `equal_params`' tiled genome at ~20x (64x64
  tiles, 8 hidden units, 8 outputs, embeddings and head generated), on the main corpus.

    python -m benchmarks.lr_no_tables                  # about 20 minutes on 2 cores
    python -m benchmarks.lr_no_tables --pnets mlp cnn  # the image models: about 2 minutes

Writes `results/lr_no_tables.md`.
"""

import argparse
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from benchmarks import equal_params as ep, transfer
from benchmarks._meta import RESULTS, recorded
from examples.seeds import Stat, paired_gap
from examples.tasks import CharLMConfig, DigitsConfig


class PNet(NamedTuple):
    """A p-net and its genome as this benchmark trains them."""

    label: str  # as the report names it
    task: str  # equal_params' task
    genome: dict
    free_lr: float  # the free tensors' rate: the main job's dense rate
    factors: tuple[float, ...]  # multiples of the default rates; 1.0 is the default
    seeds: int


# equal_params' "~20x" tiled genome of the transformer (no tables), its second.
CHARLM_TILED = ep.TASKS["charlm"].genomes[1][2]
_, MLP_TASK, ROWS_GENOME, MLP_FREE_LR = transfer.TASKS["digits-rows"]  # transfer's, as it runs
PNETS = {
    "mlp": PNet(
        "digits MLP, row g-nets (digits-rows)",
        MLP_TASK,
        ROWS_GENOME,
        MLP_FREE_LR,
        (1.0, 2.0, 3.0),
        10,
    ),
    "cnn": PNet(
        "digits CNN, tiled genome",
        "cnn",
        ep.TILED_CNN,
        DigitsConfig().lr_dense,
        (1.0, 2.0, 3.0),
        10,
    ),
    "charlm": PNet(
        "character transformer, tiled genome",
        "charlm",
        CHARLM_TILED,
        CharLMConfig().lr_dense,
        (1.0, 2.0),
        6,
    ),
}


def run(pnet: str, factor: float, seed: int) -> float:
    """The validation score of `PNETS[pnet]` (accuracy in %, or loss in nats for text) with
    every g-net leaf at `factor` times its default rate."""
    torch.set_num_threads(1)
    spec = PNETS[pnet]
    task = ep.TASKS[spec.task]
    loss, accuracy, _ = transfer.train_gbfunc(
        task, spec.genome, seed, task.data(), spec.free_lr, lambda *_: factor
    )
    return loss if task.metric == "val_loss" else 100 * accuracy


def report(scores: dict[tuple[str, float], dict[int, float]]) -> None:
    """Per p-net (`PNETS`' key) and factor: the mean, its standard error and seed spread, and
    the gap to the default paired by seed (labelled by `examples.seeds`' paired t-test at 5%)."""
    print("| p-net | factor | mean | s.e. | spread | factor - default, paired |")
    print("|---|---:|---:|---:|---:|---|")
    for pnet, spec in PNETS.items():
        unit = "nats" if ep.TASKS[spec.task].metric == "val_loss" else "%"
        default = scores.get((pnet, 1.0), {})
        for factor in sorted(f for p, f in scores if p == pnet):
            by_seed = scores[pnet, factor]
            stat = Stat.of([by_seed[s] for s in sorted(by_seed)])
            gap = "-"
            if factor != 1.0 and default:
                seeds = sorted(set(by_seed) & set(default))
                diff = paired_gap([by_seed[s] for s in seeds], [default[s] for s in seeds])
                gap = f"{diff.mean:+.3f} +- {diff.se:.3f} {unit} ({diff.label})"
            print(
                f"| {spec.label} | {factor:g}x | {stat.mean:.3f} {unit} "
                f"| {stat.se:.3f} | {stat.spread:.3f} | {gap} |"
            )
    print("\naccuracy: higher is better (360 validation images, 0.28 points each); nats: lower")


def main() -> None:
    """Train every job (text first: the longest), two processes, and write the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pnets", nargs="+", choices=tuple(PNETS), default=tuple(PNETS))
    parser.add_argument("--seeds", type=int, help="default: each p-net's own (10 or 6)")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "lr_no_tables.md")
    args = parser.parse_args()
    slow_first = sorted(args.pnets, key=lambda pnet: pnet != "charlm")
    jobs = [
        (pnet, factor, seed)
        for pnet in slow_first
        for factor in PNETS[pnet].factors
        for seed in range(args.seeds or PNETS[pnet].seeds)
    ]
    with ProcessPoolExecutor(args.processes) as pool:
        results = list(pool.map(run, *zip(*jobs, strict=True)))
    scores: dict[tuple[str, float], dict[int, float]] = {}
    for (pnet, factor, seed), score in zip(jobs, results, strict=True):
        scores.setdefault((pnet, factor), {})[seed] = score
    with recorded(args.out, "ReLU g-nets without tables: the rate each p-net wants (issue 54)"):
        report(scores)


if __name__ == "__main__":
    main()
