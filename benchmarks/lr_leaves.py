"""Which leaves of a genome want a rate other than the default: one leaf kind at a time.

Issue 54's one image miss is transfer's `digits-rows` genome (ReLU row g-nets, 32x32 tiles,
8 hidden units, 8 outputs, no tables): the default rates land 0.86 points behind twice
them. This runs that task on transfer's protocol (same data, steps, warm-up and seeds) with
the default rates of `gb.optim.param_groups` and with one leaf kind's rate (or a set of
kinds) multiplied by `--factor`, the others at the default, and prints each variant's mean
over the seeds and its gap to the default, paired by seed. A leaf kind that carries the
whole gain points at the rule to change (a rate per leaf kind), where a global scale would
not say which.

Beside it, `--genome tiles` runs the same MLP with `lr_rule`'s 64x64 genome of 4 outputs
(ReLU, no tables), where the default holds: a rule that closes the miss must not open one
there.

    python -m benchmarks.lr_leaves                      # 10 seeds, about 2 minutes
    python -m benchmarks.lr_leaves --genome tiles       # writes lr_leaves_tiles.md
    python -m benchmarks.lr_leaves --width-rule         # a candidate rule: lr_leaves_width.md
    python -m benchmarks.lr_leaves --family             # FAMILY's genomes: lr_leaves_family.md
    python -m benchmarks.lr_leaves --budgets 1 2 4      # longer training: lr_leaves_budget.md

`--family` asks which feature of a genome the miss follows: the same MLP with ReLU g-nets of
8 hidden units and no tables, one of tile, outputs and hidden units changed at a time from
digits-rows's, every leaf at 1x (the default), 2x and 3x.

`--budgets` asks whether the miss is a short budget's: digits-rows at the default and every
leaf at `--factor`, trained for each multiple of its steps (warm-up a quarter of them, as
every arm). A gap that closes with more steps would make the default slow, not wrong.
"""

import argparse
import dataclasses
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from benchmarks import equal_params as ep, lr_rule, transfer
from benchmarks._meta import RESULTS, recorded

TASK = "digits-rows"
# The genomes on transfer's digits-rows task (its MLP, data and steps): its own, and
# lr_rule's 64x64 genome of 4 outputs without tables, where the default rates hold.
GENOMES = {"rows": ep.ROWS_GENOME, "tiles": lr_rule.WITHOUT_TABLES["mlp"][1]}
# `--family`: digits-rows's genome (32x32 tiles, 8 outputs, 8 hidden units) and neighbours.
FAMILY = {
    "tile 32, 8 outputs (digits-rows)": ep.ROWS_GENOME,
    "tile 16, 8 outputs": {"tile": (16, 16), "hidden": 8, "outputs": 8},
    "tile 64, 8 outputs": {"tile": (64, 64), "hidden": 8, "outputs": 8},
    "tile 32, 8 outputs, 16 hidden": {"tile": (32, 32), "hidden": 16, "outputs": 8},
    "tile 32, 4 outputs": {"tile": (32, 32), "hidden": 8, "outputs": 4},
    "tile 64, 4 outputs (tiles)": GENOMES["tiles"],
    "tile 32, 1 output": {"tile": (32, 32), "hidden": 8, "outputs": 1},
}
FAMILY_FACTORS = (1.0, 2.0, 3.0)
# Variant name -> the leaf kinds whose rate is multiplied; none: the default rates.
VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "every leaf": ("w_in", "b_in", "w_hidden", "b_hidden", "w_out", "b_out"),
    "w_in": ("w_in",),
    "b_in": ("b_in",),
    "first layer (w_in, b_in)": ("w_in", "b_in"),
    "output layer (w_out, b_out)": ("w_out", "b_out"),
}
# `--width-rule`: w_in's rate times REFERENCE_WIDTH over its fan-in, the code's width (a
# pre-activation moves with the fan-in when Adam moves each entry by about the rate); 9 is
# the width of most of the tiled CNN's weights, where the default rates hold.
REFERENCE_WIDTH = 9
WIDTH_RULE = f"w_in x {REFERENCE_WIDTH}/code width"


def run(genome: str, variant: str, factor: float, seed: int, budget: int = 1) -> float:
    """Validation accuracy (%) of `TASK`'s MLP with `GENOMES[genome]` (or `FAMILY[genome]`)
    at seed `seed`, the leaves of `variant` at `factor` times their default rate, trained for
    `budget` times the task's steps."""
    torch.set_num_threads(1)
    _, base, _, free_lr = transfer.TASKS[TASK]
    task = dataclasses.replace(ep.TASKS[base], steps=ep.TASKS[base].steps * budget)

    def times(leaf: str | None, tensor: torch.Tensor | None) -> float:
        if variant == WIDTH_RULE:
            return REFERENCE_WIDTH / tensor.shape[-2] if leaf == "w_in" else 1.0
        return factor if leaf in VARIANTS[variant] else 1.0

    options = GENOMES[genome] if genome in GENOMES else FAMILY[genome]
    _, accuracy, _ = transfer.train_gbfunc(task, options, seed, task.data(), free_lr, times)
    return 100 * accuracy


def report(scores: dict[str, dict[int, float]], factor: float, genome: str = "rows") -> None:
    """Each variant's mean +- s.e. over its seeds, and its gap to the default by seed."""
    default = scores["default"]
    print(f"{TASK}'s MLP, genome {GENOMES[genome]}")
    print(f"leaves at {factor:g}x their default rate, the others at the default")
    print("| leaves scaled | mean (%) | s.e. | gap to the default, paired (points) |")
    print("|---|---:|---:|---:|")
    for variant, by_seed in scores.items():
        values = [by_seed[s] for s in sorted(by_seed)]
        error = statistics.stdev(values) / len(values) ** 0.5
        gap = "-"
        if variant != "default":
            diffs = [by_seed[s] - default[s] for s in sorted(by_seed)]
            spread = statistics.stdev(diffs) / len(diffs) ** 0.5
            gap = f"{statistics.fmean(diffs):+.2f} +- {spread:.2f}"
        print(f"| {variant} | {statistics.fmean(values):.2f} | {error:.2f} | {gap} |")
    print(f"\n{len(default)} seeds; the validation set is 360 images (0.28 points each)")


def report_family(scores: dict[tuple[str, float], dict[int, float]]) -> None:
    """Per genome of `FAMILY`, every leaf at each factor: mean and its gap to 1x by seed."""
    print(f"{TASK}'s MLP, ReLU g-nets without tables; every leaf at 1x, 2x, 3x the default")
    print("| genome | 1x (%) | 2x - 1x (points, paired) | 3x - 1x (points, paired) |")
    print("|---|---:|---:|---:|")
    for genome in FAMILY:
        default = scores[genome, 1.0]
        cells = [f"{statistics.fmean(default.values()):.2f}"]
        for factor in FAMILY_FACTORS[1:]:
            by_seed = scores[genome, factor]
            diffs = [by_seed[s] - default[s] for s in sorted(by_seed)]
            error = statistics.stdev(diffs) / len(diffs) ** 0.5
            cells.append(f"{statistics.fmean(diffs):+.2f} +- {error:.2f}")
        print(f"| {genome} | " + " | ".join(cells) + " |")
    seeds = len(next(iter(scores.values())))
    print(f"\n{seeds} seeds; the validation set is 360 images (0.28 points each)")


def report_budgets(scores: dict[tuple[int, float], dict[int, float]], factor: float) -> None:
    """Per budget, the default's mean and every leaf at `factor` against it, paired by seed."""
    steps = ep.TASKS[transfer.TASKS[TASK][1]].steps
    print(f"{TASK}'s MLP, genome {GENOMES['rows']}; every leaf at 1x and {factor:g}x")
    print(f"| steps | 1x (%) | {factor:g}x (%) | {factor:g}x - 1x (points, paired) |")
    print("|---:|---:|---:|---:|")
    for budget in sorted({b for b, _ in scores}):
        default, scaled = scores[budget, 1.0], scores[budget, factor]
        diffs = [scaled[s] - default[s] for s in sorted(default)]
        error = statistics.stdev(diffs) / len(diffs) ** 0.5
        print(
            f"| {steps * budget} | {statistics.fmean(default.values()):.2f} "
            f"| {statistics.fmean(scaled.values()):.2f} "
            f"| {statistics.fmean(diffs):+.2f} +- {error:.2f} |"
        )
    seeds = len(next(iter(scores.values())))
    print(f"\n{seeds} seeds; the validation set is 360 images (0.28 points each)")


def main_budgets(args: argparse.Namespace) -> None:
    factors = (1.0, args.factor)
    jobs = [
        ("rows", "every leaf", f, s, b)
        for b in args.budgets
        for f in factors
        for s in range(args.seeds)
    ]
    with ProcessPoolExecutor(args.processes) as pool:
        accuracies = list(pool.map(run, *zip(*jobs, strict=True)))
    scores: dict[tuple[int, float], dict[int, float]] = {}
    for (_, _, factor, seed, budget), accuracy in zip(jobs, accuracies, strict=True):
        scores.setdefault((budget, factor), {})[seed] = accuracy
    out = args.out or RESULTS / "lr_leaves_budget.md"
    with recorded(out, "Whether the digits-rows miss closes with longer training (issue 54)"):
        report_budgets(scores, args.factor)


def main_family(args: argparse.Namespace) -> None:
    jobs = [
        (g, "every leaf", f, s) for g in FAMILY for f in FAMILY_FACTORS for s in range(args.seeds)
    ]
    with ProcessPoolExecutor(args.processes) as pool:
        accuracies = list(pool.map(run, *zip(*jobs, strict=True)))
    scores: dict[tuple[str, float], dict[int, float]] = {}
    for (genome, _, factor, seed), accuracy in zip(jobs, accuracies, strict=True):
        scores.setdefault((genome, factor), {})[seed] = accuracy
    out = args.out or RESULTS / "lr_leaves_family.md"
    with recorded(out, "Which genomes want another rate on the digits MLP (issue 54)"):
        report_family(scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--genome", choices=tuple(GENOMES), default="rows")
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument(
        "--width-rule",
        action="store_true",
        help=f"the default, every leaf at --factor, and {WIDTH_RULE!r} (a candidate rule)",
    )
    parser.add_argument("--family", action="store_true", help="FAMILY's genomes, every leaf")
    parser.add_argument(
        "--budgets", type=int, nargs="+", help="multiples of the steps, every leaf at --factor"
    )
    parser.add_argument("--out", type=Path, help="default: results/lr_leaves[_GENOME].md")
    args = parser.parse_args()
    if args.family:
        main_family(args)
        return
    if args.budgets:
        main_budgets(args)
        return
    suffix = ("" if args.genome == "rows" else f"_{args.genome}") + "_width" * args.width_rule
    out = args.out or RESULTS / f"lr_leaves{suffix}.md"
    variants = ["default", "every leaf", WIDTH_RULE] if args.width_rule else list(VARIANTS)
    jobs = [(args.genome, v, args.factor, s) for v in variants for s in range(args.seeds)]
    with ProcessPoolExecutor(args.processes) as pool:
        accuracies = list(pool.map(run, *zip(*jobs, strict=True)))
    scores: dict[str, dict[int, float]] = {}
    for (_, variant, _, seed), accuracy in zip(jobs, accuracies, strict=True):
        scores.setdefault(variant, {})[seed] = accuracy
    with recorded(out, "Which leaves want another rate (issue 54's digits-rows miss)"):
        report(scores, args.factor, args.genome)


if __name__ == "__main__":
    main()
