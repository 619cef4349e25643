"""Compression vs quality on real data: the main job's two tasks, dense and at several ratios.

Both tasks are the main job's (`examples/main_job.py`): the character-level transformer on
Python's help text (`pydoc_data.topics`) and the CNN on scikit-learn's digits. Each run trains
the dense model and one gbfunc model per ratio on the same batches, from the same seed, with
the same steps, AdamW and schedule, and the main job's learning rates and plan overrides (its
`CharLMConfig` / `DigitsConfig`). The ratios are generated weights per g-net parameter,
reached with `gb.plan(..., compression=c)`: 5x and 20x with the main job's genome (8 hidden
units, 8 weights per evaluation), 100x and 300x with shared g-nets and tile embeddings
(`share=True`), 300x also narrower; and "row g-nets" (13-15x), the genome that is fastest on
CPU (`benchmarks/bench_step.py`): 128x128 tiles, 8 hidden units, a whole tile row per
evaluation (`outputs=128`). Biases, norms, the output layer and (for the transformer)
the token and position embeddings stay free, so the whole-model ratio is lower; both are in
the table.

Writes `benchmarks/results/quality[_quick].{md,csv,json,png}`: per task and ratio the
trainable parameters, final validation loss and accuracy (mean and std over seeds), the
median step time and the training time, where the curve bends, and a Pareto plot.

    python -m benchmarks.quality --quick   # transformer 200 steps, batch 16, 1 seed; digits 3 seeds
    python -m benchmarks.quality           # the main job's steps and batches, 3 and 5 seeds
"""

import argparse
import csv
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from functools import partial
from itertools import pairwise, takewhile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gbfunc as gb
from benchmarks._meta import RESULTS, header_md, markdown_table, provenance_line, write_json
from examples.data import CharCorpus, char_batch, char_windows, digits_split, pydoc_text
from examples.models import CharTransformer, DigitsCNN
from examples.tasks import EVAL_TOKENS, CharLMConfig, DigitsConfig
from examples.training import Arm, TrainConfig, evaluate, make_arm, train

# label -> gb.plan options (None: the dense model), the same for both tasks; each task adds
# its main-job overrides (the output layer stays free). 5x and 20x use the main job's genome.
SETTINGS: dict[str, dict[str, Any] | None] = {
    "dense": None,
    "5x": {"compression": 5, "hidden": 8, "outputs": 8},
    "row g-nets": {"tile": (128, 128), "hidden": 8, "outputs": 128},  # 13-15x, the fastest
    "20x": {"compression": 20, "hidden": 8, "outputs": 8},
    "100x": {"compression": 100, "share": True, "hidden": 8, "outputs": 8},
    "300x": {"compression": 300, "share": True, "hidden": 4, "outputs": 4, "embed_dim": 4},
}


@dataclass(frozen=True)
class Budget:
    """Steps, batch and seeds of one task in one mode."""

    steps: int
    batch: int
    seeds: int


BUDGETS = {
    "quick": {"charlm": Budget(200, 16, 1), "digits": Budget(400, 64, 3)},
    "full": {"charlm": Budget(800, 32, 3), "digits": Budget(400, 64, 5)},  # the main job's
}


@dataclass
class TimedArm(Arm):
    """An `Arm` that records the wall time of each of its steps."""

    step_seconds: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, arm: Arm) -> "TimedArm":
        return cls(**{f.name: getattr(arm, f.name) for f in fields(Arm)})

    def step(self, x: Tensor, y: Tensor) -> float:
        start = time.perf_counter()
        loss = super().step(x, y)
        self.step_seconds.append(time.perf_counter() - start)
        return loss


@dataclass
class Task:
    """A task: its main-job config (learning rates, schedule, plan overrides), model and data."""

    name: str
    cfg: TrainConfig
    build: Callable[[], nn.Module]
    batches: Callable[[int, int], Iterator[tuple[Tensor, Tensor]]]  # (batch, seed) -> batches
    validate: Callable[[nn.Module, dict[str, Tensor]], tuple[float, float]]


def charlm_task() -> Task:
    # Tiled genomes with the output layer free, as the main job's tiled genome had it.
    cfg = replace(CharLMConfig(), plan={"overrides": {"head.weight": "free"}})
    corpus = CharCorpus.from_text(pydoc_text())
    val_x, val_y = char_windows(corpus.val, cfg.context)

    def batches(batch: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        while True:
            yield char_batch(corpus.train, batch, cfg.context, gen)

    return Task(
        "charlm",
        cfg,
        lambda: CharTransformer(corpus.vocab_size, cfg.context, cfg.width, cfg.depth, cfg.heads),
        batches,
        lambda model, params: evaluate(model, params, val_x, val_y, EVAL_TOKENS // cfg.context),
    )


def digits_task() -> Task:
    # The sweep's genomes are tiled, with the output layer free as the main job's tiled genome
    # had it; the main job's own plan (the hashed genome) is sized by hand for one ratio.
    cfg = replace(DigitsConfig(), plan={"overrides": {"classifier.3.weight": "free"}})
    x_train, y_train, x_val, y_val = digits_split(seed=cfg.seed)

    def batches(batch: int, seed: int) -> Iterator[tuple[Tensor, Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        while True:
            index = torch.randint(len(x_train), (batch,), generator=gen)
            yield x_train[index], y_train[index]

    return Task(
        "digits",
        cfg,
        lambda: DigitsCNN(cfg.channels, cfg.hidden),
        batches,
        lambda model, params: evaluate(model, params, x_val, y_val, len(x_val)),
    )


def run_seed(task: Task, budget: Budget, seed: int, desc: str) -> list[dict[str, Any]]:
    """Train every setting of `SETTINGS` on the same batches; one result row each."""
    torch._dynamo.reset()  # fresh compile caches if the task's config compiles each loss
    torch.manual_seed(seed)
    model = task.build()
    cfg = replace(
        task.cfg,
        steps=budget.steps,
        batch=budget.batch,
        eval_every=budget.steps,
        seed=seed,
    )
    overrides = task.cfg.plan.get("overrides", {})
    arms, rows = [], []
    for label, plan_options in SETTINGS.items():
        if plan_options is None:
            tree = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
            arm = make_arm(label, model, tree, lambda t: t, [(tree, cfg.lr_dense)], cfg)
            info = {
                "generated_compression": 1.0,
                "compression": 1.0,
                "trainable_params": sum(v.numel() for v in tree.values()),
            }
        else:
            plan = gb.plan(model, **plan_options, overrides=overrides)
            gparams = gb.init(plan, seed=seed)
            lrs = [(gparams["stacks"], cfg.lr_gb), (gparams["free"], cfg.lr_dense)]
            arm = make_arm(label, model, gparams, partial(gb.apply, plan=plan), lrs, cfg)
            rep = gb.report(plan)
            info = {
                "generated_compression": rep.generated_compression,
                "compression": rep.compression,
                "trainable_params": rep.gnet_params + rep.free_params,
            }
        arms.append(TimedArm.of(arm))
        rows.append(
            {"task": task.name, "setting": label, "plan": plan_options or {}, "seed": seed, **info}
        )
    batches = task.batches(budget.batch, seed)
    curves = train(arms, batches, lambda arm: task.validate(model, arm.params()), cfg, desc)
    for row, arm in zip(rows, arms, strict=True):
        row |= {
            "val_loss": curves.val_loss[arm.name][-1],
            "val_acc": curves.val_acc[arm.name][-1],
            "step_ms": 1e3 * statistics.median(arm.step_seconds),
            "train_s": sum(arm.step_seconds),
            "steps": budget.steps,
            "batch": budget.batch,
        }
    return rows


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and std over seeds per (task, setting), dense first, then by increasing ratio."""
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        ratio = {r["setting"]: r["generated_compression"] for r in rows if r["task"] == task}
        for label in sorted(SETTINGS, key=ratio.__getitem__):
            group = [r for r in rows if r["task"] == task and r["setting"] == label]
            first = group[0]
            summary = {
                k: first[k]
                for k in (
                    "task",
                    "setting",
                    "generated_compression",
                    "compression",
                    "trainable_params",
                )
            }
            for key in ("val_loss", "val_acc", "step_ms", "train_s"):
                values = [r[key] for r in group]
                summary[key] = statistics.fmean(values)
                summary[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
            summary["seeds"] = len(group)
            out.append(summary)
    return out


def bend(summary: list[dict[str, Any]], task: str) -> str:
    """Plain sentences on where quality falls off along the compression axis."""
    group = [s for s in summary if s["task"] == task]
    dense, compressed = group[0], group[1:]
    parts = []
    for s in compressed:
        gap = 100 * (s["val_loss"] / dense["val_loss"] - 1)
        acc = 100 * (s["val_acc"] - dense["val_acc"])
        parts.append(f"{s['setting']} {gap:+.1f}% loss / {acc:+.1f} pt accuracy")
    within = list(takewhile(lambda s: s["val_loss"] <= 1.05 * dense["val_loss"], compressed))
    gaps = [s["val_loss"] - prev["val_loss"] for prev, s in pairwise(group)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    knee = (
        f"the steepest loss increase is from {group[worst]['setting']} to "
        f"{group[worst + 1]['setting']} (+{gaps[worst]:.3f} nats)"
    )
    keep = (
        f"within 5% of the dense validation loss up to {within[-1]['setting']}"
        if within
        else "no compressed setting comes within 5% of the dense validation loss"
    )
    close = list(takewhile(lambda s: s["val_acc"] >= dense["val_acc"] - 0.01, compressed))
    keep += (
        f", within 1 pt of its accuracy up to {close[-1]['setting']}"
        if close
        else ", none within 1 pt of its accuracy"
    )
    return f"- **{task}**: vs dense, {'; '.join(parts)}. {keep.capitalize()}; {knee}."


def table(summary: list[dict[str, Any]]) -> str:
    columns = [("task", "l"), ("setting", "l")] + [
        (title, "r")
        for title in (
            "generated ratio",
            "whole-model ratio",
            "trainable params",
            "seeds",
            "val loss",
            "val acc %",
            "ms/step",
            "train s",
        )
    ]
    rows = (
        [
            s["task"],
            s["setting"],
            f"{s['generated_compression']:.1f}x",
            f"{s['compression']:.1f}x",
            f"{s['trainable_params']:,}",
            f"{s['seeds']}",
            f"{s['val_loss']:.3f} ± {s['val_loss_std']:.3f}",
            f"{100 * s['val_acc']:.1f} ± {100 * s['val_acc_std']:.1f}",
            f"{s['step_ms']:.1f}",
            f"{s['train_s']:.0f}",
        ]
        for s in summary
    )
    return markdown_table(columns, rows)


def pareto_plot(
    rows: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    path: Path,
    title: str,
    baseline: float,
) -> None:
    """Validation loss (top) and accuracy (bottom) vs trainable parameters, one column per task.

    Seeds are dots, means are joined in compression order; the dense model is the right end.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(s["task"] for s in summary))
    fig, axes = plt.subplots(2, len(tasks), figsize=(6 * len(tasks), 8), squeeze=False)
    metrics = (
        ("val_loss", 1, "final validation loss (nats)"),
        ("val_acc", 100, "validation accuracy (%)"),
    )
    for column, task in enumerate(tasks):
        means = [s for s in summary if s["task"] == task]
        dots = [r for r in rows if r["task"] == task]
        for row, (key, scale, ylabel) in enumerate(metrics):
            ax = axes[row, column]
            ax.scatter(
                [r["trainable_params"] for r in dots],
                [scale * r[key] for r in dots],
                s=12,
                color="gray",
                alpha=0.6,
                label="one seed",
            )
            ax.plot(
                [s["trainable_params"] for s in means],
                [scale * s[key] for s in means],
                "o-",
                color="tab:orange",
                label="mean over seeds",
            )
            ax.axhline(scale * means[0][key], color="tab:blue", ls=":", lw=1, label="dense")
            for s in means:
                ax.annotate(
                    s["setting"],
                    (s["trainable_params"], scale * s[key]),
                    textcoords="offset points",
                    xytext=(4, 6),
                    fontsize=8,
                )
            if task == "charlm" and key == "val_loss":
                ax.axhline(baseline, color="gray", ls="--", lw=1, label="unigram entropy")
            what = "next-character" if task == "charlm" else "digit"
            ax.set(
                xscale="log",
                xlabel="trainable parameters (log)",
                ylabel=ylabel,
                title=f"{task}: {what} {ylabel.split(' (')[0]}",
            )
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer steps and seeds (a few minutes)"
    )
    parser.add_argument("--task", choices=("charlm", "digits", "all"), default="all")
    parser.add_argument("--steps", type=int, help="override the training steps of every task")
    parser.add_argument("--seeds", type=int, help="override the number of seeds of every task")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    mode = "quick" if args.quick else "full"
    changes = {k: v for k, v in (("steps", args.steps), ("seeds", args.seeds)) if v is not None}
    budget = {n: replace(b, **changes) for n, b in BUDGETS[mode].items()}
    builders = {"charlm": charlm_task, "digits": digits_task}
    names = list(builders) if args.task == "all" else [args.task]
    runs = [(name, seed) for name in names for seed in range(budget[name].seeds)]
    rows: list[dict[str, Any]] = []
    tasks: dict[str, Task] = {}
    started = time.perf_counter()
    for i, (name, seed) in enumerate(runs, 1):
        task = tasks.setdefault(name, builders[name]())
        rows += run_seed(task, budget[name], seed, f"[{i}/{len(runs)}] {name} seed {seed}")
    summary = summarise(rows)
    stem = args.out / ("quality_quick" if args.quick else "quality")
    stem.parent.mkdir(parents=True, exist_ok=True)
    entropy = CharCorpus.from_text(pydoc_text()).unigram_entropy()
    budgets = {n: budget[n].__dict__ for n in names}
    findings = "\n".join(bend(summary, n) for n in names)
    text = (
        header_md("Compression vs quality on real data (gbfunc)")
        + f"- budgets: {budgets}; total {time.perf_counter() - started:.0f} s\n"
        + f"- settings (gb.plan options): {SETTINGS}\n"
        + "".join(f"- {n}: {tasks[n].cfg}\n" for n in names)
        + f"- charlm unigram entropy (a model that ignores context): {entropy:.3f} nats\n\n"
        + table(summary)
        + "\n## Where the curve bends\n\n"
        + findings
        + "\n"
    )
    print("\n" + table(summary) + "\n" + findings)
    stem.with_suffix(".md").write_text(text)
    write_json(stem.with_suffix(".json"), rows, budgets=budgets, summary=summary)
    with stem.with_suffix(".csv").open("w", newline="") as f:
        f.write(f"# {provenance_line()}\n")
        writer = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "plan"] + ["plan"])
        writer.writeheader()
        writer.writerows({**r, "plan": repr(r["plan"])} for r in rows)
    pareto_plot(rows, summary, stem.with_suffix(".png"), provenance_line(), entropy)
    print(f"wrote {stem}.{{md,csv,json,png}}")


if __name__ == "__main__":
    main()
