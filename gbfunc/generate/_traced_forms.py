"""The tile MLP's forms for traced code (`torch.compile`, gbfunc's compiled bodies): which
form runs (`forward_form`, the `torch` path's variant), and the bodies of all but the
units-major matmuls, which the eager form shares (`_bodies`).

Traced, one hidden layer and one output is one reduction over the units: a sum with the
columns as the vector axis (`by-columns`), or with the units as the vector axis on narrow
tiles (`by-units`), or the C loop `relu_one_output`; its backward is vectorised reductions
over the positions (`one_output_backward`, or the C loop `relu_unit_sums`). One layer with
few outputs is a written-out sum over the units (`unrolled`) or the C loop
`relu_layer_forward` and its backward (`c-loops`). Hashed tables are gathered through an
opaque hash op (`hashed_tiles`, `_spec.tile_hash_op`).
"""

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from .._plan import Stack
from .._spec import (
    HASH_GAIN,
    Terms,
    activate,
    activate_grad,
    code_tables,
    per_tile,
    signed_buckets,
    tile_hash_op,
)
from ..cpu import _relu_loops
from ..cpu._hash_gradient import signed_gather

# The forms of the tile MLP's forward (`forward_form`), as `gb.explain` names them.
EAGER = "eager-recompute"  # eagerly: fused reduction or units-major matmuls, in chunks
C_LOOPS = "c-loops"  # traced, ReLU in float32 on CPU: the C loops' sub-ops
BY_COLUMNS = "by-columns"  # traced, one output: a sum with the columns as the vector axis
BY_UNITS = "by-units"  # traced, one output, narrow tiles: the units as the vector axis
UNROLLED = "unrolled"  # traced, one layer, few outputs: a written-out sum over the units
UNITS_MAJOR = "units-major"  # traced, hidden layers or many outputs: units-major matmuls
# traced under transforms that dynamo traces no autograd.Function under: the spec's reference
PLAIN = "plain-autograd"
FORMS = (EAGER, C_LOOPS, BY_COLUMNS, BY_UNITS, UNROLLED, UNITS_MAJOR, PLAIN)
# The forms of a one-layer, one-output forward that read `b_t`, the columns' terms laid out
# units-major (`torch_ops.tile_mlp`).
ONE_OUTPUT_UNITS_MAJOR = (C_LOOPS, BY_COLUMNS)


def forward_form(
    *,
    one_layer: bool,
    hidden: int,
    outputs: int,
    activation: str,
    dtype: torch.dtype,
    device_type: str,
    traced: bool,
    exporting: bool,
    units_major_columns: bool,
    plain: bool = False,
) -> str:
    """Which form of the forward runs (one of `FORMS`), for g-nets of one hidden layer or
    more (`one_layer`), `hidden` units and `outputs`: `EAGER` unless `traced` (by
    `torch.compile`, or inside gbfunc's compiled bodies); traced, the C loops where they
    apply (not `exporting`: exported graphs hold standard ops only), else the form written
    for inductor. `units_major_columns`: a one-output forward is given `b_t`
    (`torch_ops.tile_mlp`). The one decision the bodies and the `variant` of the
    `torch`, `compiled-mlp` and `graph` paths (through `tile_form`) share. `plain`: traced
    where dynamo traces no custom `autograd.Function` (`Context.plain`): `PLAIN`, the
    specification's `reference` in plain autograd, materialising `(T, TH, Q, H)`."""
    if not traced:
        return EAGER
    if plain:
        return PLAIN
    relu_c = activation == "relu" and not exporting
    if one_layer and outputs == 1:
        if not units_major_columns:
            return BY_UNITS
        usable = relu_c and _relu_loops.one_output_usable(hidden, dtype, device_type)
        return C_LOOPS if usable else BY_COLUMNS
    if not one_layer:
        return UNITS_MAJOR
    if relu_c and _loops_layer(hidden, outputs, dtype, device_type):
        return C_LOOPS
    return UNROLLED if _unrolls(hidden, outputs) else UNITS_MAJOR


def _loops_layer(hidden: int, outputs: int, dtype: torch.dtype, device_type: str) -> bool:
    """Whether a one-layer ReLU forward runs the C loop `relu_layer_forward`: up to 32 units
    and 32 outputs, where it beat the written-out sum and the matmuls (at 32 outputs, 8-32
    units: 1.04-1.17x the units-major form's speed, forward and backward; at 64 outputs a
    tie, `benchmarks/results/bench_paths.md`), and where the loops run."""
    fits = hidden <= 32 and outputs <= 32
    return fits and _relu_loops.layer_usable(hidden, outputs, dtype, device_type)  # builds


def _unrolls(hidden: int, outputs: int) -> bool:
    """Whether compiled code computes a one-layer g-net's outputs as a sum over its units
    written out (`one_layer_unrolled`) rather than as a matmul: for at most 16 outputs, the
    matmul's rows, where MKL is slow; for at most 32 units, since each is a term of the code.
    With more outputs (row g-nets' 128 and 256) the written-out sum is no faster, hence the
    matmul there. For ReLU in float32 on CPU a C loop runs instead, up to 32 outputs
    (`_loops_layer`), which computes each hidden activation once rather than once per
    output, and so does the backward."""
    return outputs <= 16 and hidden <= 32


def _reads_units_major(stack: Stack, w_in: Tensor, traced: bool) -> bool:
    """Whether the tile MLP's forward runs as compiled code that reads `units_major_columns`:
    one hidden layer and one output (a fused reduction), `traced` (by `torch.compile`, or
    compiled eagerly), on tiles wide enough for it (`reads_units_major_columns`)."""
    wide = reads_units_major_columns(stack.columns, w_in.dtype, w_in.device)
    return stack.one_reduction and wide and traced


def tile_form(
    stack: Stack, w_in: Tensor, *, traced: bool, exporting: bool, plain: bool = False
) -> str:
    """The form of the tile MLP's forward (`forward_form`) that `torch_ops.evaluate_parts` runs for
    `stack` with first layers `w_in`: `traced` by `torch.compile` or in gbfunc's compiled
    bodies (the `compiled-mlp` path's, never exporting); `plain`: `Context.plain`."""
    genome = stack.genome
    return forward_form(
        one_layer=genome.depth == 1,
        hidden=genome.hidden,
        outputs=stack.outputs,
        activation=genome.activation,
        dtype=w_in.dtype,
        device_type=w_in.device.type,
        traced=traced,
        exporting=exporting,
        units_major_columns=_reads_units_major(stack, w_in, traced),
        plain=plain,
    )


@torch.compiler.assume_constant_result
def _vector_lanes(dtype: torch.dtype, device_type: str) -> int:
    """Elements of `dtype` in one vector register of inductor's code for `device_type`: the
    width of the CPU's vector ISA as torch reports it (8 floats on AVX2, 16 on AVX-512); 1
    elsewhere (GPUs, CPUs torch runs without vectors). Asked of torch's public capability,
    not of inductor, whose probe compiles a program and raises without a C++ compiler."""
    if device_type != "cpu":
        return 1
    bits = _VECTOR_BITS.get(torch.backends.cpu.get_cpu_capability(), 0)
    return max(1, bits // (8 * dtype.itemsize))


# Vector width per `torch.backends.cpu.get_cpu_capability()`; other capabilities: none.
_VECTOR_BITS = {"AVX512": 512, "AVX2": 256, "SVE256": 256, "SVE128": 128}


# The forward bodies.


def one_output(
    row_terms: Tensor, b: Tensor, b_t: Tensor | None, w: Tensor, activation: str, form: str
) -> Tensor:
    """`(T, TH, Q)` outputs of one-layer, one-output g-nets before their bias, in the traced
    `form` (`C_LOOPS`, `BY_COLUMNS` or `BY_UNITS`), from the row terms `(T, TH, H)` (`a + c`),
    the column terms `b` `(T, Q, H)` (or, for the first two, `b_t`) and `w` `(T, H)`."""
    if form == C_LOOPS:
        return _relu_loops.relu_one_output(row_terms, b_t, w)
    if form == BY_COLUMNS:
        return _one_output_by_columns(row_terms, b_t, w, activation)
    return _one_output_by_units(row_terms, b, w, activation)


def relu_layer(terms: Terms) -> Tensor:
    """A one-layer ReLU forward by the C loop `relu_layer_forward` (`C_LOOPS`),
    `(T, TH, Q, P)`."""
    a, b, c, _, _, w_out, b_out = terms
    return _relu_loops.relu_layer_forward(a + c[:, None], b, w_out, b_out)


def one_layer_unrolled(
    row_terms: Tensor, col_terms: Tensor, w_out: Tensor, b_out: Tensor, activation: str
) -> Tensor:
    """The forward of one hidden layer (`UNROLLED`), `(T, TH, Q, P)`, from the units-major row
    terms `(T, H, TH)` and column terms `(T, H, Q)`, as one pointwise sum over the units: inductor
    computes each output from the row and column terms in registers, without the hidden
    activations or the matmul's output in memory, and can fuse the tiles' layout after it.

    The sum runs over a spare tile, output or column of zeros (the longest of those axes),
    dropped after: inductor stores the sum, too long a chain to inline into the layout, and,
    compiling a training step as one graph, kept that buffer past its last read to reuse it
    for the backward's tile gradient, which has the same size, across the step's peak. With
    the spare slot the sizes differ, and the buffer is freed after its last read. (The
    one-output forward's sum was left as it is: padded the same way, some compiled peaks fell
    and others rose; `benchmarks/results/design_measurements.md`.)"""
    num_tiles, hidden, _ = row_terms.shape
    outputs, cols = w_out.shape[-1], col_terms.shape[-1]
    longest = max(num_tiles, outputs, cols)
    if longest == num_tiles:
        row_terms, col_terms, w_out, b_out = (
            _padded(x, 0) for x in (row_terms, col_terms, w_out, b_out)
        )
    elif longest == outputs:
        w_out, b_out = _padded(w_out, 2), _padded(b_out, 1)
    else:
        col_terms = _padded(col_terms, 2)
    out = b_out[:, :, None, None]
    for unit in range(hidden):
        h = activate(row_terms[:, unit, None, :] + col_terms[:, unit, :, None], activation)
        out = out + w_out[:, unit, :, None, None] * h[:, None]  # (T, P, Q, TH)
    return out[:num_tiles, :outputs, :cols].permute(0, 3, 2, 1)


def _padded(x: Tensor, axis: int) -> Tensor:
    """`x` with one more slot of zeros at the end of `axis`."""
    return F.pad(x, (0, 0) * (x.dim() - 1 - axis) + (0, 1))


def _one_output_by_columns(row_terms: Tensor, b_t: Tensor, w: Tensor, activation: str) -> Tensor:
    """`(T, TH, Q)` outputs of one-layer, one-output g-nets, written for inductor, from the
    row terms `(T, TH, H)` (`a + c`), the column terms laid out units-major, `b_t` `(T, H, Q)`,
    and `w` `(T, H)`. The sum over the units runs with the columns as the vector axis, in
    registers, where with the units innermost each weight ends in a horizontal sum across a
    register. Only for at least a vector register of columns: narrower, inductor's code
    forks threads inside a serial loop. `b_t` must be realised in that layout (a matmul's
    output): a transposed view of `b` is read strided, element by element, and the gain is
    lost."""
    z = row_terms[:, :, :, None] + b_t[:, None, :, :]  # (T, TH, H, Q)
    return (activate(z, activation) * w[:, None, :, None]).sum(2)


def _one_output_by_units(row_terms: Tensor, b: Tensor, w: Tensor, activation: str) -> Tensor:
    """`_one_output_by_columns` from `b` `(T, Q, H)`, for tiles with fewer columns than a
    vector register holds: the hidden units `vectorised_units` counts reduced as the vector
    axis, the others one at a time."""
    split = vectorised_units(row_terms)
    out = 0
    if split:
        z = row_terms[:, :, None, :split] + b[:, None, :, :split]
        out = (activate(z, activation) * w[:, None, None, :split]).sum(-1)
    for unit in range(split, row_terms.shape[-1]):
        z = row_terms[:, :, unit, None] + b[:, None, :, unit]
        out = out + activate(z, activation) * w[:, unit, None, None]
    return out


def reads_units_major_columns(columns: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether compiled one-output forwards of tiles with `columns` evaluation columns are
    faster from units-major column terms (`torch_ops.tile_mlp`'s `b_t`): where the columns fill at
    least one vector register (`_one_output_by_columns`)."""
    return columns >= _vector_lanes(dtype, torch.device(device).type)


def vectorised_units(row_terms: Tensor) -> int:
    """How many leading hidden units the compiled backward (`_fused_reductions`), and the
    forward of narrow tiles (`_one_output_by_units`), reduce over as one vectorised axis: the
    largest multiple of `_vector_lanes`, and the units left over too where they fill more
    than half a register. Inductor vectorises a short innermost axis with one partial
    (masked) vector, about as costly as a full one; units that go one at a time, vectorised
    along the positions, cost a pass each."""
    hidden = row_terms.shape[-1]
    lanes = _vector_lanes(row_terms.dtype, row_terms.device.type)
    left_over = hidden % lanes
    return hidden if 2 * left_over > lanes else hidden - left_over


def units_major_columns(stack: Stack, leaves: Mapping[str, Tensor]) -> Tensor:
    """`stack_terms(stack, leaves).b` laid out units-major, `(T, H, Q)`: a matmul's own
    output, which compiled code reads with the columns as the vector axis (`torch_ops.tile_mlp`)."""
    w_in = leaves["w_in"]
    _, col = code_tables(stack, w_in)
    b_t = w_in[:, stack.row_width :].mT @ col.mT  # (G, H, Q)
    return per_tile(b_t, stack.tiles_per_gnet) if stack.genome.share else b_t


# The backward bodies.


def one_output_backward(grad: Tensor, terms: Terms, activation: str) -> Terms:
    """Gradients of a one-layer, one-output forward in a traced form, as vectorised
    reductions over the positions (`_fused_reductions`); `grad` `(T, TH, Q, 1)`."""
    a, b, c, _, _, w_out, _ = terms
    g_a, g_b, g_w_out = _fused_reductions(grad[..., 0], a, b, c, w_out[..., 0], activation)
    return Terms.one_layer_gradients(g_a, g_b, g_w_out[..., None], grad)


def relu_layer_backward(grad: Tensor, terms: Terms) -> Terms:
    """Gradients of `relu_layer` by the C loop `relu_layer_backward`."""
    a, b, c, _, _, w_out, _ = terms
    g_a, g_b, g_w_out = _relu_loops.relu_layer_backward(grad, a + c[:, None], b, w_out)
    return Terms.one_layer_gradients(g_a, g_b, g_w_out, grad)


def _fused_reductions(g: Tensor, a: Tensor, b: Tensor, c: Tensor, w: Tensor, activation: str):
    """dA, dB and dw of the one-layer, one-output g-net as reductions for inductor.

    Each is written with its reduced axis innermost, so inductor emits one vectorised
    reduction loop per gradient that recomputes the pre-activation in registers instead of
    materialising `(T, TH, Q, H)` (as it does for the shared-`z` form, many times slower).
    Hidden units that fill half a vector register or less go one at a time
    (`vectorised_units`). ReLU's on CPU, in float32, take one pass in C instead where
    `_relu_loops.sums_usable`.
    Shapes: g `(T, TH, Q)`, a `(T, TH, H)`, b `(T, Q, H)`, c and w `(T, H)`.
    """
    row_terms = a + c[:, None]  # (T, TH, H)
    if activation == "relu" and _relu_loops.sums_usable(a.shape[-1], g.dtype, g.device.type):
        rows, cols = _relu_loops.relu_unit_sums(g, -row_terms, b)  # one pass, in C
        g_w = _relu_weight_gradient(row_terms, b, rows, cols)
        return rows * w[:, None, :], cols * w[:, None, :], g_w
    g_t = g.transpose(1, 2).contiguous()  # (T, Q, TH): unit-stride innermost reads
    split = vectorised_units(row_terms)
    parts = []
    if split:
        parts.append(_unit_axis_sums(g, g_t, row_terms[..., :split], b[..., :split], activation))
    for unit in range(split, row_terms.shape[-1]):
        parts.append(_one_unit_sums(g, g_t, row_terms[..., unit], b[..., unit], activation))
    rows, cols, g_w = (torch.cat(p, -1) for p in zip(*parts, strict=True))
    return rows * w[:, None, :], cols * w[:, None, :], g_w


def _unit_axis_sums(g: Tensor, g_t: Tensor, row_terms: Tensor, b: Tensor, activation: str):
    """Unscaled `(rows (T, TH, U), cols (T, Q, U), dw (T, U))` of U units vectorised over U.

    ReLU's derivative is a comparison, `(a + c) + b > 0` exactly when `b > -(a + c)` (a
    rounded sum keeps the exact sum's sign), so each position costs a compare and a select,
    not two adds and a multiply by a mask. ReLU is homogeneous (`relu(z) = z * [z > 0]`), so
    its dw follows from the two masked sums without a third pass over the positions.
    """
    b_t = b.transpose(1, 2).contiguous()  # (T, U, Q)
    if activation == "relu":
        threshold = -row_terms
        threshold_t = threshold.transpose(1, 2).contiguous()  # (T, U, TH)
        rows = torch.where(b_t[:, None] > threshold[..., None], g[:, :, None, :], 0.0).sum(-1)
        cols = torch.where(b[..., None] > threshold_t[:, None], g_t[:, :, None, :], 0.0).sum(-1)
        return rows, cols, _relu_weight_gradient(row_terms, b, rows, cols)
    row_terms_t = row_terms.transpose(1, 2).contiguous()  # (T, U, TH)
    z = row_terms[..., None] + b_t[:, None]  # (T, TH, U, Q)
    rows = (g[:, :, None, :] * activate_grad(z, activation)).sum(-1)
    z = row_terms_t[:, None] + b[..., None]  # (T, Q, U, TH)
    cols = (g_t[:, :, None, :] * activate_grad(z, activation)).sum(-1)
    z = row_terms_t[..., None] + b_t[:, :, None, :]  # (T, U, TH, Q)
    return rows, cols, (g[:, None] * activate(z, activation)).sum((2, 3))


def _relu_weight_gradient(row_terms: Tensor, b: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """dw of a ReLU unit from its two masked sums of the output gradient, `rows` (over the
    columns) and `cols` (over the rows): ReLU is homogeneous (`relu(z) = z * [z > 0]`) and
    `z = row_terms + b`, so no third pass over the positions is needed."""
    return (row_terms * rows).sum(1) + (b * cols).sum(1)


def _one_unit_sums(g: Tensor, g_t: Tensor, row_terms: Tensor, b: Tensor, activation: str):
    """`_unit_axis_sums` of one unit, `row_terms` `(T, TH)` and `b` `(T, Q)`: reductions over
    the positions, vectorised along them. Results keep a unit axis of size 1."""
    if activation == "relu":
        rows = torch.where(b[:, None, :] > -row_terms[..., None], g, 0.0).sum(-1)
        cols = torch.where(b[..., None] > -row_terms[:, None, :], g_t, 0.0).sum(-1)
        g_w = _relu_weight_gradient(row_terms, b, rows, cols)
    else:
        z = row_terms[..., None] + b[:, None, :]  # (T, TH, Q)
        rows = (g * activate_grad(z, activation)).sum(-1)
        z_t = b[..., None] + row_terms[:, None, :]  # (T, Q, TH)
        cols = (g_t * activate_grad(z_t, activation)).sum(-1)
        g_w = (g * activate(z, activation)).sum((1, 2))
    return rows[..., None], cols[..., None], g_w[..., None]


# Hashed tables, traced.


def hashed_tiles(stack: Stack, table: Tensor, *, plain: bool = False) -> Tensor:
    """Each tile's hashed weights `(T, TH, TW * K)` from its table `(T, buckets)`, traced:
    the hash an opaque op, the gather's backward the C loop where it runs (`plain`: where
    dynamo traces no autograd.Function, `Context.plain`, torch's)."""
    packed = tile_hash_op(stack.tile_positions, stack.genome.hashed, table.device)
    # A view: under `torch.func.grad`, dynamo drops the backward of a Function applied to the
    # transformed function's own argument and differentiates its forward instead
    # (pytorch/pytorch#193279, torch 2.13), which kept torch's scatter-add and the int64
    # index inductor writes for it.
    gather = signed_buckets if plain else signed_gather
    shared = gather(table.view_as(table), packed) * HASH_GAIN
    return shared.reshape(table.shape[0], stack.tile[0], -1)
