"""Continual learning on the digits: five 2-class tasks learned one after the other.

Task-incremental split digits, the setting of von Oswald et al. 2020 ("Continual learning
with hypernetworks") and of hypnettorch's SplitMNIST example, on scikit-learn's 8x8 digits
(`examples.data.digits_split(0.2, seed=0)`, the same split for every seed): task t is the
digits {2t, 2t+1} relabelled 0/1, the tasks are trained in order t = 0..4, and the task's
identity is given at test time. After the last task each arm is scored on every task's
validation images (with that task's identity): the accuracy per task, their mean over the 5
tasks, and over seeds the mean, standard error and spread (max - min) of that mean.

Target network: the MLP 64-64-64-2 (ReLU) on the flattened pixels, 8,450 parameters. Arms:

- finetune: one target MLP, its 2-way head shared by all tasks, trained task after task with
  no protection (it forgets).
- per-task: one MLP 64-w-w-2 per task, w the width at which the 5 together have about as
  many trainable parameters as the hypnettorch arm (`per_task_width`: w = 6, 2,230).
- hypnettorch: hypnettorch 0.0.4's `hnets.ChunkedHMLP` (task embeddings of 8,
  `num_cond_embs=5`) over `mnets.MLP(64, 2, (64, 64), no_weights=True)`, trained as its
  example `hypnettorch/examples/hypercl/run.py` does: Adam at its default rate 1e-4, batch
  32, `hnet_regularizer.get_current_targets` before each task and
  `calc_fix_target_reg(hnet, t, targets=...)` times beta = 0.01 (the library's default
  `--beta`), every earlier task at each step, the library's own initialisation. The
  example's default hypernetwork (ChunkedHMLP, layers 100,100, chunks of 750, about the
  size of its target network) is scaled down (`HNET`: layers 10,10, chunks of 106, 2,126
  parameters) to just above the gbfunc arm's count. `hypnettorch-lr1e-3`: the same at 1e-3
  (the example says its defaults were not searched; gbfunc's rates were moved too).
- gbfunc: a task-conditioned genome, `gb.plan(..., condition=8, tasks=5)`,
  `gb.apply(gparams, plan, task=t)`, `gb.optim.param_groups`' rates times `scale`, and the
  output regulariser of hypnettorch's arm: `gb.continual.targets` before each task and
  `gb.continual.penalty(..., strength=0.01)` (for each earlier task the squared difference
  between what the genome generates now and its target, summed over every parameter;
  averaged over the earlier tasks, as `calc_fix_target_reg`; times beta = 0.01). The genome
  is `GB_PLAN`, the paper's (2,117 parameters), at `param_groups`' default rates under
  `gb.optim.schedule` (warm-up over a quarter of each task's steps, then cosine decay; a
  fresh optimizer per task), as the library says to train it, where one seed of three
  collapsed on its first task; `gbfunc-constant-lr`: the same at a constant rate (Adam
  without warm-up, as the other arms run), where training collapsed on most tasks;
  `gbfunc-0.1-constant-lr`: at a constant tenth of the default rates, which trained on every
  seed and task.
- joint: the finetune MLP trained on all five tasks at once (batches drawn from their
  union, 5x the steps): a shared model's multi-task upper bound, no sequence.

Every arm: Adam (a fresh optimizer per task), `--steps` steps per task (1000, hypnettorch's
example's 1001 iterations), batch 32; the plain MLPs at Adam's default rate 1e-3, unswept.
For one seed every arm sees the same batches and starts from `torch.manual_seed(seed)`.
Times are seconds per seed (all tasks plus the evaluation), one thread; on 2 busy cores the
plain MLPs took 2-3 s, hypnettorch about 20-25 s and gbfunc about 80-90 s (its penalty
generates the weights of every earlier task at every step).

hypnettorch is not a gbfunc dependency (see `benchmarks/peers.py`): run its arms in the
peers venv and the others in the project's venv, accumulating rows in one JSON file; in a
venv without hypnettorch its rows say "not installed":

    python -m benchmarks.continual                       # project venv, about 10 minutes
    . ~/.venvs/gbfunc-peers/bin/activate                  # the peers venv (peers.py):
    python -m benchmarks.continual --arms hypnettorch hypnettorch-lr1e-3   # 2-3 minutes
    python -m benchmarks.continual --report-only          # the report from the rows
    python -m benchmarks.continual --quick --arms finetune per-task        # seconds

Rows accumulate in `--rows` (default `results/continual.json`; `--quick`:
`results/continual_quick.json`), one per arm, seed and steps, a rerun replacing its own;
the report (`--out`) is written from all of them.
"""

import argparse
import functools
import itertools
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.functional import cross_entropy

import gbfunc as gb
from benchmarks._meta import (
    RESULTS,
    header_md,
    markdown_table,
    provenance,
    write_json,
    write_results,
)
from examples.data import digits_split
from examples.models import paper_genome

TASKS, IN, HIDDEN, OUT = 5, 64, (64, 64), 2
BATCH, STEPS, QUICK_STEPS = 32, 1000, 100
MLP_LR = 1e-3  # Adam's default, for the plain MLPs and gbfunc's free parameters
BETA = 0.01  # the output regulariser's strength: hypnettorch's default --beta, both arms
# hypnettorch: its example's ChunkedHMLP (layers 100,100, chunks of 750, chunk and task
# embeddings of 8, lr 1e-4), its layers and chunks scaled down to gbfunc's parameter count.
HNET = {"layers": (10, 10), "chunk_size": 106, "chunk_emb_size": 8, "cond_emb_size": 8}
HNET_LR = 1e-4
# gbfunc: the paper's genome (`examples.models.paper_genome`: one tanh g-net per weight and
# per bias, the biases generated too, so that every parameter depends on the task), 19 hidden
# units, reading a condition of 8, at `param_groups`' default rates under `gb.optim.schedule`.
# At a constant rate (no warm-up), on task 0 alone (a scratch check: the paper genome with 16
# and 32 hidden units, with and without a condition, seeds 0 and 1) this MLP's training
# collapsed to a constant output (loss ln 2) in 7 of 8 runs at the default rates (0.3 for
# tanh g-nets) and 3 of 8 at 1/3 of them. With the schedule (the `gbfunc` row) training is
# still on the edge at the default rates: of 3 seeds, one collapsed from its first task on, and
# seed 0, which trained every task in one run, lost its fourth in another (the same seed does
# not always end the same there); at a constant tenth of them (`gbfunc-0.1-constant-lr`) none
# did.
GB_PLAN: dict[str, Any] = {
    **paper_genome(19, first="0.weight", last="4.*"),
    "condition": 8,
}
GB_NAME = "paper genome, 19 hidden units, biases generated, condition 8"
ARMS = (
    "finetune",
    "per-task",
    "hypnettorch",
    "hypnettorch-lr1e-3",
    "gbfunc",
    "gbfunc-constant-lr",
    "gbfunc-0.1-constant-lr",
    "joint",
)


class Unavailable(Exception):
    """The arm cannot run here (a library not installed, an API not there yet)."""


# ---------------------------------------------------------------- data


def split_tasks() -> tuple[list[tuple[Tensor, Tensor]], list[tuple[Tensor, Tensor]]]:
    """Per task `(x, y)`: flattened images and 0/1 labels, training and validation."""
    x_train, y_train, x_val, y_val = digits_split(0.2, seed=0)

    def task(x: Tensor, y: Tensor, t: int) -> tuple[Tensor, Tensor]:
        keep = (y == 2 * t) | (y == 2 * t + 1)
        return x[keep].reshape(-1, IN), y[keep] - 2 * t

    train = [task(x_train, y_train, t) for t in range(TASKS)]
    val = [task(x_val, y_val, t) for t in range(TASKS)]
    return train, val


def batches(n: int, steps: int, seed: int, stream: int) -> Tensor:
    """`(steps, BATCH)` indices into `n` examples: shuffled epochs laid end to end."""
    g = torch.Generator().manual_seed(10_000 * seed + stream)
    epochs = math.ceil(steps * BATCH / n)
    return torch.cat([torch.randperm(n, generator=g) for _ in range(epochs)])[: steps * BATCH].view(
        steps, BATCH
    )


def mlp(hidden: tuple[int, ...] = HIDDEN) -> nn.Sequential:
    layers: list[nn.Module] = []
    width = IN
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    return nn.Sequential(*layers, nn.Linear(width, OUT))


def count(params: Any) -> int:
    return sum(p.numel() for p in params)


def evaluate(forward: Callable[[Tensor], Tensor], data: tuple[Tensor, Tensor]) -> float:
    """Accuracy % of `forward` on `(x, y)`."""
    x, y = data
    with torch.no_grad():
        return 100.0 * (forward(x).argmax(-1) == y).float().mean().item()


# ---------------------------------------------------------------- arms
# Each arm: (train, val, steps, seed) -> (trainable params, accuracy per task after the last
# task, accuracy on each task just after training it, configuration).


def finetune(train, val, steps: int, seed: int) -> tuple[int, list[float], str]:
    torch.manual_seed(seed)
    model = mlp()
    after = []
    for t, (x, y) in enumerate(train):
        opt = torch.optim.Adam(model.parameters(), lr=MLP_LR)
        for idx in batches(len(y), steps, seed, t):
            opt.zero_grad(set_to_none=True)
            cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        after.append(evaluate(lambda x: model(x), val[t]))
    accs = [evaluate(lambda x: model(x), v) for v in val]
    return count(model.parameters()), accs, after, f"MLP 64-64-64-2, lr {MLP_LR:g}"


def joint(train, val, steps: int, seed: int) -> tuple[int, list[float], str]:
    torch.manual_seed(seed)
    model = mlp()
    x = torch.cat([x for x, _ in train])
    y = torch.cat([y for _, y in train])
    opt = torch.optim.Adam(model.parameters(), lr=MLP_LR)
    for idx in batches(len(y), TASKS * steps, seed, TASKS):
        opt.zero_grad(set_to_none=True)
        cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    accs = [evaluate(lambda x: model(x), v) for v in val]
    config = f"MLP 64-64-64-2, all tasks mixed, {TASKS}x the steps, lr {MLP_LR:g}"
    return count(model.parameters()), accs, accs, config


def per_task_width(budget: int) -> int:
    """The width w whose 5 MLPs 64-w-w-2 hold the number of parameters nearest `budget`."""
    return min(range(1, 65), key=lambda w: abs(TASKS * count(mlp((w, w)).parameters()) - budget))


def per_task(train, val, steps: int, seed: int) -> tuple[int, list[float], str]:
    torch.manual_seed(seed)
    width = per_task_width(hnet_params())
    models = [mlp((width, width)) for _ in range(TASKS)]
    for t, (x, y) in enumerate(train):
        opt = torch.optim.Adam(models[t].parameters(), lr=MLP_LR)
        for idx in batches(len(y), steps, seed, t):
            opt.zero_grad(set_to_none=True)
            cross_entropy(models[t](x[idx]), y[idx]).backward()
            opt.step()
    accs = [evaluate(m, v) for m, v in zip(models, val, strict=True)]
    total = sum(count(m.parameters()) for m in models)
    config = f"5 MLPs 64-{width}-{width}-2, lr {MLP_LR:g}"
    return total, accs, accs, config


def hnet_params() -> int:
    """The hypnettorch arm's trainable parameters (computed, so that per-task can be sized
    without hypnettorch installed): chunk embeddings, the MLP and the task embeddings."""
    target = count(mlp().parameters())
    chunks = math.ceil(target / HNET["chunk_size"])
    widths = [HNET["chunk_emb_size"] + HNET["cond_emb_size"], *HNET["layers"], HNET["chunk_size"]]
    layers = sum(a * b + b for a, b in itertools.pairwise(widths))
    return chunks * HNET["chunk_emb_size"] + layers + TASKS * HNET["cond_emb_size"]


def hypnettorch_nets() -> tuple[nn.Module, nn.Module]:
    try:
        import hypnettorch
        from hypnettorch.hnets import ChunkedHMLP
        from hypnettorch.mnets import MLP
    except ImportError as error:
        raise Unavailable(
            f"hypnettorch not installed in {sys.prefix} ({error}); it is not a gbfunc "
            "dependency: run this arm in the peers venv (see the docstring)"
        ) from error
    if getattr(hypnettorch, "__version__", "0.0.4") != "0.0.4":
        print(f"note: hypnettorch {hypnettorch.__version__}, not 0.0.4", file=sys.stderr)
    mnet = MLP(IN, OUT, hidden_layers=HIDDEN, no_weights=True, verbose=False)
    hnet = ChunkedHMLP(
        mnet.param_shapes,
        HNET["chunk_size"],
        chunk_emb_size=HNET["chunk_emb_size"],
        cond_in_size=HNET["cond_emb_size"],
        layers=HNET["layers"],
        num_cond_embs=TASKS,
        verbose=False,
    )
    return mnet, hnet


def hypnettorch_arm(train, val, steps: int, seed: int, lr: float = HNET_LR):
    """hypnettorch's own recipe (its examples/hypercl/run.py): the hypernetwork's output for
    every earlier task held to what it was before the task, beta = 0.01."""
    torch.manual_seed(seed)
    mnet, hnet = hypnettorch_nets()
    from hypnettorch.utils import hnet_regularizer as hreg

    params = count(p for p in hnet.parameters() if p.requires_grad)
    assert params == hnet_params(), (params, hnet_params())

    def forward(x: Tensor, task: int) -> Tensor:
        return mnet(x, weights=hnet(cond_id=task))

    after = []
    for t, (x, y) in enumerate(train):
        targets = hreg.get_current_targets(t, hnet) if t > 0 else None
        opt = torch.optim.Adam(hnet.parameters(), lr=lr)
        for idx in batches(len(y), steps, seed, t):
            opt.zero_grad(set_to_none=True)
            loss = cross_entropy(mnet(x[idx], weights=hnet(cond_id=t)), y[idx])
            if t > 0:
                loss = loss + BETA * hreg.calc_fix_target_reg(hnet, t, targets=targets, mnet=mnet)
            loss.backward()
            opt.step()
        after.append(evaluate(functools.partial(forward, task=t), val[t]))
    hnet.eval()
    accs = [evaluate(functools.partial(forward, task=t), v) for t, v in enumerate(val)]
    h = HNET
    config = (
        f"ChunkedHMLP layers {','.join(map(str, h['layers']))}, chunks of {h['chunk_size']}, "
        f"chunk and task embeddings of {h['chunk_emb_size']}, lr {lr:g}, beta {BETA:g}"
    )
    return params, accs, after, config


def gbfunc_arm(train, val, steps: int, seed: int, scale: float = 1.0, schedule: bool = True):
    model = mlp()
    plan = gb.plan(model, **GB_PLAN, tasks=TASKS)
    gparams = gb.init(plan, seed=seed)
    params = count(gb.trainable_leaves(gparams))
    groups = gb.optim.param_groups(gparams, plan, free_lr=MLP_LR, scale=scale)
    rates = ", ".join(f"{g['lr']:g}" for g in groups)  # the peaks: the schedule changes them

    def forward(x: Tensor, task: int) -> Tensor:
        return functional_call(model, gb.apply(gparams, plan, task=task), (x,))

    torch.manual_seed(seed)
    after = []
    for t, (x, y) in enumerate(train):
        targets = gb.continual.targets(gparams, plan, tasks=range(t)) if t > 0 else None
        opt = torch.optim.Adam(groups)
        sched = gb.optim.schedule(opt, steps) if schedule else None
        for idx in batches(len(y), steps, seed, t):
            opt.zero_grad(set_to_none=True)
            weights = gb.apply(gparams, plan, task=t)
            loss = cross_entropy(functional_call(model, weights, (x[idx],)), y[idx])
            if t > 0:
                loss = loss + gb.continual.penalty(gparams, plan, targets, strength=BETA)
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
        after.append(evaluate(functools.partial(forward, task=t), val[t]))
    accs = [evaluate(functools.partial(forward, task=t), v) for t, v in enumerate(val)]
    how = "gb.optim.schedule per task" if schedule else "constant"
    config = f"{GB_NAME}, {TASKS} tasks, scale {scale:g} (rates {rates}, {how}), beta {BETA:g}"
    return params, accs, after, config + "; gb.continual's targets and penalty"


RUN: dict[str, Callable] = {
    "finetune": finetune,
    "per-task": per_task,
    "hypnettorch": hypnettorch_arm,
    "hypnettorch-lr1e-3": functools.partial(hypnettorch_arm, lr=1e-3),
    "gbfunc": gbfunc_arm,
    "gbfunc-constant-lr": functools.partial(gbfunc_arm, schedule=False),
    "gbfunc-0.1-constant-lr": functools.partial(gbfunc_arm, scale=0.1, schedule=False),
    "joint": joint,
}


# ---------------------------------------------------------------- rows and report


def _why(error: BaseException) -> str:
    text = traceback.format_exception_only(error)[-1].strip().replace("\n", " ")
    return text if len(text) < 400 else text[:397] + "..."


def run_arm(arm: str, seeds: list[int], steps: int, data) -> list[dict[str, Any]]:
    """One row per seed, or one row saying why the arm cannot run here."""
    p = provenance()
    base = {
        "arm": arm,
        "steps": steps,
        "batch": BATCH,
        "venv": sys.prefix,
        **{k: p[k] for k in ("command", "code", "machine", "torch", "date")},
    }
    rows = []
    for seed in seeds:
        start = time.perf_counter()
        try:
            params, accs, after, config = RUN[arm](*data, steps, seed)
        except Unavailable as error:
            print(f"{arm}: unavailable: {error}", flush=True)
            return [{**base, "seed": None, "status": "unavailable", "reason": str(error)}]
        except Exception as error:
            traceback.print_exc()
            rows.append({**base, "seed": seed, "status": "failed", "reason": _why(error)})
            continue
        seconds = time.perf_counter() - start
        mean = statistics.fmean(accs)
        forgetting = statistics.fmean(a - b for a, b in zip(after[:-1], accs[:-1], strict=True))
        rows.append(
            {
                **base,
                "seed": seed,
                "status": "ok",
                "params": params,
                "config": config,
                "acc": accs,
                "mean": mean,
                "acc_after": after,
                "forgetting": forgetting,
                "seconds": seconds,
            }
        )
        print(
            f"{arm} seed {seed}: {mean:.2f}% ({', '.join(f'{a:.1f}' for a in accs)}; just "
            f"after each task {', '.join(f'{a:.1f}' for a in after)}), {params:,} params, "
            f"{seconds:.1f} s",
            flush=True,
        )
    return rows


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`old` with the rows of `new` replacing those of the same arm, steps and seed; a row
    saying an arm is unavailable replaces only another such row (not an arm's results from
    another venv)."""
    key = lambda r: (r["arm"], r["steps"], r["seed"])
    replaced = {key(r) for r in new}
    return [r for r in old if key(r) not in replaced] + new


def stats(values: list[float]) -> tuple[float, float, float]:
    """Mean, standard error and spread (max - min)."""
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return mean, se, max(values) - min(values)


def report(rows: list[dict[str, Any]], title: str) -> str:
    columns = [
        ("arm", "l"),
        ("configuration", "l"),
        ("trainable params", "r"),
        ("steps/task", "r"),
        ("seeds", "r"),
        *((f"task {t} ({2 * t}/{2 * t + 1}) %", "r") for t in range(TASKS)),
        ("mean %", "r"),
        ("spread", "r"),
        ("forgetting", "r"),
        ("s/seed", "r"),
    ]
    table, notes = [], []
    order = {a: i for i, a in enumerate(ARMS)}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["arm"], r["steps"]), []).append(r)
    for (arm, steps), group in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], -kv[0][1])):
        ok = sorted((r for r in group if r["status"] == "ok"), key=lambda r: r["seed"])
        if not ok:
            if any(r["status"] == "ok" for r in rows if r["arm"] == arm):
                continue  # it ran at other steps, or in another venv
            why = "; ".join(dict.fromkeys(r["reason"] for r in group))
            table.append(
                [arm, f"not run: {why}", "-", str(steps), "0", *["-"] * TASKS, "-", "-", "-", "-"]
            )
            continue
        mean, se, spread = stats([r["mean"] for r in ok])
        per_task = [statistics.fmean(r["acc"][t] for r in ok) for t in range(TASKS)]
        configs = " / ".join(dict.fromkeys(r["config"] for r in ok))
        params = " / ".join(f"{p:,}" for p in dict.fromkeys(r["params"] for r in ok))
        table.append(
            [
                arm,
                configs,
                params,
                str(steps),
                ", ".join(str(r["seed"]) for r in ok),
                *(f"{a:.2f}" for a in per_task),
                f"{mean:.2f} ± {se:.2f}",
                f"{spread:.2f}",
                f"{statistics.fmean(r['forgetting'] for r in ok):.2f}",
                f"{statistics.fmean(r['seconds'] for r in ok):.1f}",
            ]
        )
        failed = [r for r in group if r["status"] == "failed"]
        notes += [f"- {arm}, seed {r['seed']}: failed: {r['reason']}" for r in failed]
        for r in ok[:1]:
            notes.append(
                f"- {arm}: `{r['command']}`, {r['code']}, torch {r['torch']}, venv "
                f"`{r['venv']}`, {r['machine']}, {r['date']}"
            )
    text = (
        header_md(title)
        + "\n"
        + "Accuracy on each task's validation images after the last task, with that task's "
        "identity; task t = digits 2t/2t+1 relabelled 0/1. Per-task columns: the mean over "
        "the seeds; mean: the mean over the 5 tasks, as mean ± standard error over the seeds; "
        "spread: max - min of that mean over the seeds; forgetting: the accuracy on tasks 0-3 "
        "just after each was trained minus after the last task, averaged over those tasks and "
        "the seeds; s/seed: training all 5 tasks plus the evaluation, one thread. Protocol "
        "and arms: the docstring of `benchmarks/continual.py`.\n\n" + markdown_table(columns, table)
    )
    return text + ("\nRows (each arm's first seed):\n\n" + "\n".join(notes) + "\n" if notes else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--steps", type=int, help=f"per task (default {STEPS}; --quick {QUICK_STEPS})"
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps per task")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=Path, help="JSON rows to add to (default by --quick)")
    parser.add_argument("--out", type=Path, help="the report (default by --quick)")
    parser.add_argument("--report-only", action="store_true", help="train nothing")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    stem = "continual_quick" if args.quick else "continual"
    rows_path = args.rows or RESULTS / f"{stem}.json"
    out = args.out or RESULTS / f"{stem}.md"
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    rows = json.loads(rows_path.read_text())["rows"] if rows_path.exists() else []
    if not args.report_only:
        data = split_tasks()
        for arm in args.arms:
            rows = merge(rows, run_arm(arm, args.seeds, steps, data))
            write_json(rows_path, rows)
    title = "Continual learning: 5 split-digits tasks, task-incremental (MLP 64-64-64-2)"
    text = report(rows, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_results(out, text)
    print(text)


if __name__ == "__main__":
    main()
