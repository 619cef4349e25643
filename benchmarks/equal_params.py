"""gbfunc against the obvious alternatives at equal trainable parameters.

Tasks (`--task`):

- `mlp`: the paper's MLP shape (Shuvaev et al. 2024: 784-800-10 on MNIST) on data that
  ships, 64-800-10 on scikit-learn's 8x8 digits (60,010 parameters), at ~20x, ~100x, ~300x;
- `cnn`: the main job's digits CNN (151k parameters) at ~23x and ~135x;
- `charlm`: the main job's character transformer (440k parameters) at ~5x and ~20x of the
  whole model; scored by validation loss (nats per character, lower is better).

At each ratio four families are trained with the same protocol, batches and seeds:

- **gbfunc**: for the MLP the paper's genome through `gb.plan` options (one g-net per weight
  and per bias, `tile="full"`, `biases=True`; neurons labelled by their identity: hidden
  units by the Gray code of their index, pixels by the Gray codes of their (row, column),
  classes one-hot; tanh g-nets; each generated row centred, `center=True`); for the CNN a
  tiled genome (the main job's until the hashed one) and the paper-style one; for the
  transformer tiled genomes, with the embeddings and the output layer generated at ~20x; on
  the MLP and the CNN also the hashed genome (`hashed=B`: each weight matrix one tile whose
  HashedNets table of `B` shared values is added to a tiny g-net's output; the ratio label
  says "hashed genome"; the CNN's ~23x one is the main job's);
- **narrow**: the same architecture at the width whose parameter count is nearest;
- **low rank**: the weights as `U @ V.T`, everything else free, ranks spread by size
  (infeasible where the free parameters alone exceed the budget);
- **hashed**: HashedNets (Chen et al. 2015), the weights' entries shared among the budget's
  values by a fixed random hash and sign, everything else free (a recipe the paper reports
  beating equal-size networks; infeasible where the free parameters exceed the budget).

Protocol, every arm: Adam, no weight decay, the task's steps and batch (MLP 1000 x 128, CNN
400 x 64, transformer 800 x 32 windows of 128 characters), linear warm-up over the first
tenth (at most 100 steps) then cosine decay to 0, each arm's best learning rate from its own
sweep of 3-4 values (chosen on the mean over seeds), scored at the last step. The free
tensors of a gbfunc arm (biases, norms, layers left free) train at `free_lr_factor` times
its g-net rate, which puts them on the baselines' grid. gbfunc arms of the CNN start from
`gb.calibrate` on 512 training images (every layer's outputs at zero mean: without it the
paper-style genome generated a dead network on one seed in three); on the MLP it lowered the
paper genome's accuracy, so it is off there (`--calibrate` measures it).

With `--distill` every arm but the dense one is also trained towards the dense model's
logits (knowledge distillation: `(1 - a) * CE + a * T^2 * KL(teacher_T || student_T)`,
`a = 0.5`, `T = 2`; the teacher is that seed's dense model at its best learning rate), the
same for gbfunc and the baselines.

    python -m benchmarks.equal_params                  # MLP, 3 seeds, ~25 minutes on one core
    python -m benchmarks.equal_params --task cnn       # ~12 minutes
    python -m benchmarks.equal_params --task charlm    # 1 seed, ~100 minutes
    python -m benchmarks.equal_params --distill        # the distillation recipe
    python -m benchmarks.equal_params --task charlm --families hashed   # one family only
    python -m benchmarks.equal_params --task charlm --families gbfunc --arm "hashed genome"
    python -m benchmarks.equal_params --quick          # 1 seed, a third of the steps
    python -m benchmarks.equal_params --task charlm --seeds 3 --families gbfunc narrow \\
        --arm "hashed genome"                          # more seeds for the close comparison
    python -m benchmarks.equal_params --task cnn --replot benchmarks/results/equal_params_cnn.json

Writes `benchmarks/results/equal_params[_cnn|_charlm][_distill][_quick].{md,json,csv,png}`:
the table of each arm at its best learning rate, every run (ratio, family, learning rate,
seed) as JSON and CSV, and the score against trainable parameters (log scale) per family.
"""

import argparse
import functools
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

import gbfunc as gb
from benchmarks._meta import (
    FIGURE_WIDTH,
    NOTES,
    RESULTS,
    header_md,
    markdown_table,
    provenance_line,
    save_figure,
    stamp,
    write_csv,
    write_json,
    write_results,
)
from examples.baselines import factor_budget, hashed, low_rank, tree_count, weight_matrices
from examples.data import CharCorpus, char_batch, char_windows, digits_held_out, pydoc_held_out
from examples.models import CharTransformer, DigitsCNN, digits_mlp, paper_genome
from examples.tasks import CharLMConfig, DigitsConfig
from examples.training import evaluate, narrowest_match, trainable_count as count

DIGITS_LRS = {
    "dense": (3e-4, 1e-3, 3e-3),
    "narrow": (3e-3, 1e-2, 3e-2, 0.1),
    "low rank": (3e-3, 1e-2, 3e-2, 0.1),
    "hashed": (3e-3, 1e-2, 3e-2, 0.1),
    "gbfunc": (0.03, 0.1, 0.3, 1.0),
}
CNN_LRS = {**DIGITS_LRS, "gbfunc": (0.01, 0.03, 0.1, 0.3)}  # 1.0 diverged, 0.03 was the best
CHARLM_LRS = {
    "dense": (1e-2,),  # the main job's measured optimum; the dense model is only the reference
    # 3e-3 and 1e-2 were never best; at ~20x 6e-2 beat 3e-2, so the sweep goes up to 0.1
    "narrow": (3e-2, 6e-2, 1e-1),
    "low rank": (3e-3, 1e-2, 3e-2),
    "hashed": (3e-3, 1e-2, 3e-2),
    "gbfunc": (1e-2, 2e-2, 4e-2),
}
FAMILIES = ("dense", "gbfunc", "narrow", "low rank", "hashed")
MARGINS = "\n## Margins (positive: gbfunc is better)\n\n"
DISTILL_WEIGHT, DISTILL_TEMPERATURE = 0.5, 2.0
CALIBRATION_BATCH = 512


@dataclass(frozen=True)
class Data:
    """A task's data: random training batches, and the validation score of a model."""

    sample: Callable[[torch.Generator, int], tuple[Tensor, Tensor]]
    validate: Callable[[nn.Module, dict[str, Tensor]], tuple[float, float]]  # (loss, accuracy)


def digits_data() -> Data:
    """Seed 0's training and validation images of `digits_held_out`: never the test images
    the main job scores on (runs before 45c68c5 trained on `digits_split(seed=0)`, which
    holds them, and chose on its validation images)."""
    x_train, y_train, x_val, y_val, _, _ = digits_held_out(seed=0)

    def sample(gen: torch.Generator, batch: int) -> tuple[Tensor, Tensor]:
        index = torch.randint(len(x_train), (batch,), generator=gen)
        return x_train[index], y_train[index]

    return Data(sample, lambda model, params: evaluate(model, params, x_val, y_val, len(x_val)))


@functools.cache
def _corpus() -> CharCorpus:
    """The main job's help topics: its training and validation parts, never its test topics
    (runs before 45c68c5 split `pydoc_text()` by position, test topics in training)."""
    return CharCorpus.from_parts(*pydoc_held_out())


def charlm_data(corpus: CharCorpus | None = None) -> Data:
    """Batches and validation of the character task on `corpus` (default: the main job's)."""
    cfg = CharLMConfig()
    corpus = _corpus() if corpus is None else corpus
    val_x, val_y = char_windows(corpus.val, cfg.context)
    return Data(
        lambda gen, batch: char_batch(corpus.train, batch, cfg.context, gen),
        lambda model, params: evaluate(model, params, val_x, val_y, 128),
    )


def charlm_model(width: int | None, corpus: CharCorpus | None = None) -> CharTransformer:
    """The main job's transformer at `width` (default: full) for `corpus`'s vocabulary."""
    cfg = CharLMConfig()
    w = cfg.width if width is None else width
    vocab = (_corpus() if corpus is None else corpus).vocab_size
    return CharTransformer(vocab, cfg.context, w, cfg.depth, cfg.heads)


HASHED = "hashed genome"
# The MLP's hashed genome with free biases (at ~20x they fit): tiny tanh g-nets on the paper's
# labels, every row centred.
MLP_HASHED = {
    "tile": "full",
    "encoding": "gray",
    "hidden": 4,
    "activation": "tanh",
    "center": True,
    "overrides": {"1.weight": {"col_labels": (8, 8)}, "3.weight": {"row_labels": "onehot"}},
}
# The transformer's hashed genome: tables on (64, 64) tiles beside g-nets shared per matrix.
CHARLM_HASHED = {"tile": (64, 64), "hidden": 8, "outputs": 8, "share": True, "embed_dim": 4}
# The main job's CNN genome before the hashed one: (64, 64) tiles, 8 hidden units, 8 outputs.
TILED_CNN = {
    "tile": (64, 64),
    "hidden": 8,
    "outputs": 8,
    "overrides": {"classifier.3.weight": "free"},
}
# The digits MLP's ReLU row g-nets on (32, 32) tiles, 8 weights per evaluation: chosen for
# `transfer` (its digits-rows task) before any run, and swept again by `lr_rule`.
ROWS_GENOME = {"tile": (32, 32), "hidden": 8, "outputs": 8}
CNN_TABLES_135X = {
    "features.0.weight": 30,
    "features.2.weight": 200,
    "classifier.1.weight": 450,
    "classifier.3.weight": 100,
}


def with_tables(options: dict, tables: dict[str, int]) -> dict:
    """`gb.plan` options with a hashed table of `tables[name]` values per tile of `name`."""
    overrides = {
        k: dict(v) if isinstance(v, dict) else v for k, v in options.get("overrides", {}).items()
    }
    for name, buckets in tables.items():
        overrides[name] = {**overrides.get(name, {}), "hashed": buckets}
    return {**options, "overrides": overrides}


@dataclass(frozen=True)
class Task:
    """A model family at several sizes, the gbfunc genomes to compare, and the protocol.

    Attributes:
        name: The task in titles.
        dense: The full-size model in tables.
        build: The model at a width (`None`: the full-size model).
        widths: Widths the narrow baseline may take.
        genomes: `(ratio label, arm label, gb.plan options)` of the gbfunc arms.
        factored: Weights the low-rank baseline factors (the rest stays free); empty: every
            parameter with two or more dimensions.
        steps, batch, seeds: The protocol's training length and repeats.
        data: Builds the task's `Data`.
        metric: `"val_acc"` (higher is better) or `"val_loss"` (lower is better).
        lrs: Learning rates swept per family.
        arm_lrs: Learning rates swept for the gbfunc arm of this label instead of its family's.
        free_lr_factor: A gbfunc arm's free tensors train at this times its g-net rate.
        calibrate: Start gbfunc arms with `gb.calibrate` on a training batch.
    """

    name: str
    dense: str
    build: Callable[[int | None], nn.Module]
    widths: range
    genomes: tuple[tuple[str, str, dict], ...]
    factored: tuple[str, ...]
    steps: int
    batch: int
    seeds: int = 3
    data: Callable[[], Data] = digits_data
    metric: str = "val_acc"
    lrs: dict[str, tuple[float, ...]] = field(default_factory=lambda: DIGITS_LRS)
    arm_lrs: dict[str, tuple[float, ...]] = field(default_factory=dict)
    free_lr_factor: float = 0.1
    calibrate: bool = True

    def better(self, a: float, b: float) -> bool:
        """Whether score `a` beats score `b` on this task's metric."""
        return a > b if self.metric == "val_acc" else a < b


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
            (
                "~20x, hashed genome",
                HASHED,
                with_tables(MLP_HASHED, {"1.weight": 1850, "3.weight": 290}),
            ),
            (
                "~100x, hashed genome",
                HASHED,
                with_tables(paper_genome(4), {"1.weight": 280, "3.weight": 60}),
            ),
            (
                "~300x, hashed genome",
                HASHED,
                with_tables(paper_genome(2), {"1.weight": 50, "3.weight": 15}),
            ),
        ),
        ("1.weight", "3.weight"),
        1000,
        128,
        arm_lrs={HASHED: (0.01, 0.03, 0.1, 0.3)},  # the tables' rate is the g-nets' (HASH_GAIN)
        calibrate=False,  # measured: it lowers the paper genome's accuracy here (--calibrate)
    ),
    "cnn": Task(
        "digits CNN (main job)",
        "channels (32, 64), hidden 128",
        lambda w: DigitsCNN() if w is None else DigitsCNN((w, 2 * w), 4 * w),
        range(1, 33),
        (
            ("~23x", "tiled genome", TILED_CNN),
            # the first classifier layer's inputs labelled by (channel, row, column)
            (
                "~135x",
                "paper genome H=10",
                paper_genome(10, "classifier.1.weight", (64, 4, 4), "classifier.3.*"),
            ),
            ("~23x, hashed genome", HASHED, DigitsConfig().plan),  # the main job's
            (
                "~135x, hashed genome",
                HASHED,
                with_tables({"tile": "full", "hidden": 2}, CNN_TABLES_135X),
            ),
        ),
        ("features.0.weight", "features.2.weight", "classifier.1.weight", "classifier.3.weight"),
        400,
        64,
        lrs=CNN_LRS,
        arm_lrs={HASHED: (0.01, 0.03, 0.1, 0.3)},
    ),
    "charlm": Task(
        "character transformer (main job)",
        "width 128, 2 blocks",
        charlm_model,
        range(4, 129, 4),
        (
            (
                "~5x",
                "tiles 64x64 H=32 P=2",
                {
                    "tile": (64, 64),
                    "hidden": 32,
                    "outputs": 2,
                    "overrides": {"head.weight": "free"},
                },
            ),
            (
                "~20x",
                "tiles 64x64 H=8 P=8, embeddings and head generated",
                {"tile": (64, 64), "hidden": 8, "outputs": 8, "embeddings": True},
            ),
            (
                "~5x, hashed genome",
                HASHED,
                {**CHARLM_HASHED, "hashed": 420, "overrides": {"head.weight": "free"}},
            ),
            ("~20x, hashed genome", HASHED, {**CHARLM_HASHED, "hashed": 124, "embeddings": True}),
        ),
        (),
        800,
        32,
        seeds=1,
        data=charlm_data,
        metric="val_loss",
        lrs=CHARLM_LRS,
        arm_lrs={HASHED: (0.02, 0.04, 0.08)},  # 0.04 was the best of 0.01, 0.02, 0.04 at ~5x
        free_lr_factor=0.5,  # the main job's measured pair: g-nets 2e-2, free tensors 1e-2
        calibrate=False,  # not measured on the transformer
    ),
}


@dataclass(frozen=True)
class Arm:
    """One trainable configuration: its family, its tree and how the tree becomes weights.

    `lr_scales` maps a top-level key of `tree` to a factor of the swept learning rate.
    """

    family: str
    label: str
    model: nn.Module
    tree: dict
    to_params: Callable[[dict], dict[str, Tensor]]
    params: int
    lr_scales: dict[str, float] = field(default_factory=dict)


def gbfunc_arm(task: Task, label: str, options: dict, seed: int, data: Data) -> tuple[Arm, gb.Plan]:
    """The gbfunc arm planned with `options` (calibrated if the task says so), and its plan."""
    torch.manual_seed(seed)
    model = task.build(None)
    plan = gb.plan(model, **options)
    gparams = gb.init(plan, seed=seed)
    if task.calibrate:
        x, _ = data.sample(torch.Generator().manual_seed(seed), CALIBRATION_BATCH)
        gparams = gb.calibrate(gparams, plan, model, x)
    ours = gb.report(plan).stored_params
    free_lr = {"free": task.free_lr_factor}
    arm = Arm("gbfunc", label, model, gparams, lambda t: gb.apply(t, plan), ours, free_lr)
    return arm, plan


def arms_at(task: Task, label: str, options: dict, seed: int, data: Data) -> list[Arm]:
    """The gbfunc arm planned with `options`, and its baselines at its parameter count."""
    arm, _ = gbfunc_arm(task, label, options, seed, data)
    model, ours = arm.model, arm.params
    arms = [arm]
    width, _ = narrowest_match(task.build, ours, task.widths)
    torch.manual_seed(seed)
    narrow = task.build(width)
    tree = {k: v.detach().clone().requires_grad_() for k, v in narrow.named_parameters()}
    arms.append(Arm("narrow", f"width {width}", narrow, tree, lambda t: t, count(narrow)))
    params = dict(model.named_parameters())
    factored = task.factored or tuple(weight_matrices(model))
    free = sum(v.numel() for k, v in params.items() if k not in factored)
    budget = factor_budget(model, factored, ours)
    if budget is not None:
        tree, to_params = low_rank(model, list(factored), budget, seed=seed)
        arms.append(Arm("low rank", "U V^T", model, tree, to_params, tree_count(tree)))
    if ours >= free + len(factored):  # room for one shared value per weight
        tree, to_params = hashed(model, list(factored), ours - free, seed=seed)
        arms.append(Arm("hashed", "HashedNets", model, tree, to_params, tree_count(tree)))
    return arms


Teacher = Callable[[Tensor], Tensor]
StepHook = Callable[[int, Tensor, torch.optim.Optimizer], Callable[[], None] | None]


def train(
    arm: Arm,
    lr: float,
    data: Data,
    steps: int,
    batch: int,
    seed: int,
    teacher: Teacher | None = None,
    *,
    warmup: int | None = None,
    hook: StepHook | None = None,
) -> tuple[float, float]:
    """Validation `(loss, accuracy)` of `arm` after `steps` of the shared protocol.

    With a `teacher` (inputs to logits) the loss mixes in distillation towards its logits.
    `warmup`: steps of the linear warm-up (default a tenth of `steps`, at most 100). `hook`:
    called after each backward as `hook(step, loss, optimizer)` (it may change the gradients
    or the groups' settings); what it returns, if anything, is called after the update.
    """
    groups = [
        {
            "params": [v for v in tree_leaves(part) if v.requires_grad],
            "lr": lr * arm.lr_scales.get(key, 1.0),
        }
        for key, part in arm.tree.items()
    ]
    optimizer = torch.optim.Adam([g for g in groups if g["params"]])
    warmup = max(1, min(100, steps // 10)) if warmup is None else warmup
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda t: min(1.0, (t + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, t / steps))),
    )
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        x, y = data.sample(gen, batch)
        logits = functional_call(arm.model, arm.to_params(arm.tree), (x,))
        loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
        if teacher is not None:
            loss = distill(loss, logits, teacher(x))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        after = hook(step, loss, optimizer) if hook is not None else None
        optimizer.step()
        if after is not None:
            after()
        schedule.step()
    return data.validate(arm.model, arm.to_params(arm.tree))


def distill(ce: Tensor, logits: Tensor, target: Tensor) -> Tensor:
    """Hinton et al.'s mix of cross-entropy and temperature-softened KL to a teacher."""
    t = DISTILL_TEMPERATURE
    kl = F.kl_div(
        F.log_softmax(logits.flatten(0, -2) / t, -1),
        F.log_softmax(target.flatten(0, -2) / t, -1),
        log_target=True,
        reduction="batchmean",
    )
    return (1 - DISTILL_WEIGHT) * ce + DISTILL_WEIGHT * t * t * kl


def run(
    task: Task,
    seeds: int,
    steps: int,
    distilled: bool = False,
    families: tuple[str, ...] = FAMILIES,
) -> list[dict[str, Any]]:
    """One row per (ratio, family, lr, seed) of `families`, the dense model first."""
    data = task.data()
    rows = []
    for seed in range(seeds):
        torch.manual_seed(seed)
        dense = task.build(None)
        full = count(dense)
        tree = {k: v.detach().clone().requires_grad_() for k, v in dense.named_parameters()}
        groups = [("dense", [Arm("dense", task.dense, dense, tree, lambda t: t, full)])]
        groups += [
            (ratio, arms_at(task, label, opts, seed, data)) for ratio, label, opts in task.genomes
        ]
        teacher, best = None, None
        for ratio, arms in groups:
            for arm in (a for a in arms if a.family in families):
                lrs = task.arm_lrs.get(arm.label) if arm.family == "gbfunc" else None
                for lr in lrs or task.lrs[arm.family]:
                    fresh = [v.detach().clone() for v in tree_leaves(arm.tree)]
                    start = time.perf_counter()
                    guide = None if arm.family == "dense" else teacher
                    loss, acc = train(arm, lr, data, steps, task.batch, seed, guide)
                    score = acc if task.metric == "val_acc" else loss
                    if (
                        distilled
                        and arm.family == "dense"
                        and (best is None or task.better(score, best))
                    ):
                        best, teacher = score, _frozen_teacher(arm)
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
                            "val_loss": loss,
                            "val_acc": acc,
                            "seconds": time.perf_counter() - start,
                        }
                    )
                    print(
                        f"seed {seed} {ratio:>6} {arm.family:<8} {arm.label:<18} "
                        f"{arm.params:>7,} lr {lr:<6g} loss {loss:.4f} acc {100 * acc:.2f}",
                        flush=True,
                    )
    return rows


def _frozen_teacher(arm: Arm) -> Teacher:
    """The arm's model with its current parameters, as a no-grad function of the inputs."""
    params = {k: v.detach().clone() for k, v in arm.to_params(arm.tree).items()}

    @torch.no_grad()
    def logits(x: Tensor) -> Tensor:
        return functional_call(arm.model, params, (x,))

    return logits


def summarise(rows: list[dict[str, Any]], metric: str = "val_acc") -> list[dict[str, Any]]:
    """Per (ratio, family, arm): the best lr by the mean `metric` over seeds, its mean, std and
    spread (best minus worst seed)."""
    sign = 1 if metric == "val_acc" else -1
    out = []
    keys = dict.fromkeys((r["ratio"], r["family"], r["arm"]) for r in rows)
    for ratio, family, arm in keys:
        group = [r for r in rows if (r["ratio"], r["family"], r["arm"]) == (ratio, family, arm)]
        by_lr: dict[float, list[float]] = {}
        for r in group:
            by_lr.setdefault(r["lr"], []).append(r[metric])
        lr = max(by_lr, key=lambda k: sign * statistics.fmean(by_lr[k]))
        scores = by_lr[lr]
        out.append(
            {
                "ratio": ratio,
                "family": family,
                "arm": arm,
                "params": group[0]["params"],
                "compression": group[0]["compression"],
                "lr": lr,
                "lrs": sorted(by_lr),
                "metric": metric,
                "score": statistics.fmean(scores),
                "score_std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
                "spread": max(scores) - min(scores),
                "seeds": len(scores),
                "seconds": statistics.fmean(r["seconds"] for r in group),
            }
        )
    return out


def _shown(metric: str, value: float) -> str:
    return f"{100 * value:.2f}" if metric == "val_acc" else f"{value:.4f}"


def table(summary: list[dict[str, Any]]) -> str:
    metric = summary[0]["metric"]
    heading = "val acc %" if metric == "val_acc" else "val loss (nats)"
    columns = [("ratio", "l"), ("family", "l"), ("arm", "l")] + [
        (t, "r") for t in ("trainable params", "compression", "best lr", heading, "s/run")
    ]
    rows = (
        [
            s["ratio"],
            s["family"],
            s["arm"],
            f"{s['params']:,}",
            f"{s['compression']:.1f}x",
            f"{s['lr']:g} of {', '.join(f'{v:g}' for v in s['lrs'])}",
            _shown(metric, s["score"])
            + (f" ± {_shown(metric, s['score_std'])}" if s["seeds"] > 1 else " (1 seed)"),
            f"{s['seconds']:.1f}",
        ]
        for s in summary
    )
    return markdown_table(columns, rows)


def findings(summary: list[dict[str, Any]], families: tuple[str, ...] = FAMILIES) -> str:
    """Per ratio: gbfunc's margin over each baseline trained (positive: gbfunc is better), with
    each arm's seed spread (best minus worst seed at its best lr) where it ran several."""
    metric = summary[0]["metric"]
    if "gbfunc" not in families:
        return "- gbfunc was not trained in this run: compare with the run of every family."
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
            if metric == "val_acc":
                margin = f"{100 * (ours['score'] - s['score']):+.2f} pt"
            else:
                margin = f"{s['score'] - ours['score']:+.3f} nats"
            spread = f"; spread {_shown(metric, s['spread'])}" if s["seeds"] > 1 else ""
            parts.append(f"{margin} vs {family} ({s['params']:,} params{window}{spread})")
        for family in ("low rank", "hashed"):
            if family in families and family not in group:
                parts.append(f"{family} infeasible (the free parameters alone exceed the budget)")
        if not parts:
            parts.append("no baseline trained in this run")
        unit = "%" if metric == "val_acc" else " nats"
        seeds = (
            f"mean of {ours['seeds']} seeds, spread {_shown(metric, ours['spread'])}"
            if ours["seeds"] > 1
            else "1 seed"
        )
        lines.append(
            f"- **{ratio}** (gbfunc {ours['params']:,} params, "
            f"{_shown(metric, ours['score'])}{unit}, {seeds}): " + "; ".join(parts)
        )
    return "\n".join(lines)


def _series(row: dict[str, Any]) -> str:
    """The plot line of a summary row: its family, gbfunc's hashed genome on its own."""
    return f"gbfunc, {HASHED}" if row["arm"] == HASHED else row["family"]


def _off_scale(values: list[float], keep: list[float]) -> tuple[float, float]:
    """The y-range that shows `values` close together: extreme points (at most a third of
    them, from either end, leaving at least 3) whose gap to the rest is over twice the rest's
    whole span fall outside it. `keep` (the dense line) always stays in the range."""
    v = sorted(values)
    lo, hi = 0, len(v)
    cut = min(len(v) // 3, len(v) - 3)
    for k in range(1, cut + 1):  # the most points cut below that leave a clear gap
        if v[k] - v[k - 1] > 2 * (max([v[-1], *keep]) - v[k]):
            lo = k
    for k in range(1, cut + 1 - lo):  # the same above
        if v[-k] - v[-k - 1] > 2 * (v[-k - 1] - min([v[lo], *keep])):
            hi = len(v) - k
    return min([v[lo], *keep]), max([v[hi - 1], *keep])


def plot(summary: list[dict[str, Any]], path: Path, title: str, stamp_line: str) -> None:
    """The score against trainable parameters (log), one line per family; `stamp_line` at the
    foot. The y-range is the points' that lie close together: a point far off it (low rank's
    collapse) is marked at the axis's edge with its value, so the 1-point gaps stay visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    from matplotlib.transforms import offset_copy

    metric = summary[0]["metric"]
    scale = 100 if metric == "val_acc" else 1
    fig, ax = plt.subplots(figsize=(FIGURE_WIDTH, 4.8), layout="constrained")
    drawn: list[tuple[float, float, float, str, str]] = []  # x, y, std, series, colour
    for series, color in (
        ("gbfunc", "tab:orange"),
        (f"gbfunc, {HASHED}", "tab:red"),
        ("narrow", "tab:blue"),
        ("low rank", "tab:green"),
        ("hashed", "tab:purple"),
    ):
        # One point per parameter count (a baseline trained at two ratios' budgets is one).
        points = sorted(
            {s["params"]: s for s in summary if _series(s) == series}.items(), key=lambda p: p[0]
        )
        if points:
            ax.errorbar(
                [p for p, _ in points],
                [scale * s["score"] for _, s in points],
                [scale * s["score_std"] for _, s in points],
                fmt="o-",
                color=color,
                label=series,
                capsize=3,
            )
            drawn += [
                (p, scale * s["score"], scale * s["score_std"], series, color) for p, s in points
            ]
    dense = [scale * s["score"] for s in summary if s["family"] == "dense"]
    for y in dense:
        ax.axhline(y, color="gray", ls=":", label="dense, full size")
    if drawn:
        lo, hi = _off_scale([d[1] for d in drawn], dense)
        shown = [d for d in drawn if lo <= d[1] <= hi]
        bottom = min([d[1] - d[2] for d in shown] + dense)
        top = max([d[1] + d[2] for d in shown] + dense)
        pad = 0.08 * (top - bottom or 1)
        below = [d for d in drawn if d[1] < lo]
        above = [d for d in drawn if d[1] > hi]
        ax.set_ylim(bottom - pad * (2.5 if below else 1), top + pad * (2.5 if above else 1))
    ax.set(
        xscale="log",
        xlabel="trainable parameters (log scale)",
        ylabel="validation accuracy (%)" if metric == "val_acc" else "validation loss (nats)",
        title=f"{title}: equal-parameter comparison",
    )
    ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 3, 5, 7)))
    ax.xaxis.set_minor_locator(LogLocator(subs=(1, 2, 3, 4, 5, 6, 7, 8, 9)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3, which="both")
    if drawn:  # the points off the range: a marker on the edge, labelled with the value
        x0, x1 = (math.log(x) for x in ax.get_xlim())
        edge = ax.get_xaxis_transform()  # x in data, y in axes fraction
        unit = "%" if metric == "val_acc" else " nats"
        digits = 1 if metric == "val_acc" else 3
        for x, y, std, series, color in below + above:
            at, marker, sign = (0.03, "v", "↓") if y < lo else (0.97, "^", "↑")
            ax.plot([x], [at], marker=marker, ms=9, color=color, transform=edge, clip_on=False)
            spread = f" ± {std:.{digits}f}" if std else ""
            right = (math.log(x) - x0) / (x1 - x0) > 0.5
            ax.annotate(
                f"{series}: {y:.{digits}f}{spread}{unit} {sign}",
                (x, at),
                xycoords=edge,
                xytext=(-9 if right else 9, 0),
                textcoords="offset points",
                ha="right" if right else "left",
                va="center",
                fontsize=9,
                color=color,
            )
    below_axis = offset_copy(ax.transAxes, fig, y=-0.55, units="inches")  # under the x label
    ax.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, 0),
        bbox_transform=below_axis,
        ncols=3,
        fontsize=9,
        frameon=False,
    )
    foot = stamp(fig, stamp_line)
    fig.get_layout_engine().set(rect=(0, foot, 1, 1 - foot))  # left, bottom, width, height
    save_figure(fig, path)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="mlp")
    parser.add_argument("--quick", action="store_true", help="1 seed, a third of the steps")
    parser.add_argument("--distill", action="store_true", help="distil every arm from dense")
    parser.add_argument(
        "--calibrate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start gbfunc arms with gb.calibrate (default: the task's choice)",
    )
    parser.add_argument(
        "--families",
        nargs="+",
        choices=FAMILIES,
        default=FAMILIES,
        help="train only these (the file name says which); dense is the teacher of --distill",
    )
    parser.add_argument(
        "--arm", help="train only the gbfunc genomes of this arm label, e.g. 'hashed genome'"
    )
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1 (default: the task's)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="only redraw the plot and rewrite the CSV of a results file",
    )
    parser.add_argument(
        "--margins",
        type=Path,
        metavar="JSON",
        help="only rewrite the margins section of a results file's .md from its runs",
    )
    return parser


def _configure(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[Task, int, int, str]:
    """The task as the arguments change it, its seeds and steps, and its results' file suffix."""
    task = TASKS[args.task]
    if args.calibrate is not None and args.calibrate != task.calibrate:
        task = replace(task, calibrate=args.calibrate)
        suffix = "_calibrated" if args.calibrate else "_uncalibrated"
    else:
        suffix = ""
    if args.arm:
        genomes = tuple(g for g in task.genomes if g[1] == args.arm)
        if not genomes:
            parser.error(f"--arm {args.arm!r}: no such arm in {[g[1] for g in task.genomes]}")
        task = replace(task, genomes=genomes)
        suffix += "_" + args.arm.replace(" ", "_")
    seeds, steps = (1, task.steps // 3) if args.quick else (task.seeds, task.steps)
    if args.seeds is not None:
        seeds = args.seeds
        suffix += f"_{seeds}_seeds"
    return task, seeds, steps, suffix


def _report(
    task: Task,
    seeds: int,
    steps: int,
    distill: bool,
    seconds: float,
    summary: list[dict[str, Any]],
    families: tuple[str, ...],
) -> str:
    """The results file's markdown."""
    return (
        header_md(f"gbfunc vs narrow, low-rank and hashed models at equal parameters ({task.name})")
        + f"- {seeds} seed(s), {steps} steps, batch {task.batch}; "
        + f"total {seconds:.0f} s\n"
        + "- lr sweeps: "
        + ", ".join(f"{family} {lrs}" for family, lrs in task.lrs.items())
        + "".join(f", gbfunc's {label} {lrs}" for label, lrs in task.arm_lrs.items())
        + f"; a gbfunc arm's free tensors at {task.free_lr_factor:g}x its rate\n"
        + f"- gbfunc arms start from gb.calibrate: {'yes' if task.calibrate else 'no'}\n"
        + (
            f"- distilled from the dense model: weight {DISTILL_WEIGHT}, "
            f"temperature {DISTILL_TEMPERATURE}\n"
            if distill
            else ""
        )
        + "".join(
            f"- {ratio} {label}: `gb.plan(model, **{opts})`\n"
            for ratio, label, opts in task.genomes
        )
        + "\n"
        + table(summary)
        + MARGINS
        + findings(summary, families)
        + "\n"
    )


def rewrite_margins(saved_json: Path) -> None:
    """Rewrite the margins section of the results file beside `saved_json` from the runs it
    holds (the rest of the file, its provenance included, is kept): for a change in how the
    margins are told, not in what was measured."""
    saved = json.loads(saved_json.read_text())
    rows = saved["rows"]
    summary = summarise(rows, saved["summary"][0]["metric"])
    families = tuple(dict.fromkeys(r["family"] for r in rows if r["ratio"] != "dense"))
    path = saved_json.with_suffix(".md")
    text = path.read_text()
    start = text.index(MARGINS) + len(MARGINS)
    end = text.find(f"\n{NOTES}", start)
    end = len(text) if end < 0 else end
    path.write_text(text[:start] + findings(summary, families) + "\n" + text[end:])


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.margins:
        rewrite_margins(args.margins)
        return
    if args.replot:
        saved = json.loads(args.replot.read_text())
        stamp = provenance_line(saved["provenance"])
        plot(saved["summary"], args.replot.with_suffix(".png"), TASKS[args.task].name, stamp)
        write_csv(args.replot.with_suffix(".csv"), saved["rows"], saved["provenance"])
        return
    torch.set_num_threads(1)
    task, seeds, steps, suffix = _configure(args, parser)
    started = time.perf_counter()
    families = tuple(args.families)
    if args.distill and "dense" not in families:
        families = ("dense", *families)
    rows = run(task, seeds, steps, args.distill, families)
    summary = summarise(rows, task.metric)
    name = "equal_params" + ("" if args.task == "mlp" else f"_{args.task}")
    name += suffix + ("_distill" if args.distill else "")
    if families != FAMILIES:
        name += "_" + "_".join(f.replace(" ", "_") for f in families)
    stem = args.out / (name + ("_quick" if args.quick else ""))
    stem.parent.mkdir(parents=True, exist_ok=True)
    seconds = time.perf_counter() - started
    text = _report(task, seeds, steps, args.distill, seconds, summary, families)
    print("\n" + table(summary) + "\n" + findings(summary, families))
    write_results(stem.with_suffix(".md"), text)
    write_json(stem.with_suffix(".json"), rows, summary=summary)
    write_csv(stem.with_suffix(".csv"), rows)
    plot(summary, stem.with_suffix(".png"), task.name, provenance_line())
    print(f"wrote {stem}.{{md,json,csv,png}}")


if __name__ == "__main__":
    main()
