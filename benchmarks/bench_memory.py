"""Peak memory of one training step: gbfunc vs the same model trained directly, eager and compiled.

The steps, models and genomes are `benchmarks/bench_step.py`'s (generate, forward, loss,
backward, AdamW). A step's peak is what it holds between steps (the model's parameters, or
the g-nets and free parameters; their gradients; AdamW's state) plus the most torch's CPU
allocator holds above that while the step runs (`benchmarks._meta.peak_bytes`: generated
weights, activations, gradients, temporaries). Not counted, on either side: the batch, and
the module that gbfunc's steps call through `functional_call` (which supplies every weight,
so the module's own are never read).

    python -m benchmarks.bench_memory

Writes what it prints to `benchmarks/results/bench_memory.md` under the command, machine and
date. Memory does not depend on load, so one measurement per step suffices.
"""

import torch
from torch import nn

import gbfunc as gb
from benchmarks._meta import cpu_benchmark_args, held_bytes, peak_bytes, recorded
from benchmarks.bench_step import TrainStep, cross_entropy, dense_steps, gb_steps, workloads

MiB = 2**20


def step_memory(step: TrainStep) -> tuple[float, float]:
    """(MiB held between steps, MiB at the step's peak) after two warm-up steps."""
    step()
    step()  # the first compiles; the second leaves the steady state (gradients, AdamW state)
    held = held_bytes(step.held())
    return held / MiB, (held + peak_bytes(step)) / MiB


def run(title: str, model: nn.Module, batch: tuple, genomes: dict[str, dict]) -> None:
    print(f"\n## {title}  (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    head = ["variant", "compression"]
    head += [f"{m} {c}" for m in ("eager", "compiled") for c in ("held MiB", "peak MiB", "x plain")]
    print(f"{head[0]:<34}{head[1]:>12}" + "".join(f"{h:>18}" for h in head[2:]))
    eager, compiled = dense_steps(model, batch, cross_entropy)
    plain = (step_memory(eager), step_memory(compiled))
    print(_row("plain model", 1.0, plain, plain))
    for label, kwargs in genomes.items():
        plan = gb.plan(model, **kwargs)
        eager, compiled = gb_steps(model, plan, batch, cross_entropy)
        ratio = gb.report(plan).generated_compression
        print(_row(label, ratio, (step_memory(eager), step_memory(compiled)), plain))


def _row(label: str, ratio: float, modes: tuple, plain: tuple) -> str:
    cells = []
    for (held, peak), (_, plain_peak) in zip(modes, plain, strict=True):
        cells += [f"{held:.2f}", f"{peak:.2f}", f"{peak / plain_peak:.2f}"]
    return f"{label:<34}{ratio:>11.1f}x" + "".join(f"{c:>18}" for c in cells)


def main() -> None:
    args = cpu_benchmark_args(__doc__, "bench_memory.md")
    torch.manual_seed(0)
    with recorded(
        args.out, "Peak memory of one training step: gbfunc vs the model trained directly"
    ):
        for title, model, batch, genomes in workloads():
            run(title, model, batch, genomes)


if __name__ == "__main__":
    main()
