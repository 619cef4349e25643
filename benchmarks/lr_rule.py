"""The default g-net learning rates (`gb.optim.param_groups`) against swept ones.

Three experiments under `equal_params`' protocol (Adam, warm-up then cosine decay, its tasks,
steps, batches and seeds; each gbfunc arm's free tensors at its `free_lr_factor` times the
g-net rate):

1. `split`: the hashed genomes of the digits MLP (~20x, ~100x, ~300x; tanh g-nets on neuron
   labels) and CNN (~23x, ~135x; ReLU g-nets), with the g-net leaves and the hashed tables at
   separate rates: which each part wants.
2. `held-out`: two configurations no sweep had seen, the MLP's tanh genome with tables sized
   for ~50x and the CNN's ReLU genome with tables for ~60x (`hashed="auto"`): the default
   against one rate for everything, swept.
3. `transformer`: the main job's character transformer at ~20x (hashed genome, ReLU g-nets)
   at the default, to set beside its committed sweep (0.02, 0.04, 0.08).

    python -m benchmarks.lr_rule            # about 25 minutes on 2 cores (2 processes)
    python -m benchmarks.lr_rule --parts held-out
"""

import argparse
import itertools
import json
import statistics
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

import gbfunc as gb
from benchmarks import equal_params as ep
from benchmarks._meta import RESULTS, recorded
from examples.models import paper_genome

SEEDS = (0, 1, 2)
SPLIT = {"mlp": (3, 4, 5), "cnn": (2, 3)}  # indices into equal_params' genomes (hashed)
SPLIT_GNETS, SPLIT_TABLES = (0.03, 0.1, 0.3, 1.0), (0.003, 0.01, 0.03)
HELD_OUT = {
    "mlp": ("~50x, tanh genome", {**paper_genome(3), "hashed": "auto", "compression": 50}),
    "cnn": (
        "~60x, ReLU genome",
        {"tile": "full", "hidden": 3, "hashed": "auto", "compression": 60},
    ),
}
SWEPT = (0.01, 0.03, 0.1, 0.3)


def rates(plan: gb.Plan, rule: str | float | tuple[float, float]) -> dict:
    """`{(stack key, leaf): rate}`: the default (`"default"`), one rate for all, or
    `(g-net rate, table rate)`."""
    out = {}
    for stack in plan.stacks:
        for leaf in stack.leaf_shapes():
            if rule == "default":
                out[stack.key, leaf] = gb.optim.gnet_lr(stack, leaf)
            elif isinstance(rule, tuple):
                out[stack.key, leaf] = rule[1] if leaf == gb.optim.TABLE_LEAF else rule[0]
            else:
                out[stack.key, leaf] = rule
    return out


def run(task_name: str, options: dict, rule: str | float | tuple, seed: int) -> dict:
    """Validation scores of the gbfunc arm of `options` trained at `rule`'s rates."""
    torch.set_num_threads(1)
    task = ep.TASKS[task_name]
    data = task.data()
    arm, plan = ep.gbfunc_arm(task, "lr rule", options, seed, data)
    by_leaf = rates(plan, rule)
    tree: dict = {}  # one top-level part per rate: `equal_params.train` scales by part
    for (key, leaf), rate in by_leaf.items():
        tree.setdefault(f"rate {rate}", {}).setdefault(key, {})[leaf] = arm.tree["stacks"][key][
            leaf
        ]
    parts = list(tree)
    tree["free"], tree["frozen"] = arm.tree["free"], arm.tree["frozen"]

    def to_params(t: dict) -> dict:
        stacks: dict = {}
        for part in parts:
            for key, leaves in t[part].items():
                stacks.setdefault(key, {}).update(leaves)
        return gb.apply({"stacks": stacks, "free": t["free"], "frozen": t["frozen"]}, plan)

    gnet_rate = (
        max(by_leaf.values())
        if rule == "default"
        else (rule[0] if isinstance(rule, tuple) else rule)
    )
    scales = {part: float(part.removeprefix("rate ")) for part in parts}
    scales["free"] = gnet_rate * task.free_lr_factor
    trained = ep.Arm("gbfunc", "lr rule", arm.model, tree, to_params, arm.params, scales)
    loss, acc = ep.train(trained, 1.0, data, task.steps, task.batch, seed)
    return {
        "task": task_name,
        "compression": round(gb.report(plan).compression, 1),
        "rule": rule if isinstance(rule, str | float) else list(rule),
        "seed": seed,
        "val_loss": loss,
        "val_acc": acc,
    }


def jobs(parts: list[str]) -> list[tuple[str, str, dict, object, int]]:
    """`(part, task, options, rule, seed)` of every run."""
    out = []
    if "split" in parts:
        for task, indices in SPLIT.items():
            for index in indices:
                options = ep.TASKS[task].genomes[index][2]
                for rule in itertools.product(SPLIT_GNETS, SPLIT_TABLES):
                    out += [("split", task, options, rule, s) for s in SEEDS]
    if "held-out" in parts:
        for task, (_, options) in HELD_OUT.items():
            for rule in ("default", *SWEPT):
                out += [("held-out", task, options, rule, s) for s in SEEDS]
    if "transformer" in parts:
        options = ep.TASKS["charlm"].genomes[3][2]
        out += [("transformer", "charlm", options, "default", s) for s in SEEDS]
    return out


def _one(job: tuple) -> dict:
    part, task, options, rule, seed = job
    return {"part": part, **run(task, options, rule, seed)}


def report(rows: list[dict]) -> None:
    """Mean over seeds per configuration and rule; accuracy in %, loss in nats."""
    groups: dict = defaultdict(list)
    for r in rows:
        metric = "val_loss" if r["task"] == "charlm" else "val_acc"
        value = r[metric] * (1 if metric == "val_loss" else 100)
        groups[r["part"], r["task"], r["compression"], json.dumps(r["rule"])].append(value)
    print("| part | task | compression | rule | seeds | mean | per seed |")
    print("|---|---|---|---|---|---|---|")
    for (part, task, ratio, rule), values in sorted(groups.items()):
        seeds = ", ".join(f"{v:.4g}" for v in values)
        print(
            f"| {part} | {task} | {ratio}x | {json.loads(rule)} | {len(values)} | "
            f"{statistics.mean(values):.4g} | {seeds} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts", nargs="+", default=["split", "held-out", "transformer"],
        choices=["split", "held-out", "transformer"],
    )  # fmt: skip
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "lr_rule.md")
    args = parser.parse_args(argv)
    todo = jobs(args.parts)
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(_one, todo))
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    with recorded(args.out, "Default g-net learning rates against swept ones"):
        print(
            f"gb.optim.GNET_LR = {gb.optim.GNET_LR}, TABLE_LR = {gb.optim.TABLE_LR}; rule "
            "'default' is those, [g, t] the g-net leaves at g and the tables at t, a number "
            "every g-net leaf at it. Accuracy in % (digits), validation loss in nats "
            "(charlm).\n"
        )
        report(rows)


if __name__ == "__main__":
    main()
