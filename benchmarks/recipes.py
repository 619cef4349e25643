"""One gbfunc genome on one task, under `equal_params`' protocol: for trying recipes.

A genome that looks promising goes into `equal_params.py`'s tasks, beside the baselines;
one that does not is written down in `results/recipes.md` with the command that measured it.

    python -m benchmarks.recipes --task cnn --lrs 0.01 0.03 0.1 \\
        --plan '{"tile": "full", "encoding": "gray", "hidden": 60, "activation": "tanh",
                 "biases": true, "center": true}'

Prints the trainable parameter count and, per seed and learning rate, the validation loss
and accuracy; `--no-calibrate` starts from `gb.init` alone; `--gains` adds a learned gain per
row and per column of every generated weight (`with_gains`).
"""

import argparse
import json
import time
from dataclasses import replace

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

import gbfunc as gb
from benchmarks.equal_params import TASKS, Arm, gbfunc_arm, train


def with_gains(arm: Arm, plan: gb.Plan) -> Arm:
    """`arm` with a learned gain per output row and per input column of each generated weight.

    Weight normalisation's gain, split into rows and columns: `W * r[:, None] * c[None, :]`
    (over the leading two dimensions of a convolution), O(rows + columns) parameters, starting
    at 1 and training at the rate of the arm's free tensors.
    """
    gains = {
        p.name: {"rows": torch.ones(p.shape[0]), "cols": torch.ones(p.shape[1])}
        for p in plan.generated
        if len(p.shape) >= 2
    }
    for pair in gains.values():
        for leaf in pair.values():
            leaf.requires_grad_()

    def to_params(tree: dict) -> dict[str, Tensor]:
        params = arm.to_params({k: v for k, v in tree.items() if k != "gains"})
        for name, pair in tree["gains"].items():
            w = params[name]
            extra = (1,) * (w.dim() - 2)
            params[name] = w * pair["rows"].view(-1, 1, *extra) * pair["cols"].view(1, -1, *extra)
        return params

    added = sum(v.numel() for v in tree_leaves(gains))
    scales = {**arm.lr_scales, "gains": arm.lr_scales.get("free", 1.0)}
    tree = {**arm.tree, "gains": gains}
    return replace(arm, tree=tree, to_params=to_params, params=arm.params + added, lr_scales=scales)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--plan", required=True, help="gb.plan options as JSON")
    parser.add_argument("--lrs", type=float, nargs="+", required=True)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--steps", type=int, help="default: the task's")
    parser.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--gains", action="store_true", help="learned row and column gains")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    task = TASKS[args.task]
    if args.calibrate is not None:
        task = replace(task, calibrate=args.calibrate)
    options = json.loads(args.plan)
    data = task.data()
    for seed in range(args.seeds):
        arm, plan = gbfunc_arm(task, "recipe", options, seed, data)
        if args.gains:
            arm = with_gains(arm, plan)
        print(f"trainable parameters {arm.params:,}", flush=True)
        start_values = [v.detach().clone() for v in tree_leaves(arm.tree)]
        for lr in args.lrs:
            started = time.perf_counter()
            loss, acc = train(arm, lr, data, args.steps or task.steps, task.batch, seed)
            with torch.no_grad():
                for leaf, value in zip(tree_leaves(arm.tree), start_values, strict=True):
                    leaf.copy_(value)
            print(
                f"seed {seed} lr {lr:g}: val loss {loss:.4f}, val acc {100 * acc:.2f}% "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
