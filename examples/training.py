"""Side-by-side training of a dense model and its gbfunc twin, shared by the examples.

An `Arm` is one side of the comparison: a pytree of tensors (the model's own parameters, or
gparams), how it becomes the model's parameters (identity, or `gb.apply`), and its AdamW
optimizer. `train` steps several arms on the same batches and records their curves; `plot`
draws them.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves
from tqdm import tqdm

import gbfunc as gb
from examples.baselines import factor_budget, low_rank, weight_matrices

Tree = dict[str, Any]  # a pytree of tensors: a model's parameters, or gparams
Batches = Iterator[tuple[Tensor, Tensor]]
BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar:16}| {elapsed}<{remaining} {rate_fmt}{postfix}"


@dataclass(frozen=True)
class TrainConfig:
    """A side-by-side run: steps, batch, plan, optimizer, schedule and evaluation cadence.

    Attributes:
        plan: Keyword arguments of `gb.plan`.
        lr_dense: Peak learning rate of every directly trained tensor (both arms).
        lr_gb_scale: The g-nets' peak learning rates are `gb.optim.param_groups`' defaults
            (by the g-nets' activation, and for hashed tables) times this.
        lr_narrow: Peak learning rate of the narrow equal-parameter arm (default `lr_dense`).
        lr_low_rank: Peak learning rate of the low-rank equal-parameter arm (default
            `lr_dense`).
        warmup: Linear warmup steps before the cosine decay (None: `gb.optim.schedule`'s
            default, a quarter of the steps).
        eval_every: Steps between validation points on the curves.
        compile: `torch.compile` each arm's loss.
        seed: The (first) seed of the initialisation and of the batches.
        seeds: How many seeds, from `seed` on, the main job trains every arm with.
        arm_seeds: Fewer (or more) seeds for the arms named here, e.g. `{"dense": 1}`.
    """

    steps: int
    batch: int
    plan: Mapping[str, Any]
    lr_dense: float = 1e-2
    lr_gb_scale: float = 1.0
    lr_narrow: float | None = None
    lr_low_rank: float | None = None
    weight_decay: float = 0.0
    warmup: int | None = None
    eval_every: int = 50
    compile: bool = False
    seed: int = 0
    seeds: int = 3
    arm_seeds: Mapping[str, int] = field(default_factory=dict)


@dataclass
class Arm:
    """One side of the comparison: a pytree, how it becomes the model's parameters, its optimizer.

    Attributes:
        name: `"dense"`, `"gb"`, `"narrow"` or `"low rank"`.
        tree: What the optimizer trains: the model's parameters, or gparams.
        to_params: `tree -> {name: tensor}` for `functional_call` (identity, or `gb.apply`).
        loss: `(tree, x, y) -> scalar loss`, possibly compiled.
        optimizer: AdamW over the trainable leaves of `tree`.
        schedule: Warmup then cosine decay of the learning rate.
        model: The module `to_params(tree)` is called with (a narrower one for a narrow arm).
    """

    name: str
    tree: Tree
    to_params: Callable[[Tree], dict[str, Tensor]]
    loss: Callable[[Tree, Tensor, Tensor], Tensor]
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    model: nn.Module

    def step(self, x: Tensor, y: Tensor) -> float:
        """One training step; returns the batch loss before the update."""
        loss = self.loss(self.tree, x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return loss.item()

    def trainable(self) -> int:
        """Trainable elements of `tree`: the arm's size in the equal-parameter comparison."""
        return sum(leaf.numel() for leaf in tree_leaves(self.tree) if leaf.requires_grad)

    @torch.no_grad()
    def params(self) -> dict[str, Tensor]:
        """The model's parameters now, without autograd history."""
        return self.to_params(self.tree)


@dataclass
class Curves:
    """Loss per training step, and validation scores at the evaluation steps, by arm name."""

    train: dict[str, list[float]]
    val_steps: list[int]
    val_loss: dict[str, list[float]]
    val_acc: dict[str, list[float]]

    @classmethod
    def empty(cls, names: Sequence[str]) -> "Curves":
        return cls({n: [] for n in names}, [], {n: [] for n in names}, {n: [] for n in names})


def make_arm(
    name: str,
    model: nn.Module,
    tree: Tree,
    to_params: Callable[[Tree], dict[str, Tensor]],
    groups: list[dict],
    cfg: TrainConfig,
) -> Arm:
    """An `Arm` minimising cross-entropy of `functional_call(model, to_params(tree), (x,))`.

    `groups` are its AdamW parameter groups with their peak learning rates (`at_rate`, or
    `gb.optim.param_groups`).
    """

    def loss(tree: Tree, x: Tensor, y: Tensor) -> Tensor:
        logits = functional_call(model, to_params(tree), (x,))
        return F.cross_entropy(logits.flatten(0, -2), y.flatten())

    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=cfg.weight_decay)
    schedule = gb.optim.schedule(optimizer, cfg.steps, warmup=cfg.warmup)
    # Every arm compiles this same `loss`: without dynamic=False the second arm's shapes would
    # make dynamo recompile it with symbolic sizes, which inductor runs several times slower.
    compiled = torch.compile(loss, dynamic=False) if cfg.compile else loss
    return Arm(name, tree, to_params, compiled, optimizer, schedule, model)


def at_rate(tree: Tree, lr: float) -> list[dict]:
    """One parameter group: every leaf of `tree` that requires grad, at peak rate `lr`."""
    return [{"params": [leaf for leaf in tree_leaves(tree) if leaf.requires_grad], "lr": lr}]


def dense_and_gb(
    model: nn.Module, plan: gb.Plan, cfg: TrainConfig, device: torch.device
) -> tuple[Arm, Arm]:
    """`(dense, gb)`: the model's own initial parameters, and `gb.init(plan)`'s g-nets.

    The g-nets train at `gb.optim.param_groups`' default rates (times `cfg.lr_gb_scale`);
    every directly trained tensor (all of the dense model, the free parameters of the gbfunc
    one) at `cfg.lr_dense`.
    """
    dense = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    gparams = gb.init(plan, seed=cfg.seed, device=device)
    groups = gb.optim.param_groups(gparams, plan, free_lr=cfg.lr_dense, scale=cfg.lr_gb_scale)
    return (
        make_arm("dense", model, dense, lambda t: t, at_rate(dense, cfg.lr_dense), cfg),
        make_arm("gb", model, gparams, lambda t: gb.apply(t, plan), groups, cfg),
    )


def trainable_count(model: nn.Module) -> int:
    """Trainable parameters of `model` (tied ones once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def narrowest_match(
    build: Callable[[int], nn.Module], target: int, widths: Sequence[int]
) -> tuple[int, nn.Module]:
    """`(width, build(width))` whose trainable parameter count is nearest `target`."""
    width = min(widths, key=lambda w: abs(trainable_count(build(w)) - target))
    return width, build(width)


def narrow_arm(
    build: Callable[[int], nn.Module],
    target: int,
    widths: Sequence[int],
    cfg: TrainConfig,
    device: torch.device,
) -> Arm:
    """A dense arm of the narrower model whose parameter count is nearest `target`.

    Built under `cfg.seed`; trains every tensor at `cfg.lr_narrow` (default `cfg.lr_dense`).
    """
    torch.manual_seed(cfg.seed)
    _, model = narrowest_match(build, target, widths)
    model = model.to(device)
    tree = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    lr = cfg.lr_dense if cfg.lr_narrow is None else cfg.lr_narrow
    return make_arm("narrow", model, tree, lambda t: t, at_rate(tree, lr), cfg)


def low_rank_arm(
    model: nn.Module, target: int, cfg: TrainConfig, device: torch.device
) -> Arm | None:
    """`model` with every weight of 2 or more dims as `U @ V.T`, `target` parameters in all.

    Biases and norms train as they are; the factors take what is left of `target`, spread
    over the weights by size (`examples.baselines.low_rank`). Trains every tensor at
    `cfg.lr_low_rank` (default `cfg.lr_dense`). `None` when rank 1 everywhere does not fit.
    """
    names = weight_matrices(model)
    budget = factor_budget(model, names, target)
    if budget is None:
        return None
    tree, to_params = low_rank(model, names, budget, seed=cfg.seed)
    tree = {k: v.detach().to(device).requires_grad_() for k, v in tree.items()}
    lr = cfg.lr_dense if cfg.lr_low_rank is None else cfg.lr_low_rank
    return make_arm("low rank", model, tree, to_params, at_rate(tree, lr), cfg)


@torch.no_grad()
def evaluate(
    model: nn.Module, params: dict[str, Tensor], x: Tensor, y: Tensor, batch: int
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of `model` with `params` over `(x, y)`, in batches."""
    total_loss, correct, count = 0.0, 0, 0
    for lo in range(0, len(x), batch):
        logits = functional_call(model, params, (x[lo : lo + batch],)).flatten(0, -2)
        target = y[lo : lo + batch].flatten()
        total_loss += F.cross_entropy(logits, target, reduction="sum").item()
        correct += int((logits.argmax(-1) == target).sum())
        count += target.numel()
    return total_loss / count, correct / count


def train(
    arms: Sequence[Arm],
    batches: Batches,
    validate: Callable[[Arm], tuple[float, float]],
    cfg: TrainConfig,
    desc: str,
    bar: bool = True,
) -> Curves:
    """Step every arm on the same batches, validating every `cfg.eval_every` steps and at the end.

    The progress bar (none where `bar` is false) shows each arm's train loss (mean of the last
    20 steps) and its last validation loss.
    """
    curves = Curves.empty([a.name for a in arms])
    steps = range(1, cfg.steps + 1)
    progress = tqdm(steps, desc=desc, dynamic_ncols=True, bar_format=BAR_FORMAT, disable=not bar)
    for step in progress:
        x, y = next(batches)
        for arm in arms:
            curves.train[arm.name].append(arm.step(x, y))
        if step % cfg.eval_every == 0 or step == cfg.steps:
            curves.val_steps.append(step)
            for arm in arms:
                loss, acc = validate(arm)
                curves.val_loss[arm.name].append(loss)
                curves.val_acc[arm.name].append(acc)
        shown = ["train/val"]
        for arm in arms:
            recent = curves.train[arm.name][-20:]
            val = f"{curves.val_loss[arm.name][-1]:.3f}" if curves.val_steps else "-"
            shown.append(f"{arm.name} {sum(recent) / len(recent):.3f}/{val}")
        progress.set_postfix_str("  ".join(shown), refresh=False)
    progress.close()
    return curves


def plot(
    curves: Curves,
    path: Path,
    title: str,
    *,
    baseline: tuple[float, str] | None = None,
    accuracy: bool = False,
) -> None:
    """Smoothed train and validation loss of every arm, and a validation accuracy panel.

    Args:
        curves: From `train`.
        path: PNG to write.
        title: Title of the loss panel.
        baseline: `(loss, label)` drawn as a horizontal line on the loss panel.
        accuracy: Add the accuracy panel.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    colors = dict(
        zip(curves.train, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=False)
    )
    panels = 2 if accuracy else 1
    fig, axes = plt.subplots(1, panels, figsize=(4 + 3.5 * panels, 4.2), squeeze=False)
    ax = axes[0, 0]
    for name, losses in curves.train.items():
        color = colors[name]
        steps = range(1, len(losses) + 1)
        ax.plot(steps, _smooth(losses), color=color, alpha=0.45, lw=1, label=f"{name} train")
        val = curves.val_loss[name]
        ax.plot(curves.val_steps, val, "o-", color=color, ms=3, lw=1.8, label=f"{name} val")
    if baseline is not None:
        ax.axhline(baseline[0], color="gray", ls="--", lw=1, label=baseline[1])
    ax.set(xlabel="step", ylabel="cross-entropy (nats)", title=title)
    if accuracy:
        acc_ax = axes[0, 1]
        for name, acc in curves.val_acc.items():
            percent = [100 * a for a in acc]
            acc_ax.plot(
                curves.val_steps, percent, "o-", color=colors[name], ms=3, label=f"{name} val"
            )
        acc_ax.set(xlabel="step", ylabel="accuracy (%)", title="validation accuracy", ylim=(0, 100))
    for a in axes.flat:
        a.grid(alpha=0.3)
        a.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _smooth(values: list[float], span: int = 20) -> list[float]:
    """Exponential moving average, so noisy per-batch losses read as a curve."""
    out, ema, alpha = [], values[0], 2 / (span + 1)
    for v in values:
        ema = alpha * v + (1 - alpha) * ema
        out.append(ema)
    return out
