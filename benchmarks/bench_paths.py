"""Each generation path of the dispatcher against the one it would fall back to: does it earn
its keep? (`gbfunc/generate/`, one module per path; `gb.explain` names the paths.)

    python -m benchmarks.bench_paths      # results/bench_paths.md

For the MLP 784-512-512-10's genomes of `bench_step`, the generation alone (`gb.apply`, then
the backward of a fixed linear function of the weights) is timed eagerly on every path the
dispatcher can take for it, each stack sent down it, interleaved in one run: `cpu-loops`,
`graph` (one-layer ReLU stacks then run the loops inside the graph, as the dispatcher has
it), `compiled-mlp` and `torch` (`compile=False`); then evaluation under `torch.no_grad()`
(`compile=None`: `cpu-loops` where they apply) against `torch`. A path's ratio is its time
over the fastest other path of the same genome.
"""

from collections.abc import Callable

import torch

import gbfunc as gb
from benchmarks._meta import cpu_benchmark_args, recorded
from benchmarks.bench_step import HASHED_20X, median_ms, mlp
from gbfunc._select import Selection
from gbfunc.generate import graph

GENOMES = {
    "default genome (torchGB), tile 128": {"tile": (128, 128)},
    "default genome, compression=10": {"compression": 10, "compression_of": "generated"},
    "hidden 8, outputs 8, tile 64": {"tile": (64, 64), "hidden": 8, "outputs": 8},
    "shared + embeddings, tile 64": {"tile": (64, 64), "hidden": 8, "share": True},
    "row g-nets, hidden 8, tile 128": {"tile": (128, 128), "hidden": 8, "outputs": 128},
    "hashed genome, tile full, 20x": HASHED_20X,
}


def generation(plan: gb.Plan, path: str, weights: dict) -> Callable[[], None] | None:
    """One forward and backward of the generation on `path` for every stack, or None where
    `path` cannot generate this plan."""
    gparams = gb.init(plan)
    reasons = gb.explain(gparams, plan, compile=True).reasons
    if path == "cpu-loops" and any("cpu-loops" in r for r in reasons.values()):
        return None
    if path == "graph" and not all(graph.fits_graph(s) for s in plan.stacks):
        return None
    paths = (path,) * len(plan.stacks)

    def generated() -> dict:
        if path == "torch":
            return gb.apply(gparams, plan, compile=False)
        if path == "graph":
            return graph.generate(plan, gparams, None, None, Selection.generated(plan).apply)
        return Selection.whole(plan).apply(gparams, paths=paths)

    def run() -> None:
        out = generated()
        sum((out[n] * w).sum() for n, w in weights.items()).backward()

    return run


def main() -> None:
    args = cpu_benchmark_args(__doc__, "bench_paths.md")
    torch.manual_seed(0)
    model = mlp()
    with recorded(args.out, "Generation paths against their fallbacks"):
        print(f"torch {torch.__version__}, {args.threads} threads; CPU loops: {gb.cpu.mode()}")
        print("genome                                path           fwd+bwd ms  x best other")
        for name, options in GENOMES.items():
            plan = gb.plan(model, **options)
            weights = {p.name: torch.randn(p.shape) for p in plan.generated}
            steps = {}
            for path in ("cpu-loops", "graph", "compiled-mlp", "torch"):
                step = generation(plan, path, weights)
                if step is not None:
                    steps[path] = step
            ms, _ = median_ms(steps, 15, 10)
            for path, value in ms.items():
                others = [v for p, v in ms.items() if p != path]
                ratio = f"{value / min(others):6.2f}" if others else "     -"
                print(f"{name:37s} {path:14s} {value:10.2f}  {ratio}")
        print("\nevaluation under torch.no_grad(), compile=None")
        for name, options in GENOMES.items():
            plan = gb.plan(model, **options)
            gparams = gb.init(plan)
            with torch.no_grad():
                taken = sorted(set(gb.explain(gparams, plan).route.stacks))

            def evaluate(gparams=gparams, plan=plan, compile=None) -> None:
                with torch.no_grad():
                    gb.apply(gparams, plan, compile=compile)

            evaluations = {"default": evaluate, "torch": lambda e=evaluate: e(compile=False)}
            ms, _ = median_ms(evaluations, 15, 10)
            ratio = ms["default"] / ms["torch"]
            print(f"{name:37s} {'+'.join(taken):14s} {ms['default']:10.2f}  {ratio:6.2f} x torch")


if __name__ == "__main__":
    main()
