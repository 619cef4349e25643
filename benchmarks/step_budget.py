"""What the step-time targets ask of the weight generation, against this machine's sgemm.

`bench_step.py` times whole training steps. This script times, in the same interleaved
rounds, each genome's generation alone (`gb.apply` and its backward for given weight
gradients, no p-net), eagerly and compiled, and a 1024^3 sgemm on the same threads. A step
at ratio `r` of the plain step, with target `t`, is `(r - t) * plain ms` over it; if nothing
else in the step changes, the generation must lose those milliseconds. The table gives the
time that leaves it, and the FLOP rate that is: FLOPs as `bench_generation.py`'s roofline
counts them (`Stack.tile_flops` forward, three times that forward and backward), as a share of
the sgemm rate. A share near or above 100% means the target cannot be reached by faster
generation code of the same arithmetic; "none left" that the rest of the step alone exceeds it.

    python -m benchmarks.step_budget            # the MLP's genomes with a target in issue 12
    python -m benchmarks.step_budget --quick    # fewer rounds

Writes what it prints to `benchmarks/results/step_budget.md` under the command, machine and date.
"""

import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from torch.func import grad

import gbfunc as gb
from benchmarks._meta import RESULTS, benchmark_parser, compile_static, generation_flops, recorded
from benchmarks.bench_step import (
    MLP_GENOMES,
    Timing,
    cross_entropy,
    dense_steps,
    gb_steps,
    mlp,
    round_ms,
)

# Issue 12's targets (x the plain step in the same mode), by bench_step's genome label.
TARGETS: dict[str, dict[str, float]] = {
    "default genome (torchGB), tile 128": {"compiled": 1.5},
    "default genome, compression=10": {"eager": 2.0, "compiled": 1.6},
    "outputs 16, tile 128": {"compiled": 1.6},
    "row g-nets, hidden 8, tile 128": {"eager": 1.2, "compiled": 1.15},
    "row g-nets, hidden 16, tile 256": {"eager": 1.2, "compiled": 1.15},
}


def generation_steps(
    plan: gb.Plan, gparams: dict, cotangents: dict[str, torch.Tensor]
) -> tuple[Callable[[], None], Callable[[], dict]]:
    """(eager, compiled) generation of `plan`'s weights from `gparams` and the backward of the
    weight gradients `cotangents`: `gb.apply` as a step calls it, without the p-net. The eager
    pass leaves the gradients in `gparams`' leaves; the compiled one returns them, and the
    weights."""
    leaves = torch.utils._pytree.tree_leaves(gparams)

    def eager() -> None:
        for leaf in leaves:
            leaf.grad = None
        params = gb.apply(gparams, plan)
        names = list(cotangents)
        torch.autograd.backward([params[n] for n in names], [cotangents[n] for n in names])

    def linear_loss(tree: dict, cotangents: dict) -> tuple[torch.Tensor, dict]:
        params = gb.apply(tree, plan)
        return sum((params[n] * g).sum() for n, g in cotangents.items()), params

    # The gradient of a linear loss is the pullback of `cotangents`. The weights come back
    # too, as a step uses them: a gradient alone does not need the forward's output, and
    # inductor drops its computation (a third of torchGB's generation, measured).
    fixed = torch.utils._pytree.tree_map(torch.Tensor.detach, gparams)
    compiled_grad = compile_static(grad(linear_loss, has_aux=True))
    return eager, lambda: compiled_grad(fixed, cotangents)


def sgemm_gflops(ms: float, n: int = 1024) -> float:
    """GFLOP/s of an `n`^3 matmul that took `ms`."""
    return 2 * n**3 / ms / 1e6


def generation_budget(generation_ms: float, ratio: float, target: float, plain_ms: float) -> float:
    """Ms the generation may take for a step at `ratio` x the plain step to reach `target` x,
    the rest of the step unchanged (zero or less: the rest alone is over the target)."""
    return generation_ms - (ratio - target) * plain_ms


def run(labels: list[str], rounds: int, inner: int) -> None:
    torch.manual_seed(0)
    batch = (torch.randn(128, 784), torch.randint(0, 10, (128,)))
    model = mlp()
    x, y = torch.randn(1024, 1024), torch.randn(1024, 1024)
    steps: dict[str, Callable[[], object]] = {"sgemm": lambda: torch.mm(x, y)}
    steps["plain eager"], steps["plain compiled"] = dense_steps(model, batch, cross_entropy)
    flops = {}
    for label in labels:
        plan = gb.plan(model, **MLP_GENOMES[label])
        flops[label] = 3 * generation_flops(plan)  # forward and backward, as the roofline counts
        steps[f"{label} eager"], steps[f"{label} compiled"] = gb_steps(
            model, plan, batch, cross_entropy
        )
        cotangents = {p.name: torch.randn(p.shape) for p in plan.generated}
        steps[f"{label} gen eager"], steps[f"{label} gen compiled"] = generation_steps(
            plan, gb.init(plan), cotangents
        )
    samples, _ = round_ms(steps, rounds, inner)
    ms = {k: statistics.median(v) for k, v in samples.items()}
    peak = sgemm_gflops(ms["sgemm"])
    threads = torch.get_num_threads()
    print(f"\n## MLP 784-512-512-10, batch 128  (torch {torch.__version__}, {threads} threads)")
    plain = f"plain step {ms['plain eager']:.2f} ms eager, {ms['plain compiled']:.2f} ms compiled"
    print(f"sgemm 1024^3: {peak:.0f} GFLOP/s; {plain}")
    head = f"{'variant':<36}{'mode':<9}{'step x plain':>13}{'gen ms':>8}{'GFLOP/s':>9}{'sgemm':>7}"
    print(head + f"{'target':>8}{'gen ms for it':>15}{'GFLOP/s':>9}{'sgemm':>7}")
    for label in labels:
        for mode in ("eager", "compiled"):
            ratio = Timing.of(samples[f"{label} {mode}"], samples[f"plain {mode}"]).ratio
            gen = ms[f"{label} gen {mode}"]
            rate = flops[label] / gen / 1e6
            row = f"{label:<36}{mode:<9}{ratio:>12.2f}x{gen:>8.2f}{rate:>9.0f}{rate / peak:>7.0%}"
            target = TARGETS.get(label, {}).get(mode)
            if target is not None:
                need = generation_budget(gen, ratio, target, ms[f"plain {mode}"])
                if need <= 0:
                    row += f"{target:>7.2f}x{'none left':>15}{'-':>9}{'-':>7}"
                else:
                    need_rate = flops[label] / need / 1e6
                    row += f"{target:>7.2f}x{need:>15.2f}{need_rate:>9.0f}{need_rate / peak:>7.0%}"
            print(row)


def main() -> None:
    parser = benchmark_parser(__doc__, quick="fewer rounds")
    parser.add_argument("--genome", action="append", choices=list(MLP_GENOMES), dest="genomes")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_budget.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, inner = (5, 5) if args.quick else (15, 10)
    with recorded(args.out, "What the step-time targets ask of the weight generation"):
        print(f"rounds: {rounds} x {inner} calls, interleaved")
        run(args.genomes or list(TARGETS), rounds, inner)


if __name__ == "__main__":
    main()
