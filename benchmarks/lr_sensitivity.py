"""How much a g-net learning rate off the best costs: every gbfunc arm of the committed
`equal_params` sweeps, its score at each learning rate tried (mean over seeds) and the loss
against the best.

It trains nothing: it reads the runs `benchmarks/equal_params.py` recorded
(`results/equal_params*.json`), so it takes a second. The table says where one learning rate
serves several genomes and ratios and where it does not (what the docs' "Learning rates"
section quotes):

    python -m benchmarks.lr_sensitivity
"""

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks._meta import RESULTS, recorded

SWEEPS = {  # results file: the task, and its score
    "equal_params.json": ("digits MLP 64-800-10", "val_acc"),
    "equal_params_cnn.json": ("digits CNN", "val_acc"),
    "equal_params_charlm_hashed_genome_3_seeds_gbfunc_narrow.json": (
        "char transformer",
        "val_loss",
    ),
}
TOLERANCE = {"val_acc": 0.5, "val_loss": 0.02}  # points of accuracy, nats


def table(source: str, task: str, metric: str) -> list[str]:
    """One line per gbfunc arm: the score at each learning rate, the best, and which learning
    rates land within the tolerance of the best."""
    runs = json.loads((RESULTS / source).read_text())["rows"]
    scores: dict[tuple[str, str], dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        if run["family"] == "gbfunc":
            scores[run["ratio"], run["arm"]][run["lr"]].append(run[metric])
    lines = []
    for (ratio, arm), by_lr in scores.items():
        scale = 100 if metric == "val_acc" else 1
        mean = {lr: scale * statistics.mean(v) for lr, v in sorted(by_lr.items())}
        best = (max if metric == "val_acc" else min)(mean, key=mean.get)
        near = [lr for lr, v in mean.items() if abs(v - mean[best]) <= TOLERANCE[metric]]
        cells = ", ".join(
            f"{lr:g}: {v:.2f}" if scale > 1 else f"{lr:g}: {v:.3f}" for lr, v in mean.items()
        )
        seeds = len(next(iter(by_lr.values())))
        within = ", ".join(f"{x:g}" for x in near)
        lines.append(f"| {task} | {ratio} | {arm} | {seeds} | {cells} | {best:g} | {within} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "lr_sensitivity.md")
    args = parser.parse_args(argv)
    with recorded(args.out, "G-net learning rates: the score at each rate of the committed sweeps"):
        print(
            "Accuracy in % (higher is better) or validation loss in nats (lower), mean over "
            "seeds, per g-net learning rate (Adam, warm-up then cosine decay; free tensors at "
            "the arm's `free_lr_factor`); 'within' lists the rates within 0.5 points or "
            "0.02 nats of the best.\n"
        )
        print("| task | ratio | genome | seeds | score per learning rate | best | within |")
        print("|---|---|---|---|---|---|---|")
        for source, (task, metric) in SWEEPS.items():
            for line in table(source, task, metric):
                print(line)
        print(f"\nfrom {', '.join(f'results/{s}' for s in SWEEPS)}")


if __name__ == "__main__":
    main()
