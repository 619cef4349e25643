"""One training step of gbfunc vs the same model trained directly, eager and compiled.

A step is: generate the weights (gbfunc only), forward, loss, backward, AdamW update. Both
sides use the same optimizer maths: `torch.optim.AdamW(foreach=True)` eagerly, and the
functional `gb.optim.adamw_update` inside one `torch.compile(fullgraph=True)` step when
compiled. Timings are medians over interleaved rounds; ratios to the plain model in the same
mode are medians of the per-round ratios, with their quartiles (the last column), from one
run. "first s" is the first eager step, which compiles what `gb.apply`'s default
`compile=None` compiles (the plan's graph, or the tile MLP of large stacks); for those
genomes the column before the last times the eager step without it (`compile=False`), in the
same rounds.

    python -m benchmarks.bench_step            # MLP 784-512-512-10 and the main job's transformer
    python -m benchmarks.bench_step --quick    # fewer rounds

Writes what it prints to `benchmarks/results/bench_step.md` under the command, machine and date.
"""

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, grad_and_value

import gbfunc as gb
from benchmarks._meta import RESULTS, benchmark_parser, compile_static, recorded
from examples.models import CharTransformer
from examples.tasks import CharLMConfig

Step = Callable[[], object]


@dataclass
class TrainStep:
    """One training step (call it) and the tensors it keeps between steps (for memory)."""

    run: Callable[[], None]
    held: Callable[[], list[torch.Tensor]]

    def __call__(self) -> None:
        self.run()


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def dense_steps(model: nn.Module, batch: tuple, loss_of) -> tuple[TrainStep, TrainStep]:
    """(eager, compiled) steps of the model trained directly."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def eager() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of(model(*batch[:-1]), batch[-1]).backward()
        opt.step()

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    tree = {"stacks": {}, "free": params, "frozen": {}}
    compiled = _compiled_step(tree, lambda tree: tree["free"], model, batch, loss_of)
    return TrainStep(eager, lambda: _with_state(list(model.parameters()), opt)), compiled


def gb_steps(
    model: nn.Module,
    plan: gb.Plan,
    batch: tuple,
    loss_of,
    *,
    eager_compile: bool | None = None,
    device: torch.device | None = None,
) -> tuple[TrainStep, TrainStep]:
    """(eager, compiled) steps of the same model with generated weights on `device`;
    `eager_compile` is `gb.apply`'s `compile` in the eager step."""
    gparams = gb.init(plan, device=device)
    opt = torch.optim.AdamW(torch.utils._pytree.tree_leaves(gparams), lr=1e-3, foreach=True)

    def eager() -> None:
        opt.zero_grad(set_to_none=True)
        out = functional_call(model, gb.apply(gparams, plan, compile=eager_compile), batch[:-1])
        loss_of(out, batch[-1]).backward()
        opt.step()

    fresh = gb.init(plan, device=device, requires_grad=False)
    generate = lambda tree: gb.apply(tree, plan)
    compiled = _compiled_step(fresh, generate, model, batch, loss_of)
    leaves = torch.utils._pytree.tree_leaves(gparams)
    return TrainStep(eager, lambda: _with_state(leaves, opt)), compiled


def _with_state(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """`params`, their gradients and the optimizer's state tensors."""
    grads = [p.grad for p in params if p.grad is not None]
    state = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    return params + grads + state


def _compiled_step(
    tree: dict, params_of: Callable[[dict], dict], model: nn.Module, batch: tuple, loss_of
) -> TrainStep:
    """One compiled functional AdamW step on `tree`, the model's parameters `params_of(tree)`."""
    state = [tree, gb.optim.adamw_init(tree)]

    def loss(tree, *batch):
        return loss_of(functional_call(model, params_of(tree), batch[:-1]), batch[-1])

    def step(tree, opt_state, *batch):
        grads, value = grad_and_value(loss)(tree, *batch)
        tree, opt_state = gb.optim.adamw_update(tree, grads, opt_state, lr=1e-3)
        return tree, opt_state, value

    compiled_step = compile_static(step)

    def compiled() -> None:
        state[0], state[1], _ = compiled_step(state[0], state[1], *batch)

    return TrainStep(compiled, lambda: torch.utils._pytree.tree_leaves(state))


def round_ms(
    steps: dict[str, Step], rounds: int, inner: int, sync: Callable[[], None] = lambda: None
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Ms per call of every step in each of `rounds` interleaved, rotated rounds; and the
    seconds of each step's first call (which compiles). `sync` waits for the device's queued
    work (`torch.cuda.synchronize` on a GPU), inside each timed span."""
    first = {}
    for name, fn in steps.items():  # warm up (and compile)
        start = time.perf_counter()
        fn()
        sync()
        first[name] = time.perf_counter() - start
        for _ in range(2):
            fn()
        sync()
    # Compiling leaves many objects behind; a garbage collection inside a timed round would be
    # charged to whichever step triggered it (timeit turns gc off for the same reason).
    gc.collect()
    gc.freeze()
    samples: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps.items())
    for r in range(rounds):
        # Rotate the order every round: a step's time depends a little on what ran before it.
        for name, fn in order[r % len(order) :] + order[: r % len(order)]:
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            samples[name].append((time.perf_counter() - start) / inner * 1e3)
    return samples, first


def median_ms(
    steps: dict[str, Step], rounds: int, inner: int, sync: Callable[[], None] = lambda: None
) -> tuple[dict[str, float], dict[str, float]]:
    """Median ms per call of every step over `round_ms`' rounds, and the first calls' seconds."""
    samples, first = round_ms(steps, rounds, inner, sync)
    return {k: statistics.median(v) for k, v in samples.items()}, first


@dataclass
class Timing:
    """A step's median ms, and its ratios to a baseline's time in the same rounds."""

    ms: float
    ratios: list[float]

    @classmethod
    def of(cls, samples: list[float], baseline: list[float]) -> "Timing":
        return cls(
            statistics.median(samples), [s / b for s, b in zip(samples, baseline, strict=True)]
        )

    @property
    def ratio(self) -> float:
        """The median of the per-round ratios: a round times every step within about a second,
        so the machine's drift between rounds (its speed moved by 20% in one run) cancels."""
        return statistics.median(self.ratios)

    @property
    def quartiles(self) -> str:
        low, _, high = statistics.quantiles(self.ratios, n=4)
        return f"{low:.2f}-{high:.2f}"


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def baseline(variant: str) -> str:
    """The plain step a variant's times are divided by: the compiled one for a compiled step,
    else the eager one. By the suffix: "... eager uncompiled" holds "compiled" too, and a
    test for the word divided it by the plain compiled step."""
    return "plain compiled" if variant.endswith(" compiled") else "plain eager"


def run(
    title: str, model: nn.Module, batch: tuple, genomes: dict[str, dict], rounds: int, inner: int
) -> None:
    steps: dict[str, Step] = {}
    steps["plain eager"], steps["plain compiled"] = dense_steps(model, batch, cross_entropy)
    ratios = {}
    for label, kwargs in genomes.items():
        plan = gb.plan(model, **kwargs)
        rep = gb.report(plan)
        ratios[label] = rep.generated_compression
        steps[f"{label} eager"], steps[f"{label} compiled"] = gb_steps(
            model, plan, batch, cross_entropy
        )
        if set(gb.explain(gb.init(plan), plan).route.stacks) != {"torch"}:  # compiles eagerly
            steps[f"{label} eager uncompiled"], _ = gb_steps(
                model, plan, batch, cross_entropy, eager_compile=False
            )
    samples, first = round_ms(steps, rounds, inner)
    times = {name: Timing.of(v, samples[baseline(name)]) for name, v in samples.items()}
    print(f"\n## {title}  (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    head = ("variant", "compression", "eager ms", "x plain", "compiled ms", "x plain", "first s")
    print(
        f"{head[0]:<34}{head[1]:>12}{head[2]:>10}{head[3]:>9}{head[4]:>13}{head[5]:>9}{head[6]:>9}"
        f"  {'eager, compile=False':<19}  x plain, quartiles (eager; compiled)"
    )
    e, c = times["plain eager"], times["plain compiled"]
    print(
        f"{'plain model':<34}{'1.0x':>12}{e.ms:>10.2f}{1:>9.2f}{c.ms:>13.2f}{1:>9.2f}"
        f"{first['plain eager']:>9.1f}  {'-':<19}  -"
    )
    for label in genomes:
        e, c = times[f"{label} eager"], times[f"{label} compiled"]
        plain = times.get(f"{label} eager uncompiled")
        before = "-" if plain is None else f"{plain.ms:.2f} ms, {plain.ratio:.2f}x"
        print(
            f"{label:<34}{ratios[label]:>11.1f}x{e.ms:>10.2f}{e.ratio:>9.2f}"
            f"{c.ms:>13.2f}{c.ratio:>9.2f}{first[f'{label} eager']:>9.1f}  {before:<19}"
            f"  {e.quartiles}; {c.quartiles}"
        )


# The hashed genome: each weight one tile, tables sized to 20x the generated weights.
HASHED_20X = {
    "tile": "full",
    "hidden": 4,
    "hashed": "auto",
    "compression": 20,
    "compression_of": "generated",
}

MLP_GENOMES = {
    "default genome (torchGB), tile 128": {"tile": (128, 128)},
    "default genome, compression=10": {"compression": 10, "compression_of": "generated"},
    "hidden 8, tile 64": {"tile": (64, 64), "hidden": 8},
    "outputs 16, tile 128": {"tile": (128, 128), "outputs": 16},
    "hidden 8, outputs 8, tile 64": {"tile": (64, 64), "hidden": 8, "outputs": 8},
    "shared + embeddings, tile 64": {"tile": (64, 64), "share": True, "hidden": 16},
    "row g-nets, hidden 8, tile 128": {"tile": (128, 128), "hidden": 8, "outputs": 128},
    "row g-nets, hidden 16, tile 256": {"tile": (256, 256), "hidden": 16, "outputs": 256},
    "hashed genome, tile full, 20x": HASHED_20X,
}
# "row g-nets": `outputs` = the tile width, so one evaluation emits a whole tile row and the
# output layer is one (TH, H) @ (H, TW) matmul per tile: the fastest genome on CPU.

TRANSFORMER_GENOMES = {
    "default genome, compression=20": {"compression": 20, "compression_of": "generated"},
    "hidden 8, compression=20": {"compression": 20, "compression_of": "generated", "hidden": 8},
}
# The main job's transformer genome until it became the hashed one (the committed results
# call it "main job's plan"): (64, 64) tiles, 8 hidden units, 8 outputs, the head free.
TILED_PLAN = {"tile": (64, 64), "hidden": 8, "outputs": 8, "overrides": {"head.weight": "free"}}


def main() -> None:
    parser = benchmark_parser(__doc__, quick="fewer rounds")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_step.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rounds, inner = (5, 5) if args.quick else (15, 10)
    with recorded(args.out, "One training step: gbfunc vs the model trained directly"):
        print(f"rounds: {rounds} x {inner} steps")
        for title, model, batch, genomes in workloads():
            run(title, model, batch, genomes, rounds, inner)


def workloads() -> list[tuple[str, nn.Module, tuple, dict[str, dict]]]:
    """(title, model, batch, genomes) of the MLP and of the main job's transformer."""
    mlp_batch = (torch.randn(128, 784), torch.randint(0, 10, (128,)))
    mlp_model = mlp()  # drawn in this order since the committed runs
    cfg = CharLMConfig()
    model = CharTransformer(96, cfg.context, cfg.width, cfg.depth, cfg.heads)
    idx = torch.randint(0, 96, (cfg.batch, cfg.context + 1))
    genomes = TRANSFORMER_GENOMES | {
        "main job's tiled plan": TILED_PLAN,
        "main job's plan (hashed genome)": cfg.plan,
    }
    title = f"main job's character transformer (width {cfg.width}, batch {cfg.batch}x{cfg.context})"
    return [
        ("MLP 784-512-512-10, batch 128", mlp_model, mlp_batch, MLP_GENOMES),
        (title, model, (idx[:, :-1], idx[:, 1:]), genomes),
    ]


if __name__ == "__main__":
    main()
