"""gbfunc against the obvious alternatives at equal trainable parameters, on digits.

Tasks (`--task`):

- `mlp`: the paper's MLP shape (Shuvaev et al. 2024: 784-800-10 on MNIST) on data that
  ships, 64-800-10 on scikit-learn's 8x8 digits (60,010 parameters), at ~20x, ~100x, ~300x;
- `cnn`: the main job's digits CNN (151k parameters) at ~23x and ~135x.

At each ratio three families are trained with the same protocol, batches and seeds:

- **gbfunc**: for the MLP the paper's genome through `gb.plan` options (one g-net per weight
  and per bias, `tile="full"`, `biases=True`; neurons labelled by their identity: hidden
  units by the Gray code of their index, pixels by the Gray codes of their (row, column),
  classes one-hot; tanh g-nets; each generated row centred, `center=True`); for the CNN the
  main job's tiled genome and the paper-style one;
- **narrow**: the same architecture at the width whose parameter count is nearest;
- **low rank**: the weights as `U @ V.T`, everything else free, ranks spread by size
  (infeasible where the free parameters alone exceed the budget).

Protocol, every arm: Adam, no weight decay, the task's steps and batch (MLP 1000 x 128, CNN
400 x 64), linear warm-up over the first tenth (at most 100 steps) then cosine decay to 0,
each arm's best learning rate from its own sweep of 3-4 values (chosen on the mean over
seeds), validation accuracy at the last step.

    python -m benchmarks.equal_params               # MLP, 3 seeds, ~30 minutes on one core
    python -m benchmarks.equal_params --task cnn    # ~10 minutes
    python -m benchmarks.equal_params --quick       # 1 seed, a third of the steps

Writes `benchmarks/results/equal_params[_cnn][_quick].{md,json,png}`.
"""

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

import gbfunc as gb
from benchmarks._meta import RESULTS, header_md, markdown_table, provenance_line, write_json
from benchmarks.baselines import low_rank, tree_count
from examples.data import digits_split
from examples.main_job import DigitsConfig
from examples.models import DigitsCNN, digits_mlp, paper_genome
from examples.training import narrowest_match, trainable_count as count

DENSE_LRS = (3e-4, 1e-3, 3e-3)
BASELINE_LRS = (3e-3, 1e-2, 3e-2, 0.1)
GB_LRS = (0.03, 0.1, 0.3, 1.0)


@dataclass(frozen=True)
class Task:
    """A model family at several sizes, the gbfunc genomes to compare, and the protocol.

    Attributes:
        name: The task in titles.
        dense: The full-size model in tables.
        build: The model at a width (`None`: the full-size model).
        widths: Widths the narrow baseline may take.
        genomes: `(ratio label, arm label, gb.plan options)` of the gbfunc arms.
        factored: Weights the low-rank baseline factors (the rest stays free).
        steps, batch: The protocol's training length.
    """

    name: str
    dense: str
    build: Callable[[int | None], nn.Module]
    widths: range
    genomes: tuple[tuple[str, str, dict], ...]
    factored: tuple[str, ...]
    steps: int
    batch: int


TASKS = {
    "mlp": Task(
        "digits MLP 64-800-10",
        "64-800-10",
        lambda w: digits_mlp(800 if w is None else w),
        range(1, 200),
        (
            ("~20x", "g-nets H=47", paper_genome(47)),
            ("~100x", "g-nets H=9", paper_genome(9)),
            ("~300x", "g-nets H=3", paper_genome(3)),
        ),
        ("1.weight", "3.weight"),
        1000,
        128,
    ),
    "cnn": Task(
        "digits CNN (main job)",
        "channels (32, 64), hidden 128",
        lambda w: DigitsCNN() if w is None else DigitsCNN((w, 2 * w), 4 * w),
        range(1, 33),
        (
            ("~23x", "main job genome", DigitsConfig().plan),
            # the first classifier layer's inputs labelled by (channel, row, column)
            (
                "~135x",
                "paper genome H=10",
                paper_genome(10, "classifier.1.weight", (64, 4, 4), "classifier.3.*"),
            ),
        ),
        ("features.0.weight", "features.2.weight", "classifier.1.weight", "classifier.3.weight"),
        400,
        64,
    ),
}


@dataclass(frozen=True)
class Arm:
    """One trainable configuration: its family, its tree and how the tree becomes weights."""

    family: str
    label: str
    model: nn.Module
    tree: dict
    to_params: Callable[[dict], dict[str, Tensor]]
    params: int


def arms_at(task: Task, label: str, options: dict, seed: int) -> list[Arm]:
    """The gbfunc arm planned with `options`, and its baselines at its parameter count."""
    torch.manual_seed(seed)
    model = task.build(None)
    plan = gb.plan(model, **options)
    gparams = gb.init(plan, seed=seed)
    ours = gb.report(plan).stored_params
    arms = [Arm("gbfunc", label, model, gparams, lambda t: gb.apply(t, plan), ours)]
    width, _ = narrowest_match(task.build, ours, task.widths)
    torch.manual_seed(seed)
    narrow = task.build(width)
    tree = {k: v.detach().clone().requires_grad_() for k, v in narrow.named_parameters()}
    arms.append(Arm("narrow", f"width {width}", narrow, tree, lambda t: t, count(narrow)))
    params = dict(model.named_parameters())
    free = sum(v.numel() for k, v in params.items() if k not in task.factored)
    rank_one = sum(params[k].shape[0] + params[k][0].numel() for k in task.factored)
    if ours >= free + rank_one:  # room for rank 1 everywhere
        tree, to_params = low_rank(model, list(task.factored), ours - free, seed=seed)
        arms.append(Arm("low rank", "U V^T", model, tree, to_params, tree_count(tree)))
    return arms


def train(
    arm: Arm, lr: float, data: tuple[Tensor, ...], steps: int, batch: int, seed: int
) -> float:
    """Validation accuracy of `arm` after `steps` of the shared protocol."""
    x_train, y_train, x_val, y_val = data
    leaves = [v for v in tree_leaves(arm.tree) if v.requires_grad]
    optimizer = torch.optim.Adam(leaves, lr=lr)
    warmup = min(100, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda t: min(1.0, (t + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, t / steps))),
    )
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(len(x_train), (batch,), generator=gen)
        logits = functional_call(arm.model, arm.to_params(arm.tree), (x_train[index],))
        loss = F.cross_entropy(logits, y_train[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        logits = functional_call(arm.model, arm.to_params(arm.tree), (x_val,))
    return float((logits.argmax(1) == y_val).float().mean())


def run(task: Task, seeds: int, steps: int) -> list[dict[str, Any]]:
    """One row per (ratio, family, lr, seed), the dense model first."""
    data = digits_split(seed=0)
    rows = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        dense = task.build(None)
        full = count(dense)
        tree = {k: v.detach().clone().requires_grad_() for k, v in dense.named_parameters()}
        groups = [("dense", [Arm("dense", task.dense, dense, tree, lambda t: t, full)])]
        groups += [(ratio, arms_at(task, label, opts, seed)) for ratio, label, opts in task.genomes]
        for ratio, arms in groups:
            for arm in arms:
                lrs = {"dense": DENSE_LRS, "gbfunc": GB_LRS}.get(arm.family, BASELINE_LRS)
                for lr in lrs:
                    fresh = [v.detach().clone() for v in tree_leaves(arm.tree)]
                    start = time.perf_counter()
                    acc = train(arm, lr, data, steps, task.batch, seed)
                    with torch.no_grad():  # every lr starts from the same tensors
                        for leaf, saved in zip(tree_leaves(arm.tree), fresh, strict=True):
                            leaf.copy_(saved)
                    rows.append(
                        {
                            "ratio": ratio,
                            "family": arm.family,
                            "arm": arm.label,
                            "params": arm.params,
                            "compression": full / arm.params,
                            "lr": lr,
                            "seed": seed,
                            "val_acc": acc,
                            "seconds": time.perf_counter() - start,
                        }
                    )
                    print(
                        f"seed {seed} {ratio:>6} {arm.family:<8} {arm.label:<18} "
                        f"{arm.params:>6,} lr {lr:<6g} acc {100 * acc:.2f}",
                        flush=True,
                    )
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (ratio, family, arm): the best lr by mean accuracy over seeds, with mean and std."""
    out = []
    keys = dict.fromkeys((r["ratio"], r["family"], r["arm"]) for r in rows)
    for ratio, family, arm in keys:
        group = [r for r in rows if (r["ratio"], r["family"], r["arm"]) == (ratio, family, arm)]
        by_lr: dict[float, list[float]] = {}
        for r in group:
            by_lr.setdefault(r["lr"], []).append(r["val_acc"])
        lr = max(by_lr, key=lambda k: statistics.fmean(by_lr[k]))
        accs = by_lr[lr]
        out.append(
            {
                "ratio": ratio,
                "family": family,
                "arm": arm,
                "params": group[0]["params"],
                "compression": group[0]["compression"],
                "lr": lr,
                "lrs": sorted(by_lr),
                "val_acc": statistics.fmean(accs),
                "val_acc_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "seeds": len(accs),
                "seconds": statistics.fmean(r["seconds"] for r in group),
            }
        )
    return out


def table(summary: list[dict[str, Any]]) -> str:
    columns = [("ratio", "l"), ("family", "l"), ("arm", "l")] + [
        (t, "r") for t in ("trainable params", "compression", "best lr", "val acc %", "s/run")
    ]
    rows = (
        [
            s["ratio"],
            s["family"],
            s["arm"],
            f"{s['params']:,}",
            f"{s['compression']:.1f}x",
            f"{s['lr']:g} of {', '.join(f'{v:g}' for v in s['lrs'])}",
            f"{100 * s['val_acc']:.2f} ± {100 * s['val_acc_std']:.2f}",
            f"{s['seconds']:.1f}",
        ]
        for s in summary
    )
    return markdown_table(columns, rows)


def findings(summary: list[dict[str, Any]]) -> str:
    """Per ratio: gbfunc's margin over each baseline, in accuracy points."""
    lines = []
    for ratio in dict.fromkeys(s["ratio"] for s in summary if s["ratio"] != "dense"):
        group = {s["family"]: s for s in summary if s["ratio"] == ratio}
        ours = group["gbfunc"]
        parts = []
        for family, s in group.items():
            if family == "gbfunc":
                continue
            off = s["params"] / ours["params"] - 1
            window = "" if abs(off) <= 0.1 else f", {off:+.0%}: no width within ±10%"
            margin = 100 * (ours["val_acc"] - s["val_acc"])
            parts.append(f"{margin:+.2f} pt vs {family} ({s['params']:,} params{window})")
        if "low rank" not in group:
            parts.append("low rank infeasible (the free parameters alone exceed the budget)")
        lines.append(
            f"- **{ratio}** (gbfunc {ours['params']:,} params, {100 * ours['val_acc']:.2f}%): "
            + "; ".join(parts)
        )
    return "\n".join(lines)


def plot(summary: list[dict[str, Any]], path: Path, title: str) -> None:
    """Validation accuracy against trainable parameters (log), one line per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for family, color in (
        ("gbfunc", "tab:orange"),
        ("narrow", "tab:blue"),
        ("low rank", "tab:green"),
    ):
        points = sorted((s["params"], s) for s in summary if s["family"] == family)
        if points:
            ax.errorbar(
                [p for p, _ in points],
                [100 * s["val_acc"] for _, s in points],
                [100 * s["val_acc_std"] for _, s in points],
                fmt="o-",
                color=color,
                label=family,
                capsize=3,
            )
    dense = next(s for s in summary if s["family"] == "dense")
    ax.axhline(100 * dense["val_acc"], color="gray", ls=":", label="dense, full size")
    ax.set(
        xscale="log",
        xlabel="trainable parameters (log)",
        ylabel="validation accuracy (%)",
        title=f"{title}: equal-parameter comparison",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.text(0.01, 0.01, provenance_line(), fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="mlp")
    parser.add_argument("--quick", action="store_true", help="1 seed, a third of the steps")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = TASKS[args.task]
    seeds, steps = (1, task.steps // 3) if args.quick else (3, task.steps)
    started = time.perf_counter()
    rows = run(task, seeds, steps)
    summary = summarise(rows)
    name = "equal_params" + ("" if args.task == "mlp" else f"_{args.task}")
    stem = args.out / (name + ("_quick" if args.quick else ""))
    stem.parent.mkdir(parents=True, exist_ok=True)
    text = (
        header_md(f"gbfunc vs a narrower model and low rank at equal parameters ({task.name})")
        + f"- {seeds} seed(s), {steps} steps, batch {task.batch}; "
        + f"total {time.perf_counter() - started:.0f} s\n"
        + f"- lr sweeps: dense {DENSE_LRS}, narrow and low rank {BASELINE_LRS}, gbfunc {GB_LRS}\n"
        + "".join(
            f"- {ratio} {label}: `gb.plan(model, **{opts})`\n"
            for ratio, label, opts in task.genomes
        )
        + "\n"
        + table(summary)
        + "\n## Margins\n\n"
        + findings(summary)
        + "\n"
    )
    print("\n" + table(summary) + "\n" + findings(summary))
    stem.with_suffix(".md").write_text(text)
    write_json(stem.with_suffix(".json"), rows, summary=summary)
    plot(summary, stem.with_suffix(".png"), task.name)
    print(f"wrote {stem}.{{md,json,png}}")


if __name__ == "__main__":
    main()
