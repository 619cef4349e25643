"""Weight sets for many conditions: one `vmap`ped `gb.apply` against one call per condition.

    python -m benchmarks.bench_condition           # about a minute on one CPU core

For a conditioned genome (`gb.plan(..., condition=4)`), 64 conditions' weight sets come from
`torch.func.vmap(lambda z: gb.apply(gparams, plan, condition=z))(zs)` in one call, or from
64 calls of `gb.apply`. Both eager on the CPU, forward only and forward + backward (a sum of
every weight, so the gradient reaches every g-net leaf and the conditions), for
`examples.dynamic`'s digits classifier and for the MLP 784-512-512-10 with 64x64 tiles.
Times are medians of interleaved rounds, measured side by side in one run; the ratio is the
64 calls' time over the vmapped call's.
"""

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import vmap

import gbfunc as gb
from benchmarks._meta import RESULTS, header_md, markdown_table, write_json, write_results
from examples.dynamic import WIDTH, classifier, plan_for

CONDITIONS = 64


def models() -> dict[str, tuple[nn.Module, gb.Plan]]:
    digits = classifier()
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU())
    wide.append(nn.Linear(512, 10))
    return {
        "digits classifier (examples.dynamic)": (digits, plan_for(digits, WIDTH)),
        "MLP 784-512-512-10, 64x64 tiles": (
            wide,
            gb.plan(wide, tile=(64, 64), hidden=8, condition=WIDTH),
        ),
    }


def contenders(gparams: dict, plan: gb.Plan, zs: Tensor, backward: bool) -> dict[str, Callable]:
    def total(weights: dict[str, Tensor]) -> Tensor:
        return sum(w.sum() for w in weights.values())

    def vmapped() -> None:
        weights = vmap(lambda z: gb.apply(gparams, plan, condition=z))(zs)
        if backward:
            total(weights).backward()

    def looped() -> None:
        sets = [gb.apply(gparams, plan, condition=z) for z in zs]
        if backward:
            sum(total(w) for w in sets).backward()

    return {"vmap": vmapped, "loop": looped}


def median_ms(fns: dict[str, Callable], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS / "bench_condition.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, (_, plan) in models().items():
        gparams = gb.init(plan, seed=0)
        zs = torch.randn(CONDITIONS, WIDTH, generator=torch.Generator().manual_seed(0))
        for backward in (False, True):
            zs.requires_grad_(backward)
            with torch.set_grad_enabled(backward):
                ms = median_ms(contenders(gparams, plan, zs, backward), args.rounds)
            rows.append(
                {
                    "model": name,
                    "pass": "fwd+bwd" if backward else "fwd",
                    "vmap_ms": ms["vmap"],
                    "loop_ms": ms["loop"],
                    "ratio": ms["loop"] / ms["vmap"],
                    "weights": sum(p.numel for p in plan.generated),
                }
            )
            print(rows[-1])
    columns = [
        ("model", "l"),
        ("pass", "l"),
        ("generated weights per set", "r"),
        (f"one vmapped call, {CONDITIONS} sets (ms)", "r"),
        (f"{CONDITIONS} calls (ms)", "r"),
        ("calls / vmap", "r"),
    ]
    shown = [
        [
            str(r["model"]),
            str(r["pass"]),
            f"{r['weights']:,}",
            f"{r['vmap_ms']:.1f}",
            f"{r['loop_ms']:.1f}",
            f"{r['ratio']:.1f}x",
        ]
        for r in rows
    ]
    title = f"{CONDITIONS} conditions' weight sets: one vmapped gb.apply against {CONDITIONS} calls"
    text = header_md(title)
    text += "\n" + markdown_table(columns, shown) + "\n"
    write_results(args.out, text)
    write_json(RESULTS / "bench_condition.json", rows)


if __name__ == "__main__":
    main()
