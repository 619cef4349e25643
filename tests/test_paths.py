"""Every generation path against the specification and the per-tile reference (issue 55: the
tests mirror the paths).

Each path of `gbfunc/generate/` is forced through `gb.apply`'s own knobs, never by calling its
runner: `torch` with `compile=False`; `cpu-loops`, `graph` and `compiled-mlp` with
`compile=True`, eagerly, gradients on (which of them a stack takes depends on its genome, and
`compiled-mlp` on the stack not fitting one graph); `triton` with `backend="triton"`. Every
example first asks `gb.explain` that each stack takes the path under test, then checks that
the path's weights equal `tests/naive.py`'s (one position and one tile at a time, in float64)
and the specification's `reference` laid out by tile-and-cut, and that its gradient of a
scalar loss with respect to every g-net leaf equals the `torch` path's (and, on the `torch`
path itself, the naive reference's).

The variants of the tile MLP (the forms of its forward, docs/design.md) each run on a plan
that takes them, where `gb.explain` must name the variant that the bodies run.

The compiled paths cost seconds per new graph (about 15 s per plan on 2 busy cores), so they
draw their plans from a few fixed ones, each an explicit example, and only the values of the
leaves freely; the uncompiled paths draw the shapes too.
"""

import itertools

import pytest
import torch
from devices import KERNEL_DEVICE
from hypothesis import assume, example, given, settings, strategies as st
from naive import naive_apply
from torch import Tensor, nn
from torch.utils._pytree import tree_map

import gbfunc as gb
from gbfunc import _dispatch as gb_dispatch
from gbfunc._spec import reference, stack_terms
from gbfunc._tiling import assemble
from gbfunc.cpu import _build, missing_compiler
from gbfunc.cpu._relu_loops import MIN_UNITS
from gbfunc.generate import _traced_forms, compiled_mlp, torch_ops
from gbfunc.generate.torch_ops import hashed_tiles
from gbfunc.generate.triton import HAS_TRITON

needs_loops = pytest.mark.skipif(
    _build.flavour() is None or _build.compiler() is None,
    reason="the loops are not built on this machine (mode, platform or compiler)",
)
needs_compiler = pytest.mark.skipif(
    missing_compiler(warn=False) is not None, reason="no C++ compiler: nothing compiles on CPU"
)
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# Weights against the float64 reference (as tests/test_condition.py), gradients against the
# torch path's (tests/kernels/test_backend.py's GRAD_TOLERANCE): float32 sums in different
# orders on the two sides; both absolute tolerances scale with `gain`.
WEIGHT_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
GRAD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def mlp(widths: list[int]) -> nn.Module:
    """Linear layers of `widths`, ReLUs between (weights `(out, in)`: ragged against tiles)."""
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    return nn.Sequential(*itertools.chain(*((layer, nn.ReLU()) for layer in layers)))


def init(plan: gb.Plan, seed: int, device: torch.device | str = "cpu") -> dict:
    """`gb.init(plan, seed=seed)`, hashed stacks' g-nets woken: they start at zero output
    beside their table (as tests/test_apply.py does), which would hide their gradients."""
    gparams = gb.init(plan, seed=seed, device=device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for leaves in gparams["stacks"].values():
            if "tile_hash" in leaves:
                w_out = leaves["w_out"]
                w_out.copy_(0.5 * torch.randn(w_out.shape, generator=gen))
    return gparams


def gain(gparams: dict) -> float:
    """How far the g-nets amplify rounding (tests/kernels/test_backend.py's `gain`): the
    largest output-layer weight of any g-net over 8."""
    largest = max(float(s["w_out"].detach().abs().max()) for s in gparams["stacks"].values())
    return max(1.0, largest / 8)


def spec_apply(gparams: dict, plan: gb.Plan) -> dict[str, Tensor]:
    """Every generated parameter from the specification: `reference` on each stack's terms,
    its hashed table added, laid out by tile-and-cut."""
    out = {}
    for p in plan.generated:
        stack = plan.stacks[p.stack_index]
        leaves = gparams["stacks"][stack.key]
        tiles = reference(stack_terms(stack, leaves), stack.genome.activation)
        tiles = tiles.reshape(stack.num_tiles, stack.tile[0], -1)  # (T, TH, TW * K)
        if stack.genome.hashed:
            tiles = tiles + hashed_tiles(stack, leaves["tile_hash"], traced=False)
        out[p.name] = assemble(p, stack, tiles)
    return out


def leaves_of(gparams: dict) -> list[Tensor]:
    return [x for leaves in gparams["stacks"].values() for x in leaves.values()]


def generate(gparams: dict, plan: gb.Plan, apply, seed: int) -> tuple[dict, list[Tensor]]:
    """`apply(gparams, plan)`'s generated weights and the gradient of a scalar loss of them
    (each weight against a fixed random tensor) with respect to every g-net leaf."""
    weights = apply(gparams, plan)
    gen = torch.Generator().manual_seed(seed)
    loss = sum(
        (weights[p.name] * torch.randn(p.shape, generator=gen).to(weights[p.name])).sum()
        for p in plan.generated
    )
    grads = torch.autograd.grad(loss, leaves_of(gparams))
    return {p.name: weights[p.name].detach() for p in plan.generated}, list(grads)


def torch_path(gparams, plan):
    return gb.apply(gparams, plan, compile=False)


def compiled(gparams, plan):
    return gb.apply(gparams, plan, compile=True)


def triton_path(gparams, plan):
    return gb.apply(gparams, plan, backend="triton")


def assert_weights(got: dict, gparams: dict, plan: gb.Plan) -> None:
    """`got` equals the naive reference's weights and the specification's."""
    cpu = tree_map(lambda x: x.detach().cpu(), gparams)
    k = gain(gparams)
    tolerance = {**WEIGHT_TOLERANCE, "atol": WEIGHT_TOLERANCE["atol"] * k}
    naive = naive_apply(cpu, plan)
    spec = spec_apply(cpu, plan)
    for name, weight in got.items():
        w = weight.cpu()
        torch.testing.assert_close(w, naive[name], **tolerance, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(w, spec[name], **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def assert_grads(got: list[Tensor], want: list[Tensor], gparams: dict) -> None:
    tolerance = {**GRAD_TOLERANCE, "atol": GRAD_TOLERANCE["atol"] * gain(gparams)}
    names = [f"{key}.{leaf}" for key, leaves in gparams["stacks"].items() for leaf in leaves]
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(g, w.to(g), **tolerance, msg=lambda m, n=name: f"{n}: {m}")


def assert_route(gparams: dict, plan: gb.Plan, stacks: tuple[str, ...], **knobs) -> None:
    route = gb.explain(gparams, plan, **knobs).route
    assert route.stacks == stacks, gb.explain(gparams, plan, **knobs)


TILES = [(2, 3), (4, 4), (3, 5)]


@st.composite
def plans(draw, *, widest: int = 11, loops: bool = False) -> gb.Plan:
    """A small plan over an MLP of 1 or 2 ragged layers: any genome of the issue's range, or
    (`loops`) one-layer ReLU g-nets, one per tile, row or one-output, that the loops take."""
    sizes = [draw(st.integers(2, widest)) for _ in range(draw(st.integers(2, 3)))]
    tile = draw(st.sampled_from(TILES))
    rows = min(tile[1], *sizes[:-1])  # row g-nets: a tile row per evaluation
    genome = {
        "tile": tile,
        "hashed": draw(st.sampled_from([0, 3])),
        "outputs": draw(st.sampled_from([1, rows] if loops else [1, 2, rows])),
    }
    if loops:
        genome["hidden"] = draw(st.sampled_from([MIN_UNITS, 7]))
    else:
        genome["hidden"] = draw(st.sampled_from([2, 5]))
        genome["depth"] = draw(st.integers(1, 2))
        genome["activation"] = draw(st.sampled_from(["relu", "tanh"]))
        genome["share"] = draw(st.booleans())
    return gb.plan(mlp(sizes), **genome)


SEEDS = st.integers(0, 2**16)


def tanh_rows(widths: list[int], tile: tuple[int, int], hidden: int) -> gb.Plan:
    """A ragged MLP's plan of shared, hashed, two-layer tanh row g-nets (a tile row per
    evaluation): the example the torch and Triton paths always run beside the drawn ones."""
    return gb.plan(
        mlp(widths),
        tile=tile,
        depth=2,
        activation="tanh",
        outputs=tile[1],
        hidden=hidden,
        share=True,
        hashed=3,
    )


@settings(max_examples=15, deadline=None)
@given(plans(), SEEDS)
@example(tanh_rows([9, 7, 3], (3, 5), hidden=5), 1)
def test_the_torch_path_equals_the_references(plan, seed):
    """`compile=False`: op by op; its gradients equal autograd through the naive reference."""
    gparams = init(plan, seed)
    assert_route(gparams, plan, ("torch",) * len(plan.stacks), compile=False)
    weights, grads = generate(gparams, plan, torch_path, seed)
    assert_weights(weights, gparams, plan)
    _, want = generate(gparams, plan, naive_apply, seed)
    assert_grads(grads, want, gparams)


@needs_loops
@settings(max_examples=15, deadline=None)
@given(plans(loops=True), SEEDS)
@example(gb.plan(mlp([10, 7, 3]), tile=(4, 4), hidden=6, hashed=3), 2)  # one output
@example(gb.plan(mlp([9, 8, 5]), tile=(4, 4), hidden=4, outputs=4), 3)  # row g-nets
def test_the_cpu_loops_path_equals_the_references(plan, seed):
    """`compile=True` on one-layer ReLU g-nets, eagerly: the C loops, forward and backward."""
    gparams = init(plan, seed)
    route = gb.explain(gparams, plan, compile=True).route
    assume(route.stacks == ("cpu-loops",) * len(plan.stacks))  # else a graph would compile
    weights, grads = generate(gparams, plan, compiled, seed)
    assert_weights(weights, gparams, plan)
    assert_grads(grads, generate(gparams, plan, torch_path, seed)[1], gparams)


# The graph path's plans, each compiled once (the graph is cached per plan): a ReLU stack
# the loops take inside the graph beside a shared, hashed, two-layer tanh stack of row
# g-nets; and one-layer tanh g-nets of one output, the form inductor fuses into reductions.
GRAPH_PLANS = {
    "mixed": (
        gb.plan(
            mlp([10, 7, 3]),
            tile=(4, 4),
            hidden=6,
            hashed=3,
            overrides={"2.*": {"activation": "tanh", "depth": 2, "share": True, "outputs": 2}},
        ),
        ("cpu-loops", "graph"),
    ),
    "one-output": (
        gb.plan(mlp([9, 6, 4]), tile=(3, 5), hidden=5, activation="tanh"),
        ("graph",),
    ),
}


@needs_compiler
@pytest.mark.slow
@settings(max_examples=4, deadline=None)
@given(st.sampled_from(list(GRAPH_PLANS)), SEEDS)
@example("mixed", 4)
@example("one-output", 5)
def test_the_graph_path_equals_the_references(name, seed):
    """`compile=True` with gradients on: the plan's generation as one compiled graph."""
    plan, stacks = GRAPH_PLANS[name]
    if _build.flavour() is None or _build.compiler() is None:  # no loops: all traced forms
        stacks = tuple("graph" if path == "cpu-loops" else path for path in stacks)
    gparams = init(plan, seed)
    assert_route(gparams, plan, stacks, compile=True)
    assert gb.explain(gparams, plan, compile=True).route.plan == "graph"
    weights, grads = generate(gparams, plan, compiled, seed)
    assert_weights(weights, gparams, plan)
    assert_grads(grads, generate(gparams, plan, torch_path, seed)[1], gparams)


@needs_loops
def test_a_loops_stack_inside_the_plans_graph_is_named_as_it_runs_there():
    """Traced inside the graph, the loops run as ops; `gb.explain` named the variant of an
    eager call ('direct') from the call's own context."""
    plan, stacks = GRAPH_PLANS["mixed"]
    route = gb.explain(init(plan, 0), plan, compile=True).route
    assert (route.plan, route.stacks) == ("graph", stacks)
    assert route.variants[0] == "ops"
    alone = gb.plan(mlp([10, 7, 3]), tile=(4, 4), hidden=6, hashed=3)
    assert gb.explain(init(alone, 0), alone, compile=True).route.variants[0] == "direct"


# Two stacks of two-layer g-nets with several outputs, hashed: matmul operands, which run
# compiled in chunks where a stack's transient exceeds `COMPILED_CHUNK_ELEMENTS`; lowered
# below every stack's, no stack fits one graph and each stack's tile MLP runs compiled alone.
MLP_PLAN = gb.plan(mlp([9, 7, 3]), tile=(4, 4), depth=2, hidden=5, outputs=2, hashed=3)


@needs_compiler
@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(SEEDS)
@example(6)
def test_the_compiled_mlp_path_equals_the_references(seed):
    """`compile=True` on stacks too large for one graph: each tile MLP compiled, in chunks."""
    plan = MLP_PLAN
    gparams = init(plan, seed)
    with pytest.MonkeyPatch.context() as patch:
        smallest = min(s.hidden_elements for s in plan.stacks)
        patch.setattr(compiled_mlp, "COMPILED_CHUNK_ELEMENTS", smallest // 2)
        assert_route(gparams, plan, ("compiled-mlp",) * len(plan.stacks), compile=True)
        weights, grads = generate(gparams, plan, compiled, seed)
    assert_weights(weights, gparams, plan)
    assert_grads(grads, generate(gparams, plan, torch_path, seed)[1], gparams)


@needs_triton
@settings(max_examples=10, deadline=None)
@given(plans(widest=6), SEEDS)
@example(tanh_rows([5, 4, 3], (2, 3), hidden=4), 7)
def test_the_triton_path_equals_the_references(plan, seed):
    """`backend="triton"`: the fused kernels (Triton's interpreter on CPU, tests/conftest.py)."""
    gparams = init(plan, seed, device=KERNEL_DEVICE)
    assert_route(gparams, plan, ("triton",) * len(plan.stacks), backend="triton")
    assert gb.explain(gparams, plan, backend="triton").route.plan == "triton"
    weights, grads = generate(gparams, plan, triton_path, seed)
    assert_weights(weights, gparams, plan)
    assert_grads(grads, generate(gparams, plan, torch_path, seed)[1], gparams)


# One plan per variant of the tile MLP (docs/design.md's table), on CPU in float32, each of
# whose stacks takes that variant, eagerly or as traced (`torch.compiler.is_compiling` made
# to say so: the traced forms then run op by op, where the recorder below may see them;
# tests/test_tilemlp.py compiles them). The one-output ReLU g-nets are shared, which keeps
# them off the `cpu-loops` path and on the `torch` path's `c-loops`.
VARIANT_PLANS = {
    "eager-recompute": (gb.plan(mlp([9, 6, 4]), tile=(3, 5), hidden=5, depth=2), False),
    "c-loops": (gb.plan(mlp([16, 8]), tile=(4, 16), hidden=6, share=True), True),
    "by-columns": (gb.plan(mlp([16, 8]), tile=(4, 16), hidden=5, activation="tanh"), True),
    "by-units": (gb.plan(mlp([9, 6]), tile=(3, 5), hidden=5, activation="tanh"), True),
    "unrolled": (gb.plan(mlp([9, 6]), tile=(4, 4), hidden=5, outputs=2, activation="tanh"), True),
    "units-major": (gb.plan(mlp([9, 6]), tile=(3, 5), hidden=5, depth=2), True),
    # traced under transforms dynamo traces no autograd.Function under (made to say so below)
    "plain-autograd": (gb.plan(mlp([9, 6]), tile=(3, 5), hidden=5, hashed=4), True),
}


def test_every_named_variant_has_a_plan_here():
    """The variants' table (`FORMS`, what `gb.explain` may print) and this test's plans are
    the same set: a variant added to the table without a plan here fails."""
    assert set(VARIANT_PLANS) == set(_traced_forms.FORMS)


@pytest.mark.parametrize(
    "variant",
    [pytest.param(v, marks=[needs_loops] if v == "c-loops" else []) for v in VARIANT_PLANS],
)
def test_each_variant_runs_where_gb_explain_names_it_and_equals_the_references(
    variant, monkeypatch
):
    """`gb.explain` names `variant` for every stack, the route hands it to the forward's
    bodies, which run that form and no other (their `form` recorded), and its weights and
    gradients equal the references'."""
    plan, traced = VARIANT_PLANS[variant]
    seed = 8
    gparams = init(plan, seed)
    ran = []
    forward = torch_ops.forward_no_save

    def recorded(terms, activation, b_t=None, form=_traced_forms.EAGER):
        ran.append(form)
        return forward(terms, activation, b_t, form)

    monkeypatch.setattr(torch_ops, "forward_no_save", recorded)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: traced)
    if variant == _traced_forms.PLAIN:
        monkeypatch.setattr(gb_dispatch, "functions_traceable", lambda: False)
    report = str(gb.explain(gparams, plan, compile=False))
    assert report.count(f": torch ({variant})\n") == len(plan.stacks), report
    weights, grads = generate(gparams, plan, torch_path, seed)
    assert set(ran) == {variant}
    assert_weights(weights, gparams, plan)
    assert_grads(grads, generate(gparams, plan, naive_apply, seed)[1], gparams)


NAN_PLANS = {
    "rows": gb.plan(mlp([9, 8, 5]), tile=(4, 4), hidden=4, outputs=4),
    "one-output": gb.plan(mlp([10, 7, 3]), tile=(4, 4), hidden=6),
    "tanh": gb.plan(mlp([9, 6, 4]), tile=(3, 5), hidden=5, activation="tanh"),
}
NAN_LEAVES = ("w_in", "b_in", "w_out")


@pytest.mark.parametrize("path", ["torch", "cpu-loops", "c-loops", "triton"])
@pytest.mark.parametrize("leaf", NAN_LEAVES)
def test_a_nan_in_a_gnet_reaches_the_weights_it_generates_on_every_path(path, leaf, monkeypatch):
    """A NaN in a g-net leaf gives NaN exactly where the naive reference has them: the CPU
    loops' `z > 0 ? z : 0` made it 0, so training through them kept a NaN leaf unseen."""
    if path in ("cpu-loops", "c-loops") and (_build.flavour() is None or _build.compiler() is None):
        pytest.skip("the loops are not built on this machine")
    if path == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    plans = NAN_PLANS if path in ("torch", "triton") else dict(list(NAN_PLANS.items())[:2])
    if path == "c-loops":  # shared g-nets: the loops as sub-ops of the torch path's forms
        plans = {"shared": VARIANT_PLANS["c-loops"][0]}
    # (the first and last entries: w_in's first holds a row code's term, its last a column's)
    for (name, plan), entry in itertools.product(plans.items(), (1, -1)):
        gparams = init(plan, 0, device=KERNEL_DEVICE if path == "triton" else "cpu")
        with torch.no_grad():
            gparams["stacks"][plan.stacks[0].key][leaf].view(-1)[entry] = float("nan")
        knobs = {"torch": {"compile": False}, "cpu-loops": {"compile": True}}
        knobs.update({"c-loops": {"compile": False}, "triton": {"backend": "triton"}})
        if path == "c-loops":  # the torch path's traced forms, run op by op (as above)
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        route = gb.explain(gparams, plan, **knobs[path]).route
        assert path in (route.stacks[0], route.variants[0]), route
        got = gb.apply(gparams, plan, **knobs[path])
        monkeypatch.undo()
        naive = naive_apply(tree_map(lambda x: x.detach().cpu(), gparams), plan)
        nans = {p.name: torch.isnan(got[p.name].detach().cpu()) for p in plan.generated_by(0)}
        assert any(bool(nan.any()) for nan in nans.values()), (name, entry)
        for weight, nan in nans.items():
            assert torch.equal(nan, torch.isnan(naive[weight])), (name, entry, weight)
