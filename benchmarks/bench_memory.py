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

    python -m benchmarks.bench_memory --init

measures `gb.init` instead (into `bench_memory_init.md`): its peak, counted as above, beside
the generated weights of the plan's largest stack in float32, and the peak of the same init on
`device="meta"`. The plans are made from models on `meta`, so every leaf is drawn.
"""

from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch import nn

import gbfunc as gb
from benchmarks._meta import RESULTS, cpu_benchmark_args, held_bytes, peak_bytes, recorded
from benchmarks.bench_step import TrainStep, cross_entropy, dense_steps, gb_steps, workloads
from examples.models import CharTransformer
from examples.tasks import CharLMConfig

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


def init_workloads() -> dict[str, tuple[Callable[[], nn.Module], dict]]:
    """Models (made on `meta`) and plan options for `gb.init`'s peak: the 4096 x 4096 layer
    of issue 53 and others with more hidden units, tile outputs, layers or sharing."""
    cfg = CharLMConfig()
    return {
        "Linear 1024x1024, tile 16, hidden 8": (lambda: nn.Linear(1024, 1024), _SMALL),
        "Linear 4096x4096, tile 16, hidden 8": (lambda: nn.Linear(4096, 4096), _SMALL),
        "8 x Linear 4096x4096, tile 16, hidden 8": (
            lambda: nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(8))),
            _SMALL,
        ),
        "Linear 4096x4096, default genome, tile 128": (
            lambda: nn.Linear(4096, 4096),
            {"tile": (128, 128)},
        ),
        "Linear 4096x4096, default genome, tile full": (
            lambda: nn.Linear(4096, 4096),
            {"tile": "full"},
        ),
        "Linear 4096x4096, shared, tile 64": (
            lambda: nn.Linear(4096, 4096),
            {"tile": (64, 64), "share": True},
        ),
        "Linear 4096x4096, depth 2, outputs 8, tile 64": (
            lambda: nn.Linear(4096, 4096),
            {"tile": (64, 64), "depth": 2, "hidden": 16, "outputs": 8},
        ),
        "main job's transformer, default genome, 20x": (
            lambda: CharTransformer(96, cfg.context, cfg.width, cfg.depth, cfg.heads),
            {"compression": 20, "compression_of": "generated"},
        ),
    }


_SMALL = {"tile": (16, 16), "hidden": 8}


def run_init() -> None:
    print(f"\n## gb.init  (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    head = ("largest stack MiB", "gparams MiB", "init peak MiB", "x largest", "meta peak MiB")
    print(f"{'variant':<48}" + "".join(f"{h:>19}" for h in head))
    for label, (make, options) in init_workloads().items():
        with torch.device("meta"):
            model = make()
        plan = gb.plan(model, **options)
        largest = max(
            sum(p.numel for p in plan.generated if p.stack_index == i) * 4
            for i in range(len(plan.stacks))
        )
        held = held_bytes(pytree.tree_leaves(gb.init(plan)))
        peak = peak_bytes(lambda plan=plan: gb.init(plan))
        meta = peak_bytes(lambda plan=plan: gb.init(plan, device="meta"))
        cells = (largest / MiB, held / MiB, peak / MiB, peak / largest, meta / MiB)
        print(f"{label:<48}" + "".join(f"{c:>19.2f}" for c in cells))


def main() -> None:
    args = cpu_benchmark_args(__doc__, "bench_memory.md", init="measure gb.init instead")
    torch.manual_seed(0)
    if args.init:
        default = args.out == RESULTS / "bench_memory.md"
        out = RESULTS / "bench_memory_init.md" if default else args.out
        with recorded(out, "Peak memory of gb.init against the largest stack's weights"):
            run_init()
        return
    with recorded(
        args.out, "Peak memory of one training step: gbfunc vs the model trained directly"
    ):
        for title, model, batch, genomes in workloads():
            run(title, model, batch, genomes)


if __name__ == "__main__":
    main()
