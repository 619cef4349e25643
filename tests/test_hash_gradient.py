"""The hashed tables' gradient as a C loop (`gbfunc.cpu._hash_gradient`), against plain torch."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from threads import on_threads
from torch import nn
from torch.func import grad, vmap

import gbfunc as gb
from gbfunc._spec import gradient_reference, packed_tile_hash, signed_buckets
from gbfunc.cpu._hash_gradient import signed_gather, table_gradient, usable

pytestmark = pytest.mark.skipif(not usable(torch.float32, "cpu"), reason="no C++ compiler")


def packed_hash(positions, buckets):
    return packed_tile_hash(positions, buckets, torch.device("cpu"))


@settings(max_examples=40, deadline=None)
@given(
    tiles=st.integers(1, 3),
    positions=st.integers(1, 700),  # across the loop's chunks of 256, ragged
    buckets=st.integers(1, 300),  # more buckets than positions too: some stay empty
    threads=st.sampled_from([1, 2, 3]),  # fewer tiles than threads: partial tables
    seed=st.integers(0, 2**16),
)
def test_the_loop_equals_its_specification_on_any_shape(tiles, positions, buckets, threads, seed):
    torch.manual_seed(seed)
    packed = packed_hash(positions, buckets)
    g = torch.randn(tiles, positions)
    out = on_threads(threads, table_gradient, g, packed, buckets)
    # Up to 700 terms a bucket, summed in another order (one bucket, 689 positions: 1.6e-5)
    torch.testing.assert_close(out, gradient_reference(g, packed, buckets), rtol=1e-4, atol=1e-4)


def test_the_gather_differentiates_as_plain_torch_once_and_twice():
    """First and second derivatives of `signed_gather` equal autograd through the plain gather."""
    torch.manual_seed(0)
    packed = packed_hash(300, 17)
    table = torch.randn(2, 17, requires_grad=True)
    upstream = torch.randn(2, 300, requires_grad=True)

    def table_grad(gather):
        (out,) = torch.autograd.grad(gather(table, packed), table, upstream, create_graph=True)
        return out

    ours, plain = table_grad(signed_gather), table_grad(signed_buckets)
    torch.testing.assert_close(ours, plain)
    weights = torch.randn(2, 17)
    (twice,) = torch.autograd.grad((ours * weights).sum(), upstream)
    (twice_plain,) = torch.autograd.grad((plain * weights).sum(), upstream)
    torch.testing.assert_close(twice, twice_plain)


def test_the_gradient_composes_with_vmap_over_genomes():
    """Genomes batched by `vmap` are more tiles for the loop (its vmap rule)."""
    torch.manual_seed(0)
    packed = packed_hash(200, 11)
    tables, upstream = torch.randn(3, 2, 11), torch.randn(3, 2, 200)

    def loss(table, g):
        return (signed_gather(table, packed) * g).sum()

    batched = vmap(grad(loss))(tables, upstream)
    for g, out in zip(upstream, batched, strict=True):
        torch.testing.assert_close(out, gradient_reference(g, packed, 11))
    with pytest.raises(NotImplementedError, match="cannot be batched"):
        vmap(table_gradient, in_dims=(0, 0, None))(upstream, packed.expand(3, -1), 11)


WHERE = ["gb.apply's graph", "the user's torch.compile", "the user's compiled grad"]


@pytest.mark.parametrize("where", WHERE)
def test_compiled_generation_sums_a_hashed_stacks_gradient_in_the_loop(where):
    """Eager `gb.apply(compile=True)`, a compiled loss differentiated by `backward()`, or a
    compiled `torch.func.grad` of it (where dynamo would drop the gather's backward if the
    Function were applied to the table leaf itself, pytorch/pytorch#193279): the tables'
    gradient comes from the loop, not torch's scatter-add, and equals plain torch's
    (`compile=False`, eager)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 20), nn.ReLU(), nn.Linear(20, 5))
    # tanh: one-layer ReLU g-nets write their hashed tables in C (`gbfunc.cpu._hash_weights`)
    plan = gb.plan(model, tile=(8, 8), hashed=7, activation="tanh")
    gparams = gb.init(plan)
    x = torch.randn(4, 30)

    def loss_of(gparams, compile):
        params = gb.apply(gparams, plan, compile=compile)
        return torch.func.functional_call(model, params, (x,)).square().sum()

    compiled_loss = torch.compile(loss_of, fullgraph=True)
    compiled_grad = torch.compile(torch.func.grad(loss_of), fullgraph=True)

    def table_grads(compile):
        if compile and where == "the user's compiled grad":
            with torch.profiler.profile() as prof:
                grads = compiled_grad(gparams, None)
            names = {e.name for e in prof.events()}
            return {k: v["tile_hash"] for k, v in grads["stacks"].items()}, names
        if compile and where == "the user's torch.compile":
            loss = compiled_loss(gparams, None)
        else:
            loss = loss_of(gparams, compile)
        with torch.profiler.profile() as prof:
            loss.backward()
        names = {e.name for e in prof.events()}
        out = {k: v["tile_hash"].grad.clone() for k, v in gparams["stacks"].items()}
        for leaf in torch.utils._pytree.tree_leaves(gparams):
            leaf.grad = None
        return out, names

    table_grads(True)  # the first backward compiles its graph, which runs ops of its own
    ours, names = table_grads(True)
    assert "gbfunc::hash_table_gradient" in names
    assert not any("scatter" in n for n in names)
    plain, names = table_grads(False)
    assert "gbfunc::hash_table_gradient" not in names
    assert ours.keys() == plain.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], plain[key], rtol=1e-5, atol=1e-6)


def test_elsewhere_the_gather_is_plain_torch():
    """float64 (or any device but the CPU): no loop, torch's gather and scatter-add."""
    assert not usable(torch.float64, "cpu")
    assert not usable(torch.float32, "cuda")
    packed = packed_hash(9, 5)
    for dtype, loop in ((torch.float64, False), (torch.float32, True)):
        out = signed_gather(torch.randn(2, 5, dtype=dtype, requires_grad=True), packed)
        assert ("_SignedGather" in type(out.grad_fn).__name__) == loop
