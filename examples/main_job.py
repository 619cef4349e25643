"""The main job: dense and genomic-bottleneck models trained side by side on real data.

Every task uses data that ships with Python or a package, so nothing is downloaded:

- `charlm`: a character-level GPT-like transformer on Python's own help text (`pydoc_data`),
  with the hashed genome at ~20x of the whole model (embeddings and head generated too).
- `digits`: a small CNN on scikit-learn's 8x8 handwritten digits, with the hashed genome at
  ~23x.
- `mlp`: the paper's MLP shape (64-800-10) on the same digits, with the paper's genome
  (neuron labels, generated biases) at ~100x.

For each task the arms start from the same seed, see the same batches in the same order and
train with AdamW and the same schedule: the dense model, its gbfunc twin (g-nets generate its
weights from 20-100x fewer parameters; they have their own learning rate), and the two obvious
alternatives at the twin's size: a *narrow* dense model of the same architecture whose
parameter count is nearest, and a *low-rank* model (every weight as `U @ V.T`, as many
parameters in all) where rank 1 fits. The job prints the compression table and the
validation scores, saves the compressed model with `gb.save` and plots the curves.

    python -m examples.main_job                  # all tasks, 4-8 minutes on 2 CPU cores
    python -m examples.main_job --task charlm --steps 3000 --device cuda
"""

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

import gbfunc as gb
from examples.baselines import smallest_low_rank, weight_matrices
from examples.data import CharCorpus, char_batch, char_windows, digits_split, pydoc_text
from examples.models import CharTransformer, DigitsCNN, digits_mlp
from examples.tasks import EVAL_TOKENS, CharLMConfig, DigitsConfig, MLPConfig
from examples.training import (
    Arm,
    Batches,
    TrainConfig,
    dense_and_gb,
    evaluate,
    low_rank_arm,
    narrow_arm,
    plot,
    train,
)


@dataclass(frozen=True)
class Result:
    """What a task produced; `val_loss` / `val_acc` map arm name to the final score."""

    task: str
    report: gb.Report
    val_loss: dict[str, float]
    val_acc: dict[str, float]
    checkpoint: Path
    plot: Path
    seconds: float


def with_baselines(
    model: nn.Module, plan: gb.Plan, narrow: Arm, cfg: TrainConfig, device: torch.device
) -> list[Arm]:
    """Dense, gb, the `narrow` arm, and a low-rank arm of gb's size where rank 1 fits."""
    arms = [*dense_and_gb(model, plan, cfg, device), narrow]
    low_rank = low_rank_arm(model, gb.report(plan).stored_params, cfg, device)
    return arms if low_rank is None else [*arms, low_rank]


def finish(
    task: str,
    arms: Sequence[Arm],
    plan: gb.Plan,
    cfg: TrainConfig,
    final: dict[str, tuple[float, float]],
    out: Path,
    meta: dict[str, Any],
    started: float,
    plot_path: Path,
) -> Result:
    """Save the gb arm with `gb.save`, print every arm's final scores and size, package them."""
    rep = gb.report(plan)
    checkpoint = out / f"{task}_gb.safetensors"
    gb_tree = next(a.tree for a in arms if a.name == "gb")
    gb.save(
        checkpoint,
        gb_tree,
        plan,
        step=cfg.steps,
        meta={"task": task, "config": asdict(cfg), **meta},
    )
    loss = {name: v[0] for name, v in final.items()}
    acc = {name: v[1] for name, v in final.items()}
    print(
        f"[{task}] validation loss: {', '.join(f'{k} {v:.4f}' for k, v in loss.items())} "
        f"(gb/dense {loss['gb'] / loss['dense']:.3f}); "
        f"accuracy: {', '.join(f'{k} {100 * v:.2f}%' for k, v in acc.items())}"
    )
    counts = ", ".join(f"{a.name} {a.trainable():,}" for a in arms)
    missing = ""
    if "low rank" not in loss:
        smallest = smallest_low_rank(arms[0].model, weight_matrices(arms[0].model))
        missing = f"; no low rank: rank 1 for every weight needs {smallest:,}"
    print(
        f"[{task}] trainable parameters: {counts} (narrow: the width nearest gb's count{missing})"
    )
    print(
        f"[{task}] compression: {rep.generated_compression:.1f}x on the generated weights, "
        f"{rep.compression:.1f}x on the whole model; checkpoint {checkpoint} "
        f"({checkpoint.stat().st_size / 2**20:.2f} MiB; dense fp32 "
        f"{rep.dense_params * 4 / 2**20:.2f} MiB); plot {plot_path}"
    )
    return Result(task, rep, loss, acc, checkpoint, plot_path, time.perf_counter() - started)


def run_charlm(cfg: CharLMConfig, out: Path, device: torch.device) -> Result:
    """Train the character-level transformer dense and compressed; see the module docstring."""
    started = time.perf_counter()
    corpus = CharCorpus.from_text(pydoc_text())
    train_ids, val_ids = corpus.train.to(device), corpus.val.to(device)
    entropy = corpus.unigram_entropy()
    torch.manual_seed(cfg.seed)
    model = CharTransformer(corpus.vocab_size, cfg.context, cfg.width, cfg.depth, cfg.heads)
    model = model.to(device)
    plan = gb.plan(model, **cfg.plan)
    print(
        f"[charlm] {len(corpus.train):,} train / {len(corpus.val):,} val characters, "
        f"vocabulary {corpus.vocab_size}, unigram entropy {entropy:.3f} nats; plan {dict(cfg.plan)}"
    )
    print(gb.report(plan))
    narrow = narrow_arm(
        lambda w: CharTransformer(corpus.vocab_size, cfg.context, w, cfg.depth, cfg.heads),
        gb.report(plan).stored_params,
        range(cfg.heads, cfg.width + 1, cfg.heads),
        cfg,
        device,
    )
    arms = with_baselines(model, plan, narrow, cfg, device)
    val_x, val_y = char_windows(val_ids, cfg.context)
    # Curve points use evenly spaced windows; the final score uses every window.
    pick = torch.linspace(0, len(val_x) - 1, min(cfg.eval_windows, len(val_x))).long()
    eval_batch = max(1, EVAL_TOKENS // cfg.context)
    gen = torch.Generator().manual_seed(cfg.seed)

    def batches() -> Batches:
        while True:
            yield char_batch(train_ids, cfg.batch, cfg.context, gen)

    def validate(arm: Arm) -> tuple[float, float]:
        return evaluate(arm.model, arm.params(), val_x[pick], val_y[pick], eval_batch)

    curves = train(arms, batches(), validate, cfg, "charlm")
    final = {a.name: evaluate(a.model, a.params(), val_x, val_y, eval_batch) for a in arms}
    for arm in arms:
        print(f"[charlm] {arm.name:6s} sample: {sample(arm.model, arm.params(), corpus, cfg)!r}")
    title = f"char transformer on pydoc topics (gb: {gb.report(plan).generated_compression:.0f}x)"
    plot_path = out / "charlm_curves.png"
    plot(curves, plot_path, title, baseline=(entropy, "unigram entropy"))
    return finish(
        "charlm", arms, plan, cfg, final, out, {"chars": corpus.chars}, started, plot_path
    )


@torch.no_grad()
def sample(
    model: nn.Module, params: dict[str, Tensor], corpus: CharCorpus, cfg: CharLMConfig, n: int = 120
) -> str:
    """`n` characters drawn at temperature 0.8 after a prompt from the validation text."""
    gen = torch.Generator().manual_seed(cfg.seed)
    prompt = cfg.context // 2
    ids = corpus.val[:prompt].to(next(iter(params.values())).device)
    for _ in range(n):
        logits = functional_call(model, params, (ids[None, -cfg.context :],))[0, -1]
        probs = torch.softmax(logits.float().cpu() / 0.8, -1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen).to(ids.device)])
    return corpus.decode(ids[prompt:].cpu())


def run_digits(cfg: DigitsConfig, out: Path, device: torch.device) -> Result:
    """Train the digits CNN dense and compressed; see the module docstring."""
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model = DigitsCNN(cfg.channels, cfg.hidden).to(device)
    plan = gb.plan(model, **cfg.plan)
    print(f"[digits] 1437 train / 360 val images (8x8, 10 classes); plan {dict(cfg.plan)}")
    print(gb.report(plan))
    scale = cfg.hidden / cfg.channels[0]  # the narrow CNN keeps the stages' proportions
    narrow = narrow_arm(
        lambda w: DigitsCNN((w, 2 * w), round(scale * w)),
        gb.report(plan).stored_params,
        range(1, cfg.channels[0] + 1),
        cfg,
        device,
    )
    arms = with_baselines(model, plan, narrow, cfg, device)
    return train_digits("digits", "CNN", arms, plan, cfg, out, device, started)


def run_mlp(cfg: MLPConfig, out: Path, device: torch.device) -> Result:
    """Train the digits MLP dense, with the paper's genome, and narrow; see the docstring."""
    started = time.perf_counter()
    torch.manual_seed(cfg.seed)
    model = digits_mlp(cfg.hidden).to(device)
    plan = gb.plan(model, **cfg.plan)
    print(f"[mlp] 64-{cfg.hidden}-10 on digits; plan {dict(cfg.plan)}")
    print(gb.report(plan))
    narrow = narrow_arm(digits_mlp, gb.report(plan).stored_params, range(1, 200), cfg, device)
    arms = with_baselines(model, plan, narrow, cfg, device)
    return train_digits("mlp", "MLP 64-800-10", arms, plan, cfg, out, device, started)


def train_digits(
    task: str,
    what: str,
    arms: list[Arm],
    plan: gb.Plan,
    cfg: TrainConfig,
    out: Path,
    device: torch.device,
    started: float,
) -> Result:
    """Train the arms of a digits task on the same batches, plot, save and report."""
    x_train, y_train, x_val, y_val = (t.to(device) for t in digits_split(seed=cfg.seed))
    gen = torch.Generator().manual_seed(cfg.seed)

    def batches() -> Batches:
        while True:
            index = torch.randint(len(x_train), (cfg.batch,), generator=gen).to(device)
            yield x_train[index], y_train[index]

    def validate(arm: Arm) -> tuple[float, float]:
        return evaluate(arm.model, arm.params(), x_val, y_val, len(x_val))

    curves = train(arms, batches(), validate, cfg, task)
    final = {a.name: validate(a) for a in arms}
    ratio = gb.report(plan).compression
    title = f"{what} on scikit-learn digits (gb: {ratio:.0f}x whole model)"
    plot_path = out / f"{task}_curves.png"
    plot(curves, plot_path, title, accuracy=True)
    return finish(task, arms, plan, cfg, final, out, {}, started, plot_path)


def main(argv: Sequence[str] | None = None) -> list[Result]:
    """Parse the command line, run the chosen tasks and print a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("charlm", "digits", "mlp", "all"), default="all")
    parser.add_argument("--steps", type=int, help="training steps of each task (default: its own)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each arm's loss (default: off, measured no faster on 2 CPU cores)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs"), help="checkpoints and plots")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)))  # every core this process may use
    options = {"steps": args.steps, "compile": args.compile}
    overrides = {k: v for k, v in options.items() if v is not None}
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = []
    if args.task in ("charlm", "all"):
        results.append(run_charlm(replace(CharLMConfig(), **overrides), args.out, device))
    if args.task in ("digits", "all"):
        results.append(run_digits(replace(DigitsConfig(), **overrides), args.out, device))
    if args.task in ("mlp", "all"):
        results.append(run_mlp(replace(MLPConfig(), **overrides), args.out, device))
    seconds = time.perf_counter() - started
    print(f"\nsummary: {seconds:.0f} s on {device} ({torch.get_num_threads()} threads)")
    for r in results:
        scores = "  ".join(
            f"{name} {r.val_loss[name]:.3f} / {100 * r.val_acc[name]:.1f}%" for name in r.val_loss
        )
        print(
            f"  {r.task:6s}  {r.report.generated_compression:4.1f}x generated "
            f"({r.report.compression:4.1f}x whole model)  val loss / acc: {scores}  "
            f"{r.seconds:.0f} s"
        )
    return results


if __name__ == "__main__":
    main()
