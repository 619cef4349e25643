"""The C loops from leaves to weights and back (`gbfunc.cpu._relu_rows`, for row g-nets, and
`gbfunc.cpu._relu_tiles`, for one-output g-nets), against plain torch."""

import itertools
from unittest import mock

import pytest
import torch
from hypothesis import assume, example, given, settings, strategies as st
from threads import on_threads
from torch import nn
from torch.func import functional_call, grad_and_value

import gbfunc as gb
from gbfunc import _select
from gbfunc._spec import code_tables
from gbfunc.cpu import _relu_rows
from gbfunc.cpu._relu_loops import MIN_UNITS
from gbfunc.generate._policy import AUTO_GRAPH_WEIGHTS

pytestmark = pytest.mark.skipif(
    not _relu_rows.usable(MIN_UNITS, 8, torch.float32, "cpu"), reason="no C++ compiler"
)


def row_plan(widths, tile, hidden, **genome):
    """A plan of g-nets with `outputs` = the tile's width, at most every weight's width, over
    an MLP of `widths`: row g-nets where a weight is at least a tile wide."""
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    model = nn.Sequential(*layers)
    outputs = min(tile[1], *widths[:-1])
    return model, gb.plan(model, tile=tile, hidden=hidden, outputs=outputs, **genome)


def one_output_plan(widths, tile, hidden, **genome):
    """A plan of one-output g-nets (`_relu_tiles`' loops) over an MLP of `widths`."""
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    model = nn.Sequential(*layers)
    return model, gb.plan(model, tile=tile, hidden=hidden, **genome)


PLANS = {"rows": row_plan, "one output": one_output_plan}


def stack_inputs(plan, gparams, s):
    """The loops' arguments for stack `s`: code tables, leaves and placement numbers."""
    stack = plan.stacks[s]
    leaves = gparams["stacks"][stack.key]
    params = [p for p in plan.generated if p.stack_index == s]
    where = _relu_rows.placement(stack, params)
    codes = code_tables(stack, leaves["w_in"])
    tensors = [*codes, *(leaves[k] for k in ("w_in", "b_in", "w_out", "b_out"))]
    return tensors, where, params


def counting(monkeypatch):
    """Record which loop functions run (`_forward`, `_backward`)."""
    calls = []
    for name in ("_forward", "_backward"):
        original = getattr(_relu_rows, name)

        def counted(*args, _original=original, _name=name):
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(_relu_rows, name, counted)
    return calls


# Few (units, outputs) pairs: each compiles its own loops (a g++ run each, on a cold cache).
# They cover the backward's blocks: units in one block (at most 8, padded to a vector of 8) or
# in blocks of 4 and a remainder (10); outputs less than a block (5) or blocks of 32 and a
# remainder (37). Tiles of up to 40 rows take several 32-row chunks, 8-row blocks and a rest.
SHAPES = {
    "widths": st.tuples(st.integers(37, 80), st.integers(37, 80), st.integers(1, 40)),
    "tile": st.tuples(st.integers(1, 40), st.sampled_from([5, 37])),
    "hidden": st.sampled_from([MIN_UNITS, 10]),
    "threads": st.sampled_from([1, 2, 3]),
    "seed": st.integers(0, 2**16),
}


@settings(max_examples=30, deadline=None)
@given(**SHAPES)
def test_the_loops_equal_their_specification_on_any_shape(widths, tile, hidden, threads, seed):
    """Row g-nets: ragged tiles at every edge, fewer tiles than threads (row splits), random
    leaves: weights and every leaf's gradient as `rows_reference` and autograd give them."""
    torch.manual_seed(seed)
    _, plan = row_plan(widths, tile, hidden)
    assert_loops_equal_reference(plan, threads)


# One-output tiles: rows in blocks of 4 and a rest; columns in blocks of 32, a cut block
# computed whole (a ragged tile whose stack has 32 more columns), blocks of 8 and single
# columns (5: singles only; 12: a block of 8 and 4 singles; 37 and 70: blocks of 32 and cut
# blocks at a ragged edge).
ONE_OUTPUT_SHAPES = {
    **SHAPES,
    "tile": st.tuples(st.integers(1, 13), st.sampled_from([5, 12, 37, 70])),
    "hidden": st.sampled_from([MIN_UNITS, 10, 16]),  # 16: the backward's AVX-512 code, if any
}


@settings(max_examples=30, deadline=None)
@given(**ONE_OUTPUT_SHAPES)
@example(widths=(70, 41, 9), tile=(7, 37), hidden=16, threads=2, seed=3)
def test_the_one_output_loops_equal_their_specification_on_any_shape(
    widths, tile, hidden, threads, seed
):
    """One-output g-nets (`_relu_tiles`): the same, on tiles cut at every edge."""
    torch.manual_seed(seed)
    _, plan = one_output_plan(widths, tile, hidden)
    assert all(stack.columns > 1 for stack in plan.stacks)
    assert_loops_equal_reference(plan, threads)


def assert_loops_equal_reference(plan, threads):
    """The loops' weights and gradients, on `threads` threads with random leaves, for every
    stack of `plan` that suits them (at least one), against `rows_reference` and autograd."""
    gparams = gb.init(plan)
    row_stacks = [s for s, stack in enumerate(plan.stacks) if _relu_rows.suits(stack)]
    assert row_stacks  # the narrowest weight's tiles, at least
    for s in row_stacks:
        tensors, where, params = stack_inputs(plan, gparams, s)
        leaves = [x.detach().clone().requires_grad_() for x in tensors[2:]]
        for leaf in leaves:
            leaf.data.normal_()
        # A pre-activation within rounding of 0 is a tie whose ReLU derivative depends on the
        # order of the sums (seed 15098 drew 1.2e-7, 0.0 in the reference's): not drawn.
        codes, (w_in, b_in) = tensors[:2], (x.detach() for x in leaves[:2])
        r = codes[0].shape[1]
        z = (codes[0] @ w_in[:, :r] + b_in[:, None])[:, :, None] + (codes[1] @ w_in[:, r:])[:, None]
        assume(z.abs().min() > 1e-5)
        numbers = where.numbers
        want = _relu_rows.rows_reference(*tensors[:2], *leaves, *numbers)
        placement = where.encoded
        got = on_threads(threads, _relu_rows.relu_rows, *tensors[:2], *leaves, placement)
        for w, g, p in zip(want, got, params, strict=True):
            assert g.shape == w.shape == (p.shape[0], p.numel // p.shape[0])
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        grads = [torch.randn(w.shape) for w in want]
        grads[0] = None if len(grads) > 1 else grads[0]  # an unused weight: no gradient
        pairs = [(w, g) for w, g in zip(want, grads, strict=True) if g is not None]
        expected = torch.autograd.grad(
            [w for w, _ in pairs], leaves, [g for _, g in pairs], materialize_grads=True
        )
        args = (grads, *tensors[:2], *(x.detach() for x in leaves[:3]), placement)
        got = on_threads(threads, _relu_rows.relu_rows_backward, *args)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", PLANS)
def test_eager_apply_runs_the_loops_with_the_gradients_of_plain_torch(monkeypatch, kind):
    """`gb.apply(compile=True)`, eager, on row or one-output g-nets: both loops run, no graph
    compiles, and weights and gradients match `compile=False` (plain torch)."""
    torch.manual_seed(0)
    model, plan = PLANS[kind]([50, 37, 9], (16, 16), 6)
    gparams = gb.init(plan)
    x, y = torch.randn(5, 50), torch.randint(0, 9, (5,))

    def loss(compile):
        params = gb.apply(gparams, plan, compile=compile)
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y), params

    leaves = torch.utils._pytree.tree_leaves(gparams)
    want_loss, want = loss(False)
    want_grads = torch.autograd.grad(want_loss, leaves)
    calls = counting(monkeypatch)
    with mock.patch(
        "gbfunc.generate.graph.generate", side_effect=AssertionError("compiled a graph")
    ):
        got_loss, got = loss(True)
        got_grads = torch.autograd.grad(got_loss, leaves)
    assert calls == ["_forward"] * len(plan.stacks) + ["_backward"] * len(plan.stacks)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_evaluation_of_a_large_plan_runs_the_forward_loop_and_no_graph(monkeypatch):
    """`gb.apply` (compile=None) with gradients off, on a plan of `AUTO_GRAPH_WEIGHTS` weights:
    the forward loop, no graph, plain torch's weights; one row fewer: op by op."""
    torch.manual_seed(3)
    _, plan = one_output_plan([512, 512], (64, 64), MIN_UNITS)
    _, under = one_output_plan([512, 511], (64, 64), MIN_UNITS)
    assert sum(p.numel for p in plan.generated) == AUTO_GRAPH_WEIGHTS
    calls = counting(monkeypatch)
    for each, loops in ((plan, ["_forward"]), (under, [])):
        gparams = gb.init(each)
        want = gb.apply(gparams, each, compile=False)
        calls.clear()
        with (
            torch.no_grad(),
            mock.patch(
                "gbfunc.generate.graph.generate", side_effect=AssertionError("compiled a graph")
            ),
        ):
            got = gb.apply(gparams, each)
        assert calls == loops
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_double_backward_goes_through_the_specification():
    """A gradient of a gradient (`create_graph=True`) through the loops equals plain torch's."""
    torch.manual_seed(1)
    _, plan = row_plan([20, 13], (8, 8), 4)
    gparams = gb.init(plan)
    leaves = torch.utils._pytree.tree_leaves(gparams)

    def grad_norm(compile):
        params = gb.apply(gparams, plan, compile=compile)
        value = sum((w**3).sum() for w in params.values())
        grads = torch.autograd.grad(value, leaves, create_graph=True)
        return torch.autograd.grad(sum((g * g).sum() for g in grads), leaves)

    for got, want in zip(grad_norm(True), grad_norm(False), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", PLANS)
def test_vmap_over_genomes_equals_one_genome_at_a_time(kind):
    """`_Rows` under vmap (its generated rule, through the forward op's): a batch of genomes,
    each as if alone."""
    torch.manual_seed(2)
    _, plan = PLANS[kind]([30, 11], (8, 16), 4)
    tensors, where, _ = stack_inputs(plan, gb.init(plan), 0)
    batch = [torch.stack([x.detach() + k for k in range(3)]) for x in tensors[2:]]

    def weights(*leaves):
        return _relu_rows._Rows.apply(*tensors[:2], *leaves, where, False)

    got = torch.func.vmap(weights)(*batch)
    for k in range(3):
        want = weights(*(x[k] for x in batch))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g[k], w)


@pytest.mark.parametrize("kind", PLANS)
def test_the_backward_op_under_vmap_is_one_genome_at_a_time(kind):
    """`relu_rows_backward`'s vmap rule (a batch of genomes' gradients, under a compiled
    `vmap(grad)`), with an unbatched argument and a missing gradient, as a loop over them."""
    torch.manual_seed(5)
    _, plan = PLANS[kind]([30, 20, 11], (8, 16), 4)
    tensors, where, params = stack_inputs(plan, gb.init(plan), 0)
    placement = where.encoded
    codes, leaves = tensors[:2], [x.detach() for x in tensors[2:5]]
    grads = [torch.randn(3, p.shape[0], p.numel // p.shape[0]) for p in params]
    w_out = torch.stack([leaves[2] + k for k in range(3)])

    def backward(grad, w_out):
        return _relu_rows.relu_rows_backward([grad, None], *codes, *leaves[:2], w_out, placement)

    got = torch.func.vmap(backward, in_dims=(0, 0))(grads[0], w_out)
    for k in range(3):
        for g, w in zip(got, backward(grads[0][k], w_out[k]), strict=True):
            torch.testing.assert_close(g[k], w)


def test_a_weight_of_several_blocks_lands_block_by_block():
    """A weight holding two matrices side by side (`split_dim=1`, like GPT-2's fused Q/K/V):
    each block's tiles land in its own columns, as `gb.apply` lays them out op by op."""

    class TwoBlocks(nn.Linear):
        pass

    gb.register_rule(
        TwoBlocks, lambda m: {"weight": gb.Layout(init_std=0.1, splits=2, split_dim=1)}
    )
    torch.manual_seed(6)
    plan = gb.plan(nn.Sequential(TwoBlocks(40, 12)), tile=(5, 8), hidden=4, outputs=8)
    assert len(plan.generated[0].blocks) == 2
    assert _relu_rows.suits(plan.stacks[0])
    gparams = gb.init(plan)
    got = gb.apply(gparams, plan, compile=True)
    want = gb.apply(gparams, plan, compile=False)
    torch.testing.assert_close(got["0.weight"], want["0.weight"], rtol=1e-5, atol=1e-6)


def test_conv_kernels_of_one_output_g_nets_land_tap_by_tap(monkeypatch):
    """One-output g-nets over conv kernels (a kernel window in the code): each tile row's
    columns are (column, tap) pairs, cut and placed by the loops as `gb.apply` lays them out
    op by op, with the same gradients."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Conv2d(3, 20, 3), nn.Conv2d(20, 7, 3))
    plan = gb.plan(model, tile=(8, 8), hidden=5)
    assert all(_relu_rows.suits(s) and s.window == (3, 3) for s in plan.stacks)
    gparams = gb.init(plan)
    leaves = torch.utils._pytree.tree_leaves(gparams)
    x = torch.randn(2, 3, 9, 9)

    def generated(compile):
        params = gb.apply(gparams, plan, compile=compile)
        value = functional_call(model, params, (x,)).square().sum()
        return params, torch.autograd.grad(value, leaves)

    want, want_grads = generated(False)
    calls = counting(monkeypatch)
    got, got_grads = generated(True)
    assert calls == ["_forward"] * 2 + ["_backward"] * 2
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_only_suitable_stacks_and_whole_parameters_take_the_loops():
    """Shared, deeper, non-ReLU or many-column g-nets of several outputs keep the tile MLP;
    so do centred weights and selections that cut a weight (tensor parallelism). Hashed ones
    take the loops (their tables through `_hash_weights`)."""
    _, plan = row_plan([30, 11], (8, 16), 4)
    assert _relu_rows.suits(plan.stacks[0])
    assert _relu_rows.suits(row_plan([30, 11], (8, 16), 4, hashed=64)[1].stacks[0])
    for genome in ({"share": True}, {"depth": 2}, {"activation": "tanh"}):
        assert not _relu_rows.suits(row_plan([30, 11], (8, 16), 4, **genome)[1].stacks[0])
    model = nn.Sequential(nn.Linear(30, 11))
    assert not _relu_rows.suits(gb.plan(model, tile=(8, 16), hidden=4, outputs=8).stacks[0])
    assert _relu_rows.suits(gb.plan(model, tile=(8, 16), hidden=4).stacks[0])  # one output
    deep = gb.plan(model, tile=(8, 16), hidden=4, depth=2)
    assert not _relu_rows.suits(deep.stacks[0])
    whole = _select.Selection.whole(plan)
    assert whole._placed == {0}
    half = _select.Selection(plan, {"0.weight": ((0, 5), (0, 30))})
    assert half._placed == set()
    centred = [p.__class__(**{**p.__dict__, "center": True}) for p in plan.generated]
    assert _relu_rows.placement(plan.stacks[0], centred) is None
    assert not _relu_rows.usable(MIN_UNITS, 8, torch.float64, "cpu")
    assert not _relu_rows.usable(MIN_UNITS - 1, 8, torch.float32, "cpu")
    assert not _relu_rows.usable(MIN_UNITS, _relu_rows.MAX_OUTPUTS + 1, torch.float32, "cpu")
    assert not _relu_rows.usable(_relu_rows.MAX_UNITS + 1, 8, torch.float32, "cpu")


def test_without_a_compiler_apply_falls_back_to_torch(monkeypatch, failing_loops):
    """A compiler that fails: one warning, `usable` says no and `gb.apply(compile=True)` runs
    without the loops, with the same weights."""
    hidden = 29
    with pytest.warns(RuntimeWarning, match="CPU loops are off"):
        assert not _relu_rows.usable(hidden, 8, torch.float32, "cpu")
    torch.manual_seed(3)
    _, plan = row_plan([20, 13], (8, 8), hidden)
    gparams = gb.init(plan)
    assert "cpu-loops" not in gb.explain(gparams, plan, compile=True).route.stacks
    calls = counting(monkeypatch)
    got = gb.apply(gparams, plan, compile=True)
    want = gb.apply(gparams, plan, compile=False)
    assert calls == []
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", PLANS)
def test_a_compiled_step_under_grad_runs_the_loops(monkeypatch, kind):
    """`torch.compile(fullgraph=True)` of `grad_and_value` through `gb.apply`: the loops run
    as custom ops inside the graph, and loss and gradients are the eager ones."""
    torch.manual_seed(4)
    model, plan = PLANS[kind]([50, 40, 7], (16, 16), 4)
    tree = gb.init(plan, requires_grad=False)
    x, y = torch.randn(8, 50), torch.randint(0, 7, (8,))

    def loss(tree):
        out = functional_call(model, gb.apply(tree, plan, compile=False), (x,))
        return nn.functional.cross_entropy(out, y)

    want_grads, want = grad_and_value(loss)(tree)
    calls = counting(monkeypatch)
    step = torch.compile(grad_and_value(loss), fullgraph=True, dynamic=False)
    got_grads, got = step(tree)
    assert set(calls) == {"_forward", "_backward"}
    torch.testing.assert_close(got, want)
    flat = zip(*(torch.utils._pytree.tree_leaves(g) for g in (got_grads, want_grads)), strict=True)
    for g, w in flat:
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_compiled_vmap_over_genomes_runs_the_loops_per_genome(monkeypatch):
    """`torch.compile(vmap(gb.apply))` over a batch of row-g-net genomes: the forward op's
    vmap rule runs the loop once per genome and stack, with eager vmap's weights."""
    _, plan = row_plan([50, 40, 7], (16, 16), 4)
    trees = [gb.init(plan, seed=k, requires_grad=False) for k in range(3)]
    batched = torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *trees)
    generate = torch.func.vmap(lambda tree: gb.apply(tree, plan))
    want = generate(batched)
    calls = counting(monkeypatch)
    got = torch.compile(generate, fullgraph=True, dynamic=False)(batched)
    assert calls == ["_forward"] * 3 * len(plan.stacks)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
