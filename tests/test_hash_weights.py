"""Hashed tables straight onto the weights and back (`gbfunc.cpu._hash_weights`), against plain
torch."""

import itertools
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from threads import on_threads
from torch import nn
from torch.func import functional_call, grad

import gbfunc as gb
from gbfunc.cpu import _hash_weights, _relu_rows, _stacks
from gbfunc.cpu._relu_loops import MIN_UNITS

pytestmark = pytest.mark.skipif(
    not _hash_weights.usable(torch.float32, "cpu"), reason="no C++ compiler"
)


def hashed_plan(widths, tile, buckets, outputs=1, hidden=MIN_UNITS):
    """A hashed plan over an MLP of `widths`: one-output g-nets, or row g-nets (`outputs` =
    the tile's width)."""
    model = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))
    plan = gb.plan(model, tile=tile, hidden=hidden, outputs=outputs, hashed=buckets)
    return model, plan


def stack_numbers(plan, s):
    """For stack `s`: `hash_weights_reference`'s numbers (positions, tile rows, the
    placement's lists), the ops' (the placement encoded, a gain of 1) and its parameters."""
    stack = plan.stacks[s]
    params = [p for p in plan.generated if p.stack_index == s]
    where = _relu_rows.placement(stack, params)
    positions = stack.tile_positions
    ops = (positions, stack.tile[0], where.encoded, 1.0)
    return (positions, stack.tile[0], *where.numbers), ops, params


@settings(max_examples=30, deadline=None)
@given(
    widths=st.tuples(st.integers(5, 40), st.integers(5, 40), st.integers(1, 20)),
    tile=st.tuples(st.integers(1, 9), st.integers(1, 40)),
    buckets=st.one_of(st.integers(1, 50), st.integers(100, 300)),
    rows_kind=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
@example(widths=(40, 37, 20), tile=(9, 40), buckets=300, rows_kind=False, threads=1, seed=0)
def test_the_loops_equal_their_specification_on_any_shape(
    widths, tile, buckets, rows_kind, threads, seed
):
    """Tiles cut at every edge, fewer tiles than threads (row splits), a weight without a
    gradient: weights and the table's gradient as `hash_weights_reference` and autograd give
    them. Rows of 16 positions or more take the AVX-512 code where the CPU has it: few
    buckets put two of 16 positions in one bucket (done one at a time), many seldom."""
    torch.manual_seed(seed)
    width = min(tile[1], *widths[:-1])
    _, plan = hashed_plan(widths, tile, buckets, outputs=width if rows_kind else 1)
    for s, stack in enumerate(plan.stacks):
        numbers, ops, params = stack_numbers(plan, s)
        table = torch.randn(stack.num_tiles, stack.genome.hashed, requires_grad=True)
        base = [torch.randn(p.shape[0], p.numel // p.shape[0]) for p in params]
        want = _hash_weights.hash_weights_reference(base, table, *numbers)
        got = on_threads(threads, _hash_weights.hash_weights, base, table.detach(), *ops)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w)
        grads = [torch.randn(w.shape) for w in want]
        grads[0] = None if len(grads) > 1 else grads[0]
        pairs = [(w, g) for w, g in zip(want, grads, strict=True) if g is not None]
        (expected,) = torch.autograd.grad([w for w, _ in pairs], table, [g for _, g in pairs])
        args = (grads, table.shape[-1], *ops)
        got = on_threads(threads, _hash_weights.hash_weights_backward, *args)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("outputs", [1, 8])
def test_eager_apply_writes_the_tables_in_c_with_plain_torchs_gradients(outputs):
    """`gb.apply(compile=True)`, eager, on hashed one-output or row g-nets: the table's ops
    run, no graph compiles, and weights and gradients (twice differentiated too) match
    `compile=False`."""
    torch.manual_seed(0)
    model, plan = hashed_plan([30, 20, 5], (8, 8), 7, outputs=outputs)
    gparams = gb.init(plan)
    for stack in gparams["stacks"].values():
        stack["tile_hash"].data.normal_()
    leaves = torch.utils._pytree.tree_leaves(gparams)
    x = torch.randn(4, 30)

    def gradients(compile):
        params = gb.apply(gparams, plan, compile=compile)
        loss = functional_call(model, params, (x,)).square().sum()
        first = torch.autograd.grad(loss, leaves, create_graph=True)
        second = torch.autograd.grad(sum(g.square().sum() for g in first), leaves)
        return params, first, second

    want = gradients(False)
    ops = []
    forward, backward = _hash_weights.hash_weights, _hash_weights.hash_weights_backward
    with (
        mock.patch(
            "gbfunc.generate.graph.generate", side_effect=AssertionError("compiled a graph")
        ),
        mock.patch.object(
            _hash_weights, "hash_weights", lambda *a: ops.append("forward") or forward(*a)
        ),
        mock.patch.object(
            _hash_weights,
            "hash_weights_backward",
            lambda *a: ops.append("backward") or backward(*a),
        ),
    ):
        got = gradients(True)
    # The backward runs again inside the second derivative: the weights' own backward needs it.
    assert ops.count("forward") == len(plan.stacks)
    assert ops.count("backward") == 2 * len(plan.stacks)
    for name in want[0]:
        torch.testing.assert_close(got[0][name], want[0][name], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1] + got[2], want[1] + want[2], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_vmap_over_genomes_equals_one_genome_at_a_time():
    """The ops' vmap rules (the forward's through `_HashWeights`' generated rule): batched
    tables and base weights, an unbatched base, batched gradients with one missing, each
    genome as if alone."""
    _, plan = hashed_plan([30, 20, 16], (8, 8), 7)
    numbers, ops, params = stack_numbers(plan, 0)
    assert len(params) == 2
    where = _relu_rows.placement(plan.stacks[0], params)
    tables = torch.randn(3, plan.stacks[0].num_tiles, 7)
    base = [torch.randn(3, p.shape[0], p.numel // p.shape[0]) for p in params]

    def weights(table, *base):
        return _hash_weights.generate(base, table, numbers[0], numbers[1], where, 2.0, direct=False)

    def table_gradient(*grads):
        given = iter(grads)
        per_weight = [next(given) if k else None for k in range(len(params))]
        return _hash_weights.hash_weights_backward(per_weight, 7, *ops)

    batched = torch.func.vmap(weights)(tables, *base)
    unbatched_base = torch.func.vmap(weights, in_dims=(0, *[None] * len(base)))(
        tables, *(b[0] for b in base)
    )
    gradients = torch.func.vmap(table_gradient)(*base[1:])
    for k in range(3):
        for got, want in zip(batched, weights(tables[k], *(b[k] for b in base)), strict=True):
            torch.testing.assert_close(got[k], want)
        alone = weights(tables[k], *(b[0] for b in base))
        for got, want in zip(unbatched_base, alone, strict=True):
            torch.testing.assert_close(got[k], want)
        torch.testing.assert_close(gradients[k], table_gradient(*(b[k] for b in base[1:])))


@pytest.mark.slow
def test_a_compiled_grad_step_runs_the_table_loops():
    """`torch.compile(fullgraph=True)` of `grad` through `gb.apply` on a hashed genome: the
    table's ops run inside the graph and the gradients are the eager ones."""
    torch.manual_seed(4)
    model, plan = hashed_plan([30, 20, 5], (8, 8), 7)
    gparams = gb.init(plan, requires_grad=False)
    x = torch.randn(4, 30)

    def loss(tree):
        out = functional_call(model, gb.apply(tree, plan, compile=False), (x,))
        return out.square().sum()

    want = grad(loss)(gparams)
    with torch.profiler.profile() as prof:
        got = torch.compile(grad(loss), fullgraph=True, dynamic=False)(gparams)
    names = {e.name for e in prof.events()}
    assert {"gbfunc::hash_weights", "gbfunc::hash_weights_backward"} <= names
    flat = zip(*(torch.utils._pytree.tree_leaves(g) for g in (got, want)), strict=True)
    for g, w in flat:
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_compiled_inference_of_a_stack_of_several_weights_runs_the_table_loops():
    """No input requiring grad: dynamo inlined the autograd Function whose forward takes the
    base weights as `*base`, and passed its ctx as the table (an AttributeError inside dynamo);
    now the op runs alone, with the eager weights."""
    torch.manual_seed(5)
    _, plan = hashed_plan([8, 8, 4], (4, 4), 2, outputs=4, hidden=8)
    assert (
        max(sum(p.stack_index == s for p in plan.generated) for s in range(len(plan.stacks))) >= 2
    )
    gparams = gb.init(plan, requires_grad=False)
    want = gb.apply(gparams, plan, compile=False)
    with torch.profiler.profile() as prof:
        got = torch.compile(lambda tree: gb.apply(tree, plan), fullgraph=True)(gparams)
    assert "gbfunc::hash_weights" in {e.name for e in prof.events()}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_without_the_loops_hashed_stacks_keep_the_tile_mlp(monkeypatch):
    """Where the table's loops cannot run, a hashed stack's g-nets do not take `_relu_rows`'
    loops either (its table would have nowhere to go)."""
    _, plan = hashed_plan([30, 20, 5], (8, 8), 7)
    gparams = gb.init(plan)
    assert set(gb.explain(gparams, plan, compile=True).route.stacks) == {"cpu-loops"}
    # where `gbfunc.cpu.refusal` asks whether the table's loops run
    monkeypatch.setattr(_stacks, "table_usable", lambda dtype, device_type: False)
    assert "cpu-loops" not in gb.explain(gparams, plan, compile=True).route.stacks
