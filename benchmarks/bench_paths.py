"""Each generation path of the dispatcher against the one it would fall back to: does it earn
its keep? (`gbfunc/generate/`, one module per path; `gb.explain` names the paths.)

    python -m benchmarks.bench_paths           # results/bench_paths.md
    python -m benchmarks.bench_paths --quick   # fewer rounds
    python -m benchmarks.bench_paths --variants-only   # the variants section alone

For the MLP 784-512-512-10's genomes of `bench_step`, the generation alone (`gb.apply`, then
the backward of a fixed linear function of the weights) is timed eagerly on every path the
dispatcher can take for it, each stack sent down it, interleaved in one run: `cpu-loops`,
`graph` (one-layer ReLU stacks then run the loops inside the graph, as the dispatcher has
it), `compiled-mlp` and `torch` (`compile=False`); then evaluation under `torch.no_grad()`
(`compile=None`: `cpu-loops` where they apply) against `torch`. A path's ratio is its time
over the fastest other path of the same genome.

Then the torch path's traced variants (`gbfunc.generate._traced_forms.FORMS`, which `gb.explain`
names): for each, on genomes of the same MLP where it is chosen, the generation compiled
(`torch.compile(fullgraph=True)`: `gb.apply`'s weights and a fixed linear function of them,
every stack on the `torch` path, then the backward) with that variant and with each
neighbour that could serve the same stacks, forced within this script only (`Forced`:
`_traced_forms.forward_form`, which the route reads, replaced while the compiled code is traced
and run; a one-output neighbour that reads units-major column terms, `by-columns` or `c-loops` on
tiles narrower than a vector register, is given them too). Each forced neighbour's weights
and gradients are checked equal to the variant's (to rounding) before it is timed. Ratios
are the variant's time over a neighbour's, per interleaved round: the median and the
rounds' spread (25th-75th percentile); a variant earns its keep where its ratio to every
neighbour is below 1 beyond that spread (the 75th percentile under 1).
"""

import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

import gbfunc as gb
from benchmarks._meta import compile_static, cpu_benchmark_args, recorded
from benchmarks.bench_step import HASHED_20X, Timing, median_ms, mlp, round_ms
from gbfunc._apply import op_by_op
from gbfunc._select import Selection
from gbfunc.generate import _traced_forms, graph
from gbfunc.generate._traced_forms import tile_form

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
            return graph.generate(plan, gparams, None, None, op_by_op)
        return Selection.whole(plan).apply(gparams, paths=paths)

    def run() -> None:
        out = generated()
        sum((out[n] * w).sum() for n, w in weights.items()).backward()

    return run


class VariantCase(NamedTuple):
    """A genome of the MLP on whose stacks, traced on the `torch` path, `variant` is chosen,
    and the `neighbours`: the other forms that could serve those stacks."""

    variant: str
    genome: str
    options: dict
    neighbours: tuple[str, ...]


# Per variant, the genomes it is measured on. One-output stacks go to `c-loops`,
# `by-columns` or `by-units` (the first two read units-major column terms, which narrow tiles
# are given here when forced); one-layer stacks of several outputs to `c-loops` (1-64
# outputs), `unrolled` or `units-major`; deeper g-nets only to `units-major` (no neighbour).
# Shared stacks stay off the `cpu-loops` path; the others are sent down `torch` all the same.
VARIANT_CASES = (
    VariantCase(
        "c-loops",
        "one output: shared + embeddings, hidden 16, tile 64",
        {"tile": (64, 64), "share": True, "hidden": 16},
        ("by-columns", "by-units"),
    ),
    VariantCase(
        "c-loops",
        "few outputs: hidden 8, outputs 8, tile 64",
        {"tile": (64, 64), "hidden": 8, "outputs": 8},
        ("unrolled", "units-major"),
    ),
    VariantCase(
        "by-columns",
        "tanh, hidden 8, tile 64",
        {"tile": (64, 64), "hidden": 8, "activation": "tanh"},
        ("by-units",),
    ),
    VariantCase(
        "by-units",
        "narrow tiles: hidden 8, tile 64x8",
        {"tile": (64, 8), "hidden": 8},
        ("by-columns", "c-loops"),
    ),
    VariantCase(
        "unrolled",
        "tanh, hidden 8, outputs 8, tile 64",
        {"tile": (64, 64), "hidden": 8, "outputs": 8, "activation": "tanh"},
        ("units-major",),
    ),
    VariantCase(
        "units-major",
        "row g-nets, hidden 8, tile 128",
        {"tile": (128, 128), "hidden": 8, "outputs": 128},
        ("unrolled",),
    ),
    VariantCase(
        "c-loops",
        "hidden 8, outputs 32, tile 128",
        {"tile": (128, 128), "hidden": 8, "outputs": 32},
        ("unrolled", "units-major"),
    ),
    VariantCase(
        "units-major",
        "hidden 8, outputs 64, tile 128",
        {"tile": (128, 128), "hidden": 8, "outputs": 64},
        ("unrolled", "c-loops"),
    ),
)


class Forced:
    """A context inside which traced tile MLP forwards run `form` (None: the one
    `forward_form` chooses), each form run added to `ran`; a one-output `form` that reads
    units-major column terms is given them (`_traced_forms.reads_units_major_columns`). Its
    replacements are made once, so that code compiled inside it, whose guards hold them,
    runs inside it again without recompiling."""

    def __init__(self, form: str | None) -> None:
        self.ran: set[str] = set()
        chosen = _traced_forms.forward_form

        # Called as it is traced, not traced itself: dynamo would guard on `ran`'s contents.
        @torch.compiler.assume_constant_result
        def forward_form(**kwargs) -> str:
            taken = form if form is not None and kwargs["traced"] else chosen(**kwargs)
            self.ran.add(taken)
            return taken

        self.replacements: list[tuple[object, str, Callable]] = [
            (_traced_forms, "forward_form", forward_form)
        ]
        if form in ("by-columns", "c-loops"):
            self.replacements.append((_traced_forms, "reads_units_major_columns", lambda *_: True))
        self.saved: list[Callable] = []

    def __enter__(self) -> None:
        self.saved = [getattr(module, name) for module, name, _ in self.replacements]
        for module, name, replacement in self.replacements:
            setattr(module, name, replacement)

    def __exit__(self, *exc: object) -> None:
        for (module, name, _), saved in zip(self.replacements, self.saved, strict=True):
            setattr(module, name, saved)


class VariantRun(NamedTuple):
    """A compiled generation with one form forced (`step`: forward and backward), and its
    weights and the g-nets' gradients from one call (`check`)."""

    step: Callable[[], None]
    check: Callable[[], tuple[dict[str, Tensor], list[Tensor], set[str]]]


def variant_run(
    plan: gb.Plan,
    gparams: dict,
    weights: dict,
    form: str | None,
    compiler: Callable[[Callable], Callable] = compile_static,
) -> VariantRun:
    """`gb.apply`'s generation of `plan` with every stack on the `torch` path and its tile
    MLPs' traced forward `form` (`Forced`), compiled by `compiler`, with the backward of the
    weights' linear function `weights`."""
    paths = ("torch",) * len(plan.stacks)
    leaves = [x for s in gparams["stacks"].values() for x in s.values() if x.requires_grad]

    def generation(gparams: dict) -> tuple[Tensor, dict[str, Tensor]]:
        out = Selection.whole(plan).apply(gparams, paths=paths)
        return sum((out[n] * w).sum() for n, w in weights.items()), out

    compiled = compiler(generation)
    forced = Forced(form)

    def step() -> dict[str, Tensor]:
        with forced:
            loss, out = compiled(gparams)
        loss.backward()
        return out

    def check() -> tuple[dict[str, Tensor], list[Tensor], set[str]]:
        for leaf in leaves:
            leaf.grad = None
        forced.ran.clear()
        out = step()
        grads = [leaf.grad.clone() for leaf in leaves]
        return {n: out[n].detach().clone() for n in weights}, grads, set(forced.ran)

    return VariantRun(step, check)


def relative_difference(got: list[Tensor], want: list[Tensor]) -> float:
    """The largest `|got - want|` over the largest `|want|`, of every pair."""
    return max(
        float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))
        for g, w in zip(got, want, strict=True)
    )


def compare_variants(
    case: VariantCase,
    model: torch.nn.Module,
    rounds: int,
    inner: int,
    compiler: Callable[[Callable], Callable] = compile_static,
) -> tuple[dict[str, Timing], dict[str, tuple[float, float]]]:
    """`case`'s variant and each neighbour: per form its `Timing`, its ms and per round the
    variant's time over its (the variant's own: 1); and its weights' and gradients' largest
    relative difference from the variant's. Raises where the variant is not the one chosen,
    a forced form did not run, or a neighbour's results differ beyond rounding."""
    plan = gb.plan(model, **case.options)
    gparams = gb.init(plan)
    for stack in plan.stacks:
        w_in = gparams["stacks"][stack.key]["w_in"]
        chosen = tile_form(stack, w_in, traced=True, exporting=False)
        if chosen != case.variant:
            raise AssertionError(f"{case.genome}: {stack.key} chooses {chosen}, not {case.variant}")
    weights = {p.name: torch.randn(p.shape) for p in plan.generated}
    runs = {
        form: variant_run(plan, gparams, weights, None if form == case.variant else form, compiler)
        for form in (case.variant, *case.neighbours)
    }
    differences = {}
    for form, run in runs.items():
        out, grads, ran = run.check()
        if ran != {form}:
            raise AssertionError(f"{case.genome}: forcing {form} ran {sorted(ran)}")
        values = [out[n] for n in weights]
        if not differences:
            reference = values, grads
        differences[form] = (
            relative_difference(values, reference[0]),
            relative_difference(grads, reference[1]),
        )
        if max(differences[form]) > 1e-4:
            raise AssertionError(f"{case.genome}: {form} differs from {case.variant}")
    samples, _ = round_ms({f: r.step for f, r in runs.items()}, rounds, inner)
    variant = samples[case.variant]
    timings = {
        f: Timing(statistics.median(v), [a / b for a, b in zip(variant, v, strict=True)])
        for f, v in samples.items()
    }
    return timings, differences


def print_variants(model: torch.nn.Module, quick: bool) -> None:
    """The variants section: per case, each form's ms and the variant's time over it, then one
    line per case with the variant's time over its best neighbour's."""
    rounds, inner = (5, 3) if quick else (21, 10)
    print(f"\ntorch path variants, compiled generation fwd+bwd; {rounds} rounds x {inner} calls")
    print(
        "variant      genome                                              form          ms"
        "  variant/it (p25-p75)  rel. diff weights, grads"
    )
    summary = []
    for case in VARIANT_CASES:
        timings, differences = compare_variants(case, model, rounds, inner)
        for form, t in timings.items():
            w, g = differences[form]
            print(
                f"{case.variant:12s} {case.genome:51s} {form:11s} {t.ms:7.2f}"
                f"  {t.ratio:10.2f} ({t.quartiles})  {w:.0e}, {g:.0e}"
            )
        best = min(case.neighbours, key=lambda f: timings[f].ms)
        summary.append((case, best, timings[best]))
    print("\nvariant time / best neighbour's: median of the rounds' ratios (p25-p75)")
    for case, best, t in summary:
        print(f"{case.variant:12s} {case.genome:51s} vs {best:11s} {t.ratio:5.2f} ({t.quartiles})")


def print_paths(model: torch.nn.Module, quick: bool) -> None:
    """The paths' tables: each path against the fastest other, then evaluation."""
    rounds, inner = (5, 5) if quick else (15, 10)
    print("genome                                path           fwd+bwd ms  x best other")
    for name, options in GENOMES.items():
        plan = gb.plan(model, **options)
        weights = {p.name: torch.randn(p.shape) for p in plan.generated}
        steps = {}
        for path in ("cpu-loops", "graph", "compiled-mlp", "torch"):
            step = generation(plan, path, weights)
            if step is not None:
                steps[path] = step
        ms, _ = median_ms(steps, rounds, inner)
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
        ms, _ = median_ms(evaluations, rounds, inner)
        ratio = ms["default"] / ms["torch"]
        print(f"{name:37s} {'+'.join(taken):14s} {ms['default']:10.2f}  {ratio:6.2f} x torch")


def main() -> None:
    args = cpu_benchmark_args(
        __doc__,
        "bench_paths.md",
        quick="fewer rounds",
        variants_only="the torch path's variants alone, not the paths",
    )
    torch.manual_seed(0)
    model = mlp()
    with recorded(args.out, "Generation paths against their fallbacks"):
        print(f"torch {torch.__version__}, {args.threads} threads; CPU loops: {gb.cpu.mode()}")
        if not args.variants_only:
            print_paths(model, args.quick)
        print_variants(model, args.quick)


if __name__ == "__main__":
    main()
