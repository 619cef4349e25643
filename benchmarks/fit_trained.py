"""Compressing a trained model without its data: `gb.fit` onto a trained digits MLP.

A dense 64-800-10 MLP is trained on scikit-learn's digits; `gb.fit` then regresses g-nets
onto its weights (no data, no further training) and the generated model is evaluated as is.
Its accuracy over the dense model's says how much of what was learned the genome keeps.
Each genome is fitted at `gb.fit`'s default, 1e-2 for every leaf, and with `lr=None`, each
leaf at its default rate for training (`gb.optim.gnet_lr`).

    python -m benchmarks.fit_trained          # ~10 minutes on one core

Writes `benchmarks/results/fit_trained.md`.
"""

import argparse
import itertools
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import functional_call

import gbfunc as gb
from benchmarks._meta import RESULTS, header_md, markdown_table, write_results
from examples.data import digits_split
from examples.models import digits_mlp, paper_genome

RATES = (1e-2, None)  # gb.fit's default; each leaf at its training rate


def train_dense(seed: int, steps: int = 1000) -> torch.nn.Module:
    """The dense MLP at its best learning rate in `equal_params` (Adam 1e-3, warm-up, cosine)."""
    x, y, _, _ = digits_split(seed=0)
    torch.manual_seed(seed)
    model = digits_mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda t: min(1.0, (t + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(1.0, t / steps))),
    )
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(len(x), (128,), generator=gen)
        loss = F.cross_entropy(model(x[index]), y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return model


@torch.no_grad()
def accuracy(model: torch.nn.Module, params: dict | None = None) -> float:
    _, _, x, y = digits_split(seed=0)
    logits = model(x) if params is None else functional_call(model, params, (x,))
    return float((logits.argmax(1) == y).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="gb.fit steps")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = train_dense(seed=0)
    dense = accuracy(model)
    target = {k: v.detach() for k, v in model.named_parameters()}
    rows = []
    genomes = (
        ("paper genome H=47, centred", lambda: gb.plan(model, **paper_genome(47))),
        (
            "paper genome H=47, not centred",
            lambda: gb.plan(model, **{**paper_genome(47), "center": False}),
        ),
        ("tiles 32x32, H=8, outputs=8", lambda: gb.plan(model, tile=(32, 32), hidden=8, outputs=8)),
    )
    for (label, build), lr in itertools.product(genomes, RATES):
        plan = build()
        start = time.perf_counter()
        fitted = gb.fit(gb.init(plan), plan, target, steps=args.steps, lr=lr)
        seconds = time.perf_counter() - start
        acc = accuracy(model, gb.apply(fitted.gparams, plan))
        rep = gb.report(plan)
        errors = ", ".join(f"{k} {v:.2f}" for k, v in fitted.errors.items())
        rows.append(
            [
                label,
                "training rates (lr=None)" if lr is None else f"{lr:g}",
                f"{rep.stored_params:,}",
                f"{rep.compression:.1f}x",
                f"{100 * acc:.2f}",
                f"{100 * acc / dense:.1f}%",
                errors,
                f"{seconds:.0f}",
            ]
        )
        print(rows[-1], flush=True)
    columns = [("genome", "l"), ("lr", "l")] + [
        (t, "r")
        for t in ("stored params", "compression", "val acc %", "of dense", "relative error", "s")
    ]
    text = (
        header_md("gb.fit onto a trained digits MLP (no data, no further training)")
        + f"- dense 64-800-10 trained 1000 steps: {100 * dense:.2f}% validation accuracy\n"
        + f"- gb.fit: {args.steps} Adam steps at 1e-2 and at the training rates, cosine; "
        + "relative error ||generated - trained||^2 / ||trained||^2 per parameter\n\n"
        + markdown_table(columns, rows)
    )
    print(text)
    write_results(args.out / "fit_trained.md", text)


if __name__ == "__main__":
    main()
