"""The C loops of one-layer ReLU g-nets against their torch specifications."""

import functools
from unittest import mock

import pytest
import torch
from forms import traced_form
from hypothesis import example, given, settings, strategies as st
from threads import on_threads

from gbfunc._spec import Terms
from gbfunc.cpu import _relu_loops
from gbfunc.cpu._build import Loop, launch
from gbfunc.cpu._relu_loops import (
    MIN_UNITS,
    backward_reference,
    forward_reference,
    layer_usable,
    one_output_reference,
    relu_layer_backward,
    relu_layer_forward,
    relu_one_output,
    relu_unit_sums,
    sums_reference,
    sums_usable,
)
from gbfunc.generate._traced_forms import (
    EAGER,
    _fused_reductions,
    forward_form,
    reads_units_major_columns,
)
from gbfunc.generate.torch_ops import backward_recompute, tile_mlp

pytestmark = pytest.mark.skipif(
    not sums_usable(MIN_UNITS, torch.float32, "cpu"), reason="no C++ compiler for the C loops"
)


def sums_inputs(tiles, rows, cols, units, seed, integers=False):
    """g, threshold and b; small integers make many ties (`b == threshold`)."""
    gen = torch.Generator().manual_seed(seed)
    if integers:
        draw = lambda *shape: torch.randint(-2, 3, shape, generator=gen).float()
    else:
        draw = lambda *shape: torch.randn(shape, generator=gen)
    return draw(tiles, rows, cols), draw(tiles, rows, units), draw(tiles, cols, units)


# Shapes of one-layer g-nets with several outputs, for the forward and backward loops.
LAYER_SHAPES = {
    "tiles": st.integers(1, 4),
    "rows": st.integers(1, 6),
    "cols": st.integers(1, 15),
    "units": st.integers(MIN_UNITS, 37),
    "outputs": st.integers(1, 19),
    "threads": st.sampled_from([1, 2, 3]),
    "seed": st.integers(0, 2**16),
}


# Shapes of one-output g-nets' tiles, for the sums' loop and the one-output forward's.
ONE_OUTPUT_SHAPES = {
    "tiles": st.integers(1, 4),
    "rows": st.integers(1, 9),
    "units": st.integers(MIN_UNITS, 37),
    "threads": st.sampled_from([1, 2, 3]),
    "seed": st.integers(0, 2**16),
}


# Units in whole 16-lane vectors take the sums' AVX-512 code where the CPU has it, any other
# count the portable loop: both always drawn.
@settings(max_examples=40, deadline=None)
@given(**ONE_OUTPUT_SHAPES, cols=st.integers(1, 40), integers=st.booleans())
@example(tiles=2, rows=9, units=32, threads=1, seed=0, cols=37, integers=True)
@example(tiles=3, rows=5, units=16, threads=2, seed=1, cols=3, integers=False)
def test_the_c_loop_equals_its_specification_on_any_shape(
    tiles, rows, cols, units, threads, integers, seed
):
    """Units that fill vector registers or leave a ragged end, tiles fewer than the threads
    (split by rows, then the splits' column sums added), rows four at a time and the rest
    one by one, ties that must count as inactive."""
    g, threshold, b = sums_inputs(tiles, rows, cols, units, seed, integers)
    got = on_threads(threads, relu_unit_sums, g, threshold, b)
    want = sums_reference(g, threshold, b)
    torch.testing.assert_close(got[0], want[0], msg="rows")
    torch.testing.assert_close(got[1], want[1], msg="cols")


def test_the_c_loop_reads_strided_inputs():
    """Inputs as compiled graphs hand them over: transposed views and expanded tiles."""
    g, threshold, b = sums_inputs(3, 5, 7, 6, seed=1)
    g_t, b_t = g.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()
    args = (g_t.transpose(1, 2), threshold, b_t.transpose(1, 2))
    torch.testing.assert_close(relu_unit_sums(*args), sums_reference(g, threshold, b))
    shared = b[:1].expand(3, -1, -1)
    torch.testing.assert_close(
        relu_unit_sums(g, threshold, shared), sums_reference(g, threshold, shared.contiguous())
    )


def test_vmap_folds_genomes_into_tiles():
    """`vmap` over genomes, with an unbatched argument: each genome's sums."""
    g, threshold, _ = sums_inputs(6, 5, 7, 8, seed=2)
    b = torch.randn(3, 7, 8)
    got = torch.vmap(relu_unit_sums, in_dims=(0, 0, None))(
        g.unflatten(0, (2, 3)), threshold.unflatten(0, (2, 3)), b
    )
    for genome in range(2):
        part = slice(3 * genome, 3 * genome + 3)
        want = sums_reference(g[part], threshold[part], b)
        torch.testing.assert_close(got[0][genome], want[0])
        torch.testing.assert_close(got[1][genome], want[1])


def test_the_c_loop_differentiates_as_its_specification():
    """Linear in `g` (double backward through a compiled backward): the same gradient."""
    g, threshold, b = sums_inputs(2, 4, 6, 5, seed=3)
    g.requires_grad_()
    weights = torch.randn(2, 4, 5), torch.randn(2, 6, 5)

    def gradient(sums):
        rows, cols = sums(g, threshold, b)
        return torch.autograd.grad((rows * weights[0]).sum() + (cols * weights[1]).sum(), g)[0]

    torch.testing.assert_close(gradient(relu_unit_sums), gradient(sums_reference))


def test_only_cpu_float32_with_enough_units_takes_the_c_loops():
    assert sums_usable(MIN_UNITS, torch.float32, "cpu")
    assert not sums_usable(MIN_UNITS - 1, torch.float32, "cpu")
    assert not sums_usable(MIN_UNITS, torch.float64, "cpu")
    assert not sums_usable(MIN_UNITS, torch.float32, "cuda")
    assert layer_usable(MIN_UNITS, 1, torch.float32, "cpu")
    assert layer_usable(MIN_UNITS, 64, torch.float32, "cpu")
    assert not layer_usable(MIN_UNITS, 65, torch.float32, "cpu")
    assert not layer_usable(MIN_UNITS - 1, 8, torch.float32, "cpu")
    assert not layer_usable(MIN_UNITS, 8, torch.bfloat16, "cpu")


@pytest.mark.parametrize(
    ("hidden", "outputs", "activation", "form"),
    [
        (8, 2, "relu", "c-loops"),
        (8, 32, "relu", "c-loops"),  # past the unrolled sum's 16 outputs, the loop still wins
        (32, 32, "relu", "c-loops"),
        (8, 33, "relu", "units-major"),  # a tie with the matmuls at 64: they keep it
        (33, 8, "relu", "units-major"),
        (8, 32, "tanh", "units-major"),
        (8, 16, "tanh", "unrolled"),
    ],
)
def test_traced_one_layer_forwards_take_the_loop_up_to_32_units_and_32_outputs(
    hidden, outputs, activation, form
):
    """`forward_form`'s rule for one hidden layer of several outputs, traced on CPU in
    float32 with the loops built."""
    chosen = forward_form(
        one_layer=True,
        hidden=hidden,
        outputs=outputs,
        activation=activation,
        dtype=torch.float32,
        device_type="cpu",
        traced=True,
        exporting=False,
        units_major_columns=False,
    )
    assert chosen == form


def test_without_a_compiler_the_reductions_run_in_torch(failing_loops):
    """A compiler that fails: one warning, `usable` says no, and the backward still comes
    out right."""
    units = 23
    with pytest.warns(RuntimeWarning, match="CPU loops are off"):
        assert not sums_usable(units, torch.float32, "cpu")
    assert not layer_usable(units, 3, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, 3, units, generator=gen), torch.randn(2, 5, units, generator=gen)
    c, w = torch.randn(2, units, generator=gen), torch.randn(2, units, generator=gen)
    g = torch.randn(2, 3, 5, generator=gen)
    with mock.patch.object(_relu_loops, "relu_unit_sums", side_effect=AssertionError("ran")):
        got = _fused_reductions(g, a, b, c, w, "relu")
    terms = Terms(a, b, c, None, None, w[..., None], torch.zeros(2, 1))
    want = backward_recompute(g[..., None], terms, "relu")
    torch.testing.assert_close(got[0], want.a)
    torch.testing.assert_close(got[1], want.b)


@pytest.mark.slow
@pytest.mark.parametrize(("outputs", "columns"), [(1, 5), (1, 40), (5, 11)])
def test_a_compiled_step_through_relu_gnets_runs_the_c_loops(outputs, columns):
    """`torch.compile` of a step through the tile MLP (one layer, ReLU, float32): one output
    takes the backward's sums, and the forward's loop where the columns fill a vector register
    (and `torch_ops` passes them units-major); a few outputs take the forward and backward
    loops. The gradients are the eager ones."""
    by_columns = reads_units_major_columns(columns, torch.float32, torch.device("cpu"))
    if outputs > 1:
        loops = {"relu_layer_forward", "relu_layer_backward"}
    else:
        loops = {"relu_unit_sums", "relu_one_output"} if by_columns else {"relu_unit_sums"}
    gen = torch.Generator().manual_seed(5)
    leaves = [
        torch.randn(shape, generator=gen, requires_grad=True)
        for shape in ((3, 9, 8), (3, columns, 8), (3, 8), (3, 8, outputs), (3, outputs))
    ]

    def loss(a, b, c, w_out, b_out, form=EAGER):
        b_t = b.transpose(1, 2).contiguous() if by_columns else None  # as `torch_ops` has it
        out = tile_mlp(Terms(a, b, c, None, None, w_out, b_out), "relu", form=form, b_t=b_t)
        return (out * out).sum()

    want = torch.autograd.grad(loss(*leaves), leaves)
    a, b, c, w_out, b_out = leaves
    b_t = b.transpose(1, 2) if by_columns else None
    traced = traced_form(Terms(a, b, c, None, None, w_out, b_out), "relu", b_t)
    calls = []
    function = _relu_loops.launch  # what the ops call to run a loop

    def counted(loop, *args, **kwargs):
        calls.append(loop.name)
        return function(loop, *args, **kwargs)

    compiled = torch.compile(functools.partial(loss, form=traced), fullgraph=True, dynamic=False)
    with mock.patch.object(_relu_loops, "launch", counted):
        got = torch.autograd.grad(compiled(*leaves), leaves)
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    assert set(calls) == loops


@settings(max_examples=40, deadline=None)
@given(**ONE_OUTPUT_SHAPES, cols=st.integers(1, 70))
@example(tiles=2, rows=7, units=32, threads=1, seed=0, cols=69)
def test_the_one_output_loop_equals_its_specification_on_any_shape(
    tiles, rows, cols, units, threads, seed
):
    """Rows not a multiple of the loop's four-row blocks, columns in blocks of 32 and a
    ragged rest (or fewer than 32), units that fill vector registers or leave a ragged end."""
    gen = torch.Generator().manual_seed(seed)
    args = [
        torch.randn(shape, generator=gen)
        for shape in ((tiles, rows, units), (tiles, units, cols), (tiles, units))
    ]
    torch.testing.assert_close(
        on_threads(threads, relu_one_output, *args), one_output_reference(*args)
    )


def test_the_one_output_loop_under_vmap_and_autograd():
    """Genomes under `vmap` (one argument shared), strided inputs, and the gradient of every
    argument: the reference's."""
    gen = torch.Generator().manual_seed(6)
    row_terms, b_t = torch.randn(2, 3, 5, 6, generator=gen), torch.randn(3, 6, 35, generator=gen)
    w = torch.randn(3, 2, generator=gen).T.reshape(2, 3, 1).expand(2, 3, 6)
    got = torch.vmap(relu_one_output, in_dims=(0, None, 0))(row_terms, b_t, w)
    for genome in range(2):
        want = one_output_reference(row_terms[genome], b_t, w[genome])
        torch.testing.assert_close(got[genome], want)
    args = [x[0].clone().requires_grad_() for x in (row_terms, w)]
    args.insert(1, b_t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_())
    grad = torch.randn(3, 5, 35, generator=gen)
    got = torch.autograd.grad(relu_one_output(*args), args, grad)
    want = torch.autograd.grad(one_output_reference(*args), args, grad)
    for name, x, y in zip(("row_terms", "b_t", "w"), got, want, strict=True):
        torch.testing.assert_close(x, y, msg=name)


@settings(max_examples=40, deadline=None)
@given(**LAYER_SHAPES)
def test_the_forward_loop_equals_its_specification_on_any_shape(
    tiles, rows, cols, units, outputs, threads, seed
):
    """Columns not a multiple of the loop's four-position blocks, units and outputs that
    fill vector registers or leave ragged ends."""
    gen = torch.Generator().manual_seed(seed)
    args = [
        torch.randn(shape, generator=gen)
        for shape in ((tiles, rows, units), (tiles, cols, units), (tiles, units, outputs))
    ] + [torch.randn(tiles, outputs, generator=gen)]
    torch.testing.assert_close(
        on_threads(threads, relu_layer_forward, *args), forward_reference(*args)
    )


def test_the_forward_loop_under_vmap_and_autograd():
    """Genomes under `vmap` (one argument shared) and the gradient of every argument: the
    reference's."""
    gen = torch.Generator().manual_seed(7)
    row_terms, b = torch.randn(2, 3, 4, 6, generator=gen), torch.randn(3, 5, 6, generator=gen)
    w_out, b_out = torch.randn(2, 3, 6, 3, generator=gen), torch.randn(2, 3, 3, generator=gen)
    got = torch.vmap(relu_layer_forward, in_dims=(0, None, 0, 0))(row_terms, b, w_out, b_out)
    for genome in range(2):
        want = forward_reference(row_terms[genome], b, w_out[genome], b_out[genome])
        torch.testing.assert_close(got[genome], want)
    args = [x[0].clone().requires_grad_() for x in (row_terms, w_out, b_out)]
    args.insert(1, b.clone().requires_grad_())
    grad = torch.randn(3, 4, 5, 3, generator=gen)
    got = torch.autograd.grad(relu_layer_forward(*args), args, grad)
    want = torch.autograd.grad(forward_reference(*args), args, grad)
    for name, x, y in zip(("row_terms", "b", "w_out", "b_out"), got, want, strict=True):
        torch.testing.assert_close(x, y, msg=name)


@settings(max_examples=40, deadline=None)
@given(**LAYER_SHAPES)
def test_the_backward_loop_equals_its_specification_on_any_shape(
    tiles, rows, cols, units, outputs, threads, seed
):
    """Every gradient of the forward loop's specification, with fewer tiles than threads (split
    by rows, the splits' sums added) and ragged units and outputs."""
    gen = torch.Generator().manual_seed(seed)
    args = [
        torch.randn(shape, generator=gen)
        for shape in (
            (tiles, rows, cols, outputs),
            (tiles, rows, units),
            (tiles, cols, units),
            (tiles, units, outputs),
        )
    ]
    got = on_threads(threads, relu_layer_backward, *args)
    want = backward_reference(*args)
    for name, x, y in zip(("row_terms", "b", "w_out"), got, want, strict=True):
        torch.testing.assert_close(x, y, msg=name)


def test_backward_reference_is_autograd_of_the_forward_reference():
    """The backward's specification is the forward's gradient, as autograd has it."""
    gen = torch.Generator().manual_seed(8)
    args = [
        torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
        for shape in ((2, 3, 5), (2, 4, 5), (2, 5, 3), (2, 3))
    ]
    grad = torch.randn(2, 3, 4, 3, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(forward_reference(*args), args[:3], grad)
    got = backward_reference(grad, *(x.detach() for x in args[:3]))
    for name, x, y in zip(("row_terms", "b", "w_out"), got, want, strict=True):
        torch.testing.assert_close(x, y, msg=name)


def test_the_backward_loop_under_vmap_and_autograd():
    """Genomes under `vmap`, and double backward through the loop: the reference's."""
    gen = torch.Generator().manual_seed(9)
    grad, row_terms = (
        torch.randn(2, 3, 4, 5, 3, generator=gen),
        torch.randn(2, 3, 4, 6, generator=gen),
    )
    b, w_out = torch.randn(3, 5, 6, generator=gen), torch.randn(2, 3, 6, 3, generator=gen)
    got = torch.vmap(relu_layer_backward, in_dims=(0, 0, None, 0))(grad, row_terms, b, w_out)
    for genome in range(2):
        want = backward_reference(grad[genome], row_terms[genome], b, w_out[genome])
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x[genome], y)
    args = [x.clone().requires_grad_() for x in (grad[0], row_terms[0], b, w_out[0])]
    weights = [torch.randn(x.shape, generator=gen) for x in (row_terms[0], b, w_out[0])]

    def gradient(loop):
        total = sum((out * weight).sum() for out, weight in zip(loop(*args), weights, strict=True))
        return torch.autograd.grad(total, (args[0], args[3]))

    for x, y in zip(gradient(relu_layer_backward), gradient(backward_reference), strict=True):
        torch.testing.assert_close(x, y)


def test_a_loop_refuses_tensors_it_would_misread():
    """The loops read raw pointers: a bfloat16 tensor (autocast's) was read as float32 past
    its end, a meta table written through a null pointer, and another plan's g-nets (the
    tile count from the tensors, the placement from the plan) written past a weight's end."""
    row_terms = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"relu_one_output takes CPU tensors with data, float"):
        _relu_loops.relu_one_output(row_terms, torch.zeros(1, 8, 3), torch.zeros(1, 8))
    loop = Loop("any_loop", "none.cpp", pointers=2, sizes=1)
    with pytest.raises(RuntimeError, match=r"any_loop takes .* got torch.float32 on meta"):
        launch(loop, 8, 1, [torch.zeros(3), None, torch.zeros(3, device="meta")], 3)
    with pytest.raises(RuntimeError, match=r"any_loop got g-nets for 4 tiles where the plan"):
        launch(loop, 8, 1, torch.zeros(3), 3, tiles=(4, 8))
