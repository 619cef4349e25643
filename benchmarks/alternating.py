"""The paper's alternating training (`gb.train_alternating`) against end-to-end training.

Shuvaev et al. 2024 do not train the g-nets through the p-net: for many generations they
train the p-net's weights directly for a while, fit the g-nets to them by regression and
regenerate, blending trained and generated weights early on. Here both ways train the digits
MLP 64-800-10 with the paper's genome at ~100x (`equal_params.py`'s ~100x arm), from the same
`gb.init`, on the same number of training batches (1000 x 128):

- **end to end**: `equal_params`' protocol (Adam on the g-nets, lr 0.3, warm-up, cosine);
- **alternating**: 40 generations of 25 Adam steps on the dense p-net (lr 1e-3, the dense
  model's best) and `gb.fit` (200 steps), blend `exp(-n / 10)`; scored on the generated model
  after the last fit, and for reference the dense p-net of the last generation.

    python -m benchmarks.alternating           # 3 seeds, ~10 minutes on one core
    python -m benchmarks.alternating --quick   # 1 seed, 10 generations

Writes `benchmarks/results/alternating[_quick].md`.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

import gbfunc as gb
from benchmarks._meta import RESULTS, header_md, markdown_table, write_results
from benchmarks.equal_params import TASKS, gbfunc_arm, train
from examples.models import paper_genome

GENOME = paper_genome(9)  # ~100x, as in equal_params
END_TO_END_LR = 0.3  # the gbfunc arm's best in equal_params at ~100x
DENSE_LR, STEPS, FIT_STEPS, ANNEAL = 1e-3, 1000, 200, 10.0


def alternating(seed: int, generations: int) -> tuple[float, float, float]:
    """`(generated accuracy, last dense accuracy, seconds)` of `gb.train_alternating`."""
    task = TASKS["mlp"]
    data = task.data()
    arm, plan = gbfunc_arm(task, "paper", GENOME, seed, data)
    gen = torch.Generator().manual_seed(seed)
    steps = STEPS // generations
    last: dict[str, Tensor] = {}

    def train_dense(params: dict[str, Tensor], generation: int) -> dict[str, Tensor]:
        weights = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
        optimizer = torch.optim.Adam(weights.values(), lr=DENSE_LR)
        for _ in range(steps):
            x, y = data.sample(gen, task.batch)
            loss = F.cross_entropy(functional_call(arm.model, weights, (x,)), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        last.clear()
        last.update(weights)
        return weights

    started = time.perf_counter()
    gparams = gb.train_alternating(
        arm.tree, plan, train_dense, generations=generations, anneal=ANNEAL, fit_steps=FIT_STEPS
    )
    seconds = time.perf_counter() - started
    with torch.no_grad():
        _, generated = data.validate(arm.model, gb.apply(gparams, plan))
        _, dense = data.validate(arm.model, {k: v.detach() for k, v in last.items()})
    return generated, dense, seconds


def end_to_end(seed: int) -> tuple[float, float]:
    """`(accuracy, seconds)` of `equal_params`' protocol on the same genome."""
    task = TASKS["mlp"]
    data = task.data()
    arm, _ = gbfunc_arm(task, "paper", GENOME, seed, data)
    started = time.perf_counter()
    _, acc = train(arm, END_TO_END_LR, data, STEPS, task.batch, seed)
    return acc, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 10 generations")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds, generations = (1, 10) if args.quick else (3, 40)
    rows = {"end to end": [], "alternating, generated": [], "alternating, last dense": []}
    times = {"end to end": [], "alternating, generated": []}
    for seed in range(seeds):
        acc, seconds = end_to_end(seed)
        rows["end to end"].append(acc)
        times["end to end"].append(seconds)
        generated, dense, seconds = alternating(seed, generations)
        rows["alternating, generated"].append(generated)
        rows["alternating, last dense"].append(dense)
        times["alternating, generated"].append(seconds)
        print(f"seed {seed}: end to end {acc:.4f}, alternating {generated:.4f} (dense {dense:.4f})")
    plan = gb.plan(TASKS["mlp"].build(None), **GENOME)
    columns = [("training", "l"), ("stored params", "r"), ("val acc %", "r"), ("s/run", "r")]
    table = markdown_table(
        columns,
        (
            [
                name,
                f"{gb.report(plan).stored_params:,}" if "dense" not in name else "60,010",
                f"{100 * statistics.fmean(accs):.2f} ± "
                f"{100 * (statistics.stdev(accs) if len(accs) > 1 else 0.0):.2f}",
                f"{statistics.fmean(times[name]):.0f}" if name in times else "-",
            ]
            for name, accs in rows.items()
        ),
    )
    text = (
        header_md("The paper's alternating training against end-to-end training (digits MLP)")
        + f"- {seeds} seed(s); genome `gb.plan(model, **{GENOME})`\n"
        + f"- end to end: {STEPS} Adam steps on the g-nets, lr {END_TO_END_LR}\n"
        + f"- alternating: {generations} generations of {STEPS // generations} Adam steps on the "
        + f"dense p-net (lr {DENSE_LR}) and gb.fit ({FIT_STEPS} steps), anneal {ANNEAL:g}\n\n"
        + table
    )
    print("\n" + table)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("alternating" + ("_quick" if args.quick else "") + ".md")
    write_results(path, text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
