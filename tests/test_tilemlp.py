"""The recomputing tile MLP against its autograd specification."""

from unittest import mock

import pytest
import torch
from forms import traced_form
from hypothesis import example, given, strategies as st

from gbfunc._spec import Terms, activate, activate_grad, reference
from gbfunc.generate._bodies import _units_major_terms, backward_recompute, forward_no_save
from gbfunc.generate._traced_forms import (
    EAGER,
    _fused_reductions,
    _vector_lanes,
    vectorised_units,
)
from gbfunc.generate.compiled_mlp import compiled_chunks
from gbfunc.generate.torch_ops import CHUNK_ELEMENTS, _eager_chunks, tile_chunks, tile_mlp

ACTIVATIONS = ["relu", "gelu", "tanh", "silu"]


def compiled_square_loss(form: str, backend) -> object:
    """The sum of squares of a ReLU tile MLP in `form`, of its flat terms, compiled whole
    (`fullgraph=True`) by `backend`."""

    def loss(*flat):
        return tile_mlp(Terms(*flat), "relu", form=form).square().sum()

    return torch.compile(loss, backend=backend, fullgraph=True)


def inputs(tiles, rows, cols, hidden, depth, outputs, seed):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)

    deep = depth > 1
    return Terms(
        rand(tiles, rows, hidden),
        rand(tiles, cols, hidden),
        rand(tiles, hidden),
        rand(tiles, depth - 1, hidden, hidden) if deep else None,
        rand(tiles, depth - 1, hidden) if deep else None,
        rand(tiles, hidden, outputs),
        rand(tiles, outputs),
    )


@given(
    tiles=st.integers(1, 3),
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    hidden=st.integers(1, 5),
    depth=st.integers(1, 3),
    outputs=st.integers(1, 3),
    activation=st.sampled_from(ACTIVATIONS),
    seed=st.integers(0, 2**16),
)
# One hidden unit and several outputs: the one-output shortcut must test the outputs' count.
@example(tiles=2, rows=3, cols=2, hidden=1, depth=1, outputs=2, activation="relu", seed=0)
def test_outputs_and_every_gradient_match_the_reference(
    tiles, rows, cols, hidden, depth, outputs, activation, seed
):
    args = inputs(tiles, rows, cols, hidden, depth, outputs, seed)
    ours = tile_mlp(args, activation)
    spec = reference(args, activation)
    torch.testing.assert_close(ours, spec, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(spec)
    present = [x for x in args if x is not None]
    got = torch.autograd.grad(ours, present, grad)
    want = torch.autograd.grad(spec, present, grad)
    names = [n for n, x in args._asdict().items() if x is not None]
    for name, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


@given(
    tiles=st.integers(1, 3),
    rows=st.integers(1, 6),
    cols=st.integers(1, 5),
    hidden=st.sampled_from([1, 3, 32, 33]),  # around the unrolled forward's 32 units
    depth=st.integers(1, 2),
    outputs=st.sampled_from([2, 16, 17, 32, 33]),  # and its 16 outputs, the loop's 32
    activation=st.sampled_from(ACTIVATIONS),
    seed=st.integers(0, 2**16),
)
def test_the_compiled_forms_of_several_outputs_or_layers_equal_the_reference(
    tiles, rows, cols, hidden, depth, outputs, activation, seed
):
    """What traced graphs run for several outputs or hidden layers (units-major matmuls, or
    the unrolled sum over the units; terms forced into buffers, as inside a Function), run
    op by op: the reference's outputs and gradients, ragged shapes too."""
    terms = inputs(tiles, rows, cols, hidden, depth, outputs, seed)
    spec = reference(terms, activation)
    grad = torch.randn(spec.shape, generator=torch.Generator().manual_seed(seed), dtype=spec.dtype)
    present = [x for x in terms if x is not None]
    want = torch.autograd.grad(spec, present, grad)
    detached = Terms(*(None if x is None else x.detach() for x in terms))
    form = traced_form(detached, activation)
    with torch.no_grad():
        out = forward_no_save(detached, activation, None, form)
        got = [g for g in backward_recompute(grad, detached, activation, form) if g is not None]
    torch.testing.assert_close(out, spec)
    names = [n for n, x in terms._asdict().items() if x is not None]
    for name, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(g, w, msg=name)


@pytest.mark.parametrize(
    ("hidden", "depth", "outputs", "unrolled"),
    [(32, 1, 16, True), (33, 1, 16, False), (6, 1, 17, False), (6, 1, 2, True), (6, 2, 2, False)],
)
def test_traced_forwards_unroll_one_layer_of_at_most_16_outputs_and_32_units(
    hidden, depth, outputs, unrolled
):
    """The rule `_unrolls` states, read from the outputs' axis of `w_out` `(T, H, P)`."""
    import gbfunc.generate._traced_forms as forward

    terms = inputs(2, 3, 2, hidden, depth, outputs, seed=0)
    calls = []
    real = forward.one_layer_unrolled

    def spy(*args):
        calls.append(args)
        return real(*args)

    with mock.patch.object(forward, "one_layer_unrolled", spy):
        out = forward_no_save(terms, "relu", None, traced_form(terms, "relu"))
    assert bool(calls) == unrolled
    torch.testing.assert_close(out, reference(terms, "relu"))


def test_a_nan_in_one_tiles_gradient_leaves_the_other_tiles_gradients_exact():
    """The backward's ordering dependency on the incoming gradient (`_after`) adds an exact
    zero whatever the gradient holds: a NaN at its first element stays in the first tile."""
    terms = inputs(3, 4, 2, 5, 1, 3, seed=2)
    grad = torch.randn(3, 4, 2, 3, dtype=torch.float64)
    grad[0, 0, 0, 0] = float("nan")
    present = [x for x in terms if x is not None]
    got = torch.autograd.grad(tile_mlp(terms, "relu"), present, grad)
    want = torch.autograd.grad(reference(terms, "relu"), present, grad)
    names = [n for n, x in terms._asdict().items() if x is not None]
    for name, g, w in zip(names, got, want, strict=True):
        torch.testing.assert_close(g[1:], w[1:], msg=name)
        assert g[0].isnan().any(), name


# Hidden widths around the vector registers' (float64 lanes on this CPU, at least 4 on
# x86-64 with AVX2): one unit, whole registers, whole registers and one unit left over (which
# goes alone), one unit short of two registers (the units left over go as a masked vector).
LANES = _vector_lanes(torch.float64, "cpu")
WIDTHS = sorted({1, LANES, LANES + 1, 2 * LANES - 1})


def test_vector_lanes_are_the_cpus_and_one_off_it():
    assert _vector_lanes(torch.float32, "cuda") == _vector_lanes(torch.float64, "meta") == 1
    assert _vector_lanes(torch.float32, "cpu") in (1, 2 * LANES)


def test_compiled_code_reduces_whole_vector_registers_of_hidden_units_together():
    assert LANES >= 4
    for hidden, vectorised in (
        (1, 0),
        (LANES, LANES),
        (LANES + 1, LANES),
        (LANES + LANES // 2, LANES),  # half a register left over: one at a time
        (LANES + LANES // 2 + 1, LANES + LANES // 2 + 1),  # more: a masked vector
        (2 * LANES - 1, 2 * LANES - 1),
        (2 * LANES + 1, 2 * LANES),
    ):
        assert vectorised_units(torch.zeros(1, 1, hidden, dtype=torch.float64)) == vectorised


@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_compiled_reductions_equal_the_eager_backward(activation, hidden):
    """`_fused_reductions` is what compiled graphs run for one layer and one output."""
    terms = inputs(3, 5, 7, hidden, 1, 1, seed=1)
    g = torch.randn(3, 5, 7, dtype=torch.float64)
    got = _fused_reductions(g, terms.a, terms.b, terms.c, terms.w_out[..., 0], activation)
    want = backward_recompute(g[..., None], terms, activation)
    torch.testing.assert_close(got[0], want.a, msg="a")
    torch.testing.assert_close(got[1], want.b, msg="b")
    torch.testing.assert_close(got[2], want.w_out[..., 0], msg="w_out")


@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_the_compiled_form_of_the_one_output_forward_equals_the_reference(
    monkeypatch, activation, hidden
):
    """Traced by `torch.compile` without `b_t` (tiles narrower than a vector register), the
    one-output forward reduces whole vector registers of hidden units and adds the units left
    over one at a time: the same outputs."""
    terms = inputs(3, 5, 7, hidden, 1, 1, seed=4)
    want = reference(terms, activation)
    form = traced_form(terms, activation)
    torch.testing.assert_close(forward_no_save(terms, activation, None, form), want)


@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_the_one_output_forward_from_units_major_column_terms_equals_the_reference(
    monkeypatch, activation, hidden
):
    """Given `b_t` (the column terms laid out `(T, H, Q)`), the traced one-output forward
    sums over the units with the columns innermost: the same outputs, ragged shapes too."""
    terms = inputs(3, 5, 7, hidden, 1, 1, seed=5)
    want = reference(terms, activation)
    b_t = terms.b.detach().transpose(1, 2).contiguous()
    form = traced_form(terms, activation, b_t)
    torch.testing.assert_close(forward_no_save(terms, activation, b_t, form), want)


@given(
    tiles=st.integers(1, 3),
    rows=st.integers(1, 6),
    cols=st.integers(1, 2 * LANES + 1),
    hidden=st.integers(1, 2 * LANES + 1),
    activation=st.sampled_from(ACTIVATIONS),
    units_major=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_both_traced_one_output_forms_equal_the_reference_on_any_shape(
    tiles, rows, cols, hidden, activation, units_major, seed
):
    """The traced one-output forward, from units-major column terms or from `b`, on shapes
    that fill vector registers or leave ragged ends in both the columns and the units."""
    terms = inputs(tiles, rows, cols, hidden, 1, 1, seed)
    b_t = terms.b.detach().transpose(1, 2).contiguous() if units_major else None
    got = forward_no_save(terms, activation, b_t, traced_form(terms, activation, b_t))
    torch.testing.assert_close(got, reference(terms, activation))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_the_gradient_of_units_major_column_terms_arrives_through_b(monkeypatch, activation):
    """`tile_mlp(..., b_t=...)` returns no gradient for `b_t` and all of it for `b`: with both
    computed from one leaf, that leaf's gradient is the reference's, once (not twice, not
    lost), whichever of the two the forward read."""
    gen = torch.Generator().manual_seed(6)
    terms = inputs(2, 4, 6, 5, 1, 1, seed=6)
    codes = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    w_col = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 4, 6, 1, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(reference(terms._replace(b=codes @ w_col), activation), w_col, grad)
    for traced in (False, True):  # the eager chunks ignore b_t; traced code reads it
        # (T, Q, H) and (T, H, Q), as `_traced_forms.units_major_columns` makes them
        b, b_t = codes @ w_col, w_col.mT @ codes.mT
        form = traced_form(terms, activation, b_t) if traced else EAGER
        out = tile_mlp(terms._replace(b=b), activation, form=form, b_t=b_t)
        torch.testing.assert_close(torch.autograd.grad(out, w_col, grad), want)


def test_compiled_relu_reductions_take_the_derivative_at_zero_as_torch_does():
    """Where a pre-activation is exactly 0, ReLU's derivative is 0 (torch's convention);
    `_fused_reductions` tests `b > -(a + c)`, so a tie must count as not active."""
    gen = torch.Generator().manual_seed(3)

    def ints(*shape):  # small integers: many sums are exactly zero
        return torch.randint(-2, 3, shape, generator=gen).double().requires_grad_()

    hidden = LANES + 1  # a whole register and a unit alone
    a, b, c, w = ints(2, 4, hidden), ints(2, 5, hidden), ints(2, hidden), ints(2, hidden)
    z = (a + c[:, None])[:, :, None, :] + b[:, None, :, :]
    assert (z[..., :LANES] == 0).any()
    assert (z[..., LANES:] == 0).any()
    g = torch.randn(2, 4, 5, generator=gen, dtype=torch.float64)
    spec = (torch.relu(z) * w[:, None, None, :]).sum(-1)
    want = torch.autograd.grad(spec, (a, b, w), g)
    got = _fused_reductions(g, a.detach(), b.detach(), c.detach(), w.detach(), "relu")
    for name, x, y in zip("abw", got, want, strict=True):
        torch.testing.assert_close(x, y, msg=name)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize(
    ("depth", "hidden", "outputs"), [(1, 4, 1), (1, 4, 2), (1, 1, 3), (2, 4, 1), (3, 4, 2)]
)
def test_the_compiled_form_of_the_backward_equals_the_eager_one(
    monkeypatch, activation, depth, hidden, outputs
):
    """Traced by `torch.compile`, the backward sums over positions with matmuls (and one
    layer with one output takes `_fused_reductions`): the same gradients as eagerly."""
    terms = inputs(3, 5, 7, hidden, depth, outputs, seed=2)
    grad = torch.randn(3, 5, 7, outputs, dtype=torch.float64)
    want = backward_recompute(grad, terms, activation)
    got = backward_recompute(grad, terms, activation, traced_form(terms, activation))
    for name, g, w in zip(Terms._fields, got, want, strict=True):
        if w is None:
            assert g is None, name
        else:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


def test_relu_gradient_at_zero_is_zero_as_autograd_has_it():
    """Every pre-activation exactly 0 (zero first layer): torch's relu has derivative 0 there.
    (A derivative of 1 at 0 would move these gradients by O(1); the tolerance is float64's
    default, for the recomputing backward's own order of summation.)"""
    terms = inputs(2, 3, 4, 4, 1, 2, seed=3)
    zeros = Terms(*(torch.zeros_like(x).requires_grad_() for x in terms[:3]), *terms[3:])
    present = [x for x in zeros if x is not None]
    grad = torch.randn(2, 3, 4, 2, dtype=torch.float64)
    got = torch.autograd.grad(tile_mlp(zeros, "relu"), present, grad)
    want = torch.autograd.grad(reference(zeros, "relu"), present, grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("function", [activate, activate_grad])
def test_an_unknown_activation_is_named(function):
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        function(torch.zeros(2), "swish")


def test_compiled_bodies_run_whole_only_where_inductor_fuses_them(monkeypatch):
    import gbfunc.generate.compiled_mlp as tilemlp

    def terms(outputs: int, depth: int) -> Terms:
        tiles, rows, cols, hidden = 6, 16, 4, 8
        deep = depth > 1
        return Terms(
            torch.zeros(tiles, rows, hidden),
            torch.zeros(tiles, cols, hidden),
            torch.zeros(tiles, hidden),
            torch.zeros(tiles, depth - 1, hidden, hidden) if deep else None,
            torch.zeros(tiles, depth - 1, hidden) if deep else None,
            torch.zeros(tiles, hidden, outputs),
            torch.zeros(tiles, outputs),
        )

    monkeypatch.setattr(tilemlp, "COMPILED_CHUNK_ELEMENTS", 4 * 16 * 4 * 8)  # four tiles
    assert compiled_chunks(terms(1, 1)) == [(0, 6)]  # fused into reductions: whole
    assert compiled_chunks(terms(4, 1)) == [(0, 3), (3, 6)]
    assert compiled_chunks(terms(1, 2)) == [(0, 3), (3, 6)]


def test_eager_evaluation_is_chunked_to_the_chunk_size_and_traced_left_whole():
    assert tile_chunks(3, 2 * CHUNK_ELEMENTS) == [(0, 1), (1, 2), (2, 3)]  # one tile per chunk
    assert tile_chunks(5, CHUNK_ELEMENTS // 2) == [(0, 2), (2, 4), (4, 5)]
    assert tile_chunks(CHUNK_ELEMENTS, 1) == [(0, CHUNK_ELEMENTS)]
    assert tile_chunks(6, CHUNK_ELEMENTS // 4) == [(0, 3), (3, 6)]  # balanced, not 4 + 2
    assert tile_chunks(7, CHUNK_ELEMENTS // 2) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    terms = inputs(tiles=5, rows=CHUNK_ELEMENTS, cols=2, hidden=1, depth=1, outputs=1, seed=0)
    assert _eager_chunks(terms, whole=False) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert _eager_chunks(terms, whole=True) == [(0, 5)]


@pytest.mark.slow
@pytest.mark.parametrize("depth", [1, 2])
def test_a_partitioned_compiled_graph_recomputes_the_hidden_activations_instead_of_saving_them(
    depth,
):
    """The point of the recomputing backward, kept where AOTAutograd splits one traced graph
    into forward and backward (as `gb.apply`'s eager graph is): nothing of the hidden
    activations' size `(T, TH, Q, H)` is saved between them. Had the backward's first layer
    been the forward's op, the graph would merge the two and keep the forward's: on the main
    job's transformer, 1.5 MiB more at the eager step's peak."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    terms = inputs(tiles=3, rows=4, cols=5, hidden=6, depth=depth, outputs=2, seed=0)
    form = traced_form(terms, "relu")
    (tiles, rows, hidden), cols = terms.a.shape, terms.b.shape[1]
    hidden_size = tiles * rows * cols * hidden  # (T, TH, Q, H)
    saved_sizes = []

    def forward_compiler(gm, example_inputs):
        output = next(node for node in gm.graph.nodes if node.op == "output")
        _value, *saved = output.args[0]  # the forward returns its value, then what it saves
        saved_sizes.extend(node.meta["val"].numel() for node in saved if node is not None)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(
        fw_compiler=forward_compiler,
        bw_compiler=lambda gm, example_inputs: make_boxed_func(gm.forward),
        partition_fn=min_cut_rematerialization_partition,
    )
    loss = compiled_square_loss(form, backend)
    leaves = [x for x in terms if x is not None]
    compiled_grads = torch.autograd.grad(loss(*terms), leaves)
    assert saved_sizes
    assert max(saved_sizes) < hidden_size
    expected = torch.autograd.grad(reference(terms, "relu").square().sum(), leaves)
    for got, want in zip(compiled_grads, expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize(("depth", "outputs"), [(1, 17), (2, 5)])
def test_every_compiled_matmul_has_the_tile_positions_as_its_long_axis(depth, outputs):
    """Several outputs or hidden layers: the positions `TH * Q` are each batched matmul's
    output columns or its contraction, never its output rows (the `(T, TH * Q, H) @ (T, H, P)`
    layout, which MKL ran 4-5x slower for 8 units and 8 outputs), forward and backward; and
    both graphs compute the units-major row and column terms into buffers of their own."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    terms = inputs(tiles=3, rows=8, cols=4, hidden=6, depth=depth, outputs=outputs, seed=0)
    form = traced_form(terms, "relu")
    positions = terms.a.shape[1] * terms.b.shape[1]
    matmuls = []  # (output shape, contraction size) of every bmm
    realised_shapes = []  # per graph, the shapes of the buffers forced into a layout

    def record(gm, example_inputs):
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.bmm.default):
            left, _ = node.args
            matmuls.append((tuple(node.meta["val"].shape), left.meta["val"].shape[-1]))
        force = torch.ops.prims.inductor_force_stride_order.default
        nodes = gm.graph.find_nodes(op="call_function", target=force)
        realised_shapes.append(sorted(tuple(node.meta["val"].shape) for node in nodes))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    loss = compiled_square_loss(form, backend)
    leaves = [x for x in terms if x is not None]
    grads = torch.autograd.grad(loss(*terms), leaves)
    assert len(matmuls) >= 3 * depth  # forward: every layer; backward: two per layer
    for shape, contraction in matmuls:
        assert shape[-2] != positions, shape
        assert positions in (shape[-1], contraction), (shape, contraction)
    units_major = sorted([(3, 6, 8), (3, 6, 4)])  # (T, H, TH) and (T, H, Q)
    assert realised_shapes == [units_major, units_major]
    expected = torch.autograd.grad(reference(terms, "relu").square().sum(), leaves)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)


def _forward_nodes(fn, *args) -> tuple[list[torch.fx.Node], object]:
    """The nodes holding tensors of `fn`'s forward graph compiled by AOTAutograd, and what
    the compiled `fn` returns for `args`."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    nodes = []

    def record_forward(gm, example_inputs):
        nodes.extend(n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record_forward)
    result = torch.compile(fn, backend=backend, dynamic=False)(*args)  # one lambda, many shapes
    return nodes, result


@pytest.mark.slow
def test_a_compiled_forward_of_few_outputs_holds_neither_hidden_activations_nor_matmuls():
    """One hidden layer, at most 16 outputs (`_unrolls`): the forward is one pointwise sum over
    the units, so its graph has no matmul and nothing the size of the hidden activations."""
    terms = inputs(tiles=3, rows=8, cols=4, hidden=8, depth=1, outputs=5, seed=0)
    hidden_size = 3 * 8 * 8 * 4  # (T, H, Q * TH); the sum, with its spare slot: 3 * 6 * 4 * 8
    form = traced_form(terms, "relu")
    forward_nodes, out = _forward_nodes(
        lambda *flat: tile_mlp(Terms(*flat), "relu", form=form), *terms
    )
    assert forward_nodes
    assert torch.ops.aten.bmm.default not in {n.target for n in forward_nodes}
    assert max(n.meta["val"].numel() for n in forward_nodes) < hidden_size
    torch.testing.assert_close(out, reference(terms, "relu"))


@pytest.mark.parametrize(("tiles", "outputs", "cols"), [(7, 5, 4), (3, 5, 4), (3, 2, 6)])
def test_the_unrolled_sum_over_a_spare_slot_of_any_axis_equals_the_reference(tiles, outputs, cols):
    """`one_layer_unrolled` pads its longest outer axis (tiles, outputs, columns: one case
    each), then drops the spare slot: the outputs are the reference's."""
    from gbfunc.generate._traced_forms import one_layer_unrolled

    terms = inputs(tiles=tiles, rows=8, cols=cols, hidden=8, depth=1, outputs=outputs, seed=0)
    row_terms, col_terms = _units_major_terms(terms.a, terms.b, terms.c)
    got = one_layer_unrolled(row_terms, col_terms, terms.w_out, terms.b_out, "relu")
    torch.testing.assert_close(got, reference(terms, "relu"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("tiles", "outputs", "cols", "spare"),
    [(7, 5, 4, (8, 5, 4, 8)), (3, 5, 4, (3, 6, 4, 8)), (3, 2, 6, (3, 2, 7, 8))],
)
def test_the_compiled_sum_over_units_has_a_size_no_tile_gradient_shares(
    tiles, outputs, cols, spare
):
    """The unrolled forward's sum `(T, P, Q, TH)`, which inductor stores, runs over a spare
    slot of its longest outer axis: a training step compiled as one graph kept the stored sum
    past its last read to reuse it for the backward's tile gradient of the same size, across
    the step's peak. The forward graph stores the sum with the spare slot and nothing of the
    tiles' `T * TH * Q * P` shape."""
    terms = inputs(tiles=tiles, rows=8, cols=cols, hidden=8, depth=1, outputs=outputs, seed=0)
    form = traced_form(terms, "relu")
    nodes, out = _forward_nodes(lambda *flat: tile_mlp(Terms(*flat), "relu", form=form), *terms)
    shapes = [  # of the tensors computed, views aside (a view is no buffer of its own)
        tuple(n.meta["val"].shape)
        for n in nodes
        if n.op == "call_function" and not n.target.is_view
    ]
    assert spare in shapes
    assert (tiles, outputs, cols, 8) not in shapes
    torch.testing.assert_close(out, reference(terms, "relu"))


@pytest.mark.slow
def test_a_compiled_grad_recomputes_the_hidden_activations_only_once_the_gradient_exists():
    """`torch.func.grad` under `torch.compile` traces forward and backward as one graph. The
    backward's recomputation of the hidden activations must depend on the incoming gradient
    (after inductor's own graph passes, which fold products with the integer 0): with no
    such dependency inductor fused it into a forward kernel and held it until the backward
    (1.5 MiB above the plain model's peak on the main job's transformer)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch.func import grad

    terms = inputs(tiles=3, rows=8, cols=4, hidden=7, depth=1, outputs=5, seed=0)
    hidden_size, output_size = 3 * 7 * 8 * 4, 3 * 8 * 4 * 5  # (T, H, Q * TH), (T, TH, Q, P)
    form = traced_form(terms, "relu")
    graphs = []

    def record(gm, example_inputs):
        joint_graph_passes(gm)
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def loss(a, *rest):
        # `a * 1.0`: terms computed from the leaves, as gbfunc's are (see the module's notes)
        return tile_mlp(Terms(a * 1.0, *rest), "relu", form=form).square().sum()

    compiled = torch.compile(grad(loss), backend=aot_autograd(fw_compiler=record))
    detached = [None if x is None else x.detach() for x in terms]
    got = compiled(*detached)

    def sizes_before(node, seen):
        for parent in node.all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                sizes_before(parent, seen)
        return {n.meta["val"].numel() for n in seen if isinstance(n.meta.get("val"), torch.Tensor)}

    (graph,) = graphs
    recomputed = [
        n
        for n in graph.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() == hidden_size
    ]
    assert recomputed
    for node in recomputed:
        assert output_size in sizes_before(node, set()), node
    torch.testing.assert_close(got, grad(loss)(*detached))
