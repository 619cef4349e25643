"""The tile MLP's forward bodies (`generate.torch_ops.tile_mlp`), without saving activations:
the eager form, and the forms written for compiled code, chosen by the g-net's shape, the
activation, whether the C loops run, and the CPU's vector width.

One hidden layer and one output is one fused reduction over the units (eagerly; traced: a
sum over the units with the columns as the vector axis, or the C loop `relu_one_output`).
With several outputs or hidden layers the activations are laid out units-major,
`(T, H, Q * TH)`, so that every matmul has the tile's positions as its long axis
(`_forward_units_major`); traced, one layer with few outputs is a written-out sum over the
units (`_one_layer_unrolled`) or the C loop `relu_layer_forward`.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .._realised import contiguous_buffer
from .._spec import Terms, activate, first_layer
from ..cpu import _relu_loops

# The forms of the tile MLP's forward (`forward_form`), as `gb.explain` names them.
EAGER = "eager-recompute"  # eagerly: fused reduction or units-major matmuls, in chunks
C_LOOPS = "c-loops"  # traced, ReLU in float32 on CPU: the C loops' sub-ops
BY_COLUMNS = "by-columns"  # traced, one output: a sum with the columns as the vector axis
BY_UNITS = "by-units"  # traced, one output, narrow tiles: the units as the vector axis
UNROLLED = "unrolled"  # traced, one layer, few outputs: a written-out sum over the units
UNITS_MAJOR = "units-major"  # traced, hidden layers or many outputs: units-major matmuls
FORMS = (EAGER, C_LOOPS, BY_COLUMNS, BY_UNITS, UNROLLED, UNITS_MAJOR)
# The forms of a one-layer, one-output forward that read `b_t`, the columns' terms laid out
# units-major (`tile_mlp`).
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
) -> str:
    """Which form of the forward runs (one of `FORMS`), for g-nets of one hidden layer or
    more (`one_layer`), `hidden` units and `outputs`: `EAGER` unless `traced` (by
    `torch.compile`, or inside gbfunc's compiled bodies); traced, the C loops where they
    apply (not `exporting`: exported graphs hold standard ops only), else the form written
    for inductor. `units_major_columns`: a one-output forward is given `b_t` (`tile_mlp`).
    The one decision the forward's bodies and `gb.explain` (`generate.torch_ops`) share."""
    if not traced:
        return EAGER
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


def terms_form(terms: Terms, activation: str, b_t: Tensor | None, *, traced: bool) -> str:
    """`forward_form` of these terms (not exported), `traced` or not: the form a caller that
    holds terms rather than a stack (tests, benchmarks) passes to `tile_mlp`."""
    a = terms.a
    return forward_form(
        one_layer=terms.w_hidden is None,
        hidden=a.shape[-1],
        outputs=terms.w_out.shape[-1],
        activation=activation,
        dtype=a.dtype,
        device_type=a.device.type,
        traced=traced,
        exporting=False,
        units_major_columns=b_t is not None,
    )


def _forward_no_save(
    terms: Terms, activation: str, b_t: Tensor | None = None, form: str = EAGER
) -> Tensor:
    """`reference` in the form `form` (`forward_form`'s, which `b_t` must fit)."""
    a, b, c, _, _, w_out, b_out = terms
    if terms.one_reduction:
        # One hidden layer, one output: a single fused reduction over H.
        if form == EAGER:
            h = activate(first_layer(a, b, c), activation)
            out = (h * w_out[:, None, None, :, 0]).sum(-1)
        elif form == C_LOOPS:
            out = _relu_loops.relu_one_output(a + c[:, None], b_t, w_out[..., 0])
        elif form == BY_COLUMNS:
            out = _one_output_by_columns(a + c[:, None], b_t, w_out[..., 0], activation)
        else:
            out = _one_output_by_units(a + c[:, None], b, w_out[..., 0], activation)
        return out[..., None] + b_out[:, None, None, :]
    return _forward_units_major(terms, activation, form)


def _forward_units_major(terms: Terms, activation: str, form: str) -> Tensor:
    """`reference` with the hidden activations laid out units-major, `(T, H, Q * TH)`, so that
    each layer is a `(T, K, H) @ (T, H, Q * TH)` matmul: the positions are its long output
    axis instead of its contraction's partner, which MKL runs much faster for few hidden
    units and outputs. Returns `(T, TH, Q, P)`, a transposed view. `form`: `forward_form`'s
    (`C_LOOPS` and `UNROLLED` run their own forms)."""
    a, b, c, w_hidden, b_hidden, w_out, b_out = terms
    num_tiles, rows, hidden = a.shape
    if form == C_LOOPS:
        return _relu_loops.relu_layer_forward(a + c[:, None], b, w_out, b_out)
    if form == UNROLLED:
        return _one_layer_unrolled(terms, activation)
    h = activate(_first_layer_units_major(a, b, c), activation).reshape(num_tiles, hidden, -1)
    for layer in range(0 if w_hidden is None else w_hidden.shape[1]):
        z = w_hidden[:, layer].transpose(1, 2) @ h + b_hidden[:, layer, :, None]
        h = activate(z, activation)
    out = w_out.transpose(1, 2) @ h + b_out[..., None]  # (T, P, Q * TH)
    return out.reshape(num_tiles, -1, b.shape[1], rows).permute(0, 3, 2, 1)


def _unrolls(hidden: int, outputs: int) -> bool:
    """Whether compiled code computes a one-layer g-net's outputs as a sum over its units
    written out (`_one_layer_unrolled`) rather than as a matmul: for at most 16 outputs, the
    matmul's rows, where MKL is slow; for at most 32 units, since each is a term of the code.
    With more outputs (row g-nets' 128 and 256) the written-out sum is no faster, hence the
    matmul there. For ReLU in float32 on CPU a C loop runs instead, up to 32 outputs
    (`_loops_layer`), which computes each hidden activation once rather than once per
    output, and so does the backward."""
    return outputs <= 16 and hidden <= 32


def _one_layer_unrolled(terms: Terms, activation: str) -> Tensor:
    """`_forward_units_major` of one hidden layer as one pointwise sum over the units: inductor
    computes each output from the row and column terms in registers, without the hidden
    activations or the matmul's output in memory, and can fuse the tiles' layout after it.

    The sum runs over a spare tile, output or column of zeros (the longest of those axes),
    dropped after: inductor stores the sum, too long a chain to inline into the layout, and,
    compiling a training step as one graph, kept that buffer past its last read to reuse it
    for the backward's tile gradient, which has the same size, across the step's peak. With
    the spare slot the sizes differ, and the buffer is freed after its last read. (The
    one-output forward's sum was left as it is: padded the same way, some compiled peaks fell
    and others rose; `benchmarks/results/design_measurements.md`.)"""
    a, b, c, _, _, w_out, b_out = terms
    row_terms, col_terms = _units_major_terms(a, b, c)  # (T, H, TH), (T, H, Q)
    num_tiles, outputs, cols = a.shape[0], w_out.shape[-1], b.shape[1]
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
    for unit in range(a.shape[-1]):
        h = activate(row_terms[:, unit, None, :] + col_terms[:, unit, :, None], activation)
        out = out + w_out[:, unit, :, None, None] * h[:, None]  # (T, P, Q, TH)
    return out[:num_tiles, :outputs, :cols].permute(0, 3, 2, 1)


def _padded(x: Tensor, axis: int) -> Tensor:
    """`x` with one more slot of zeros at the end of `axis`."""
    return F.pad(x, (0, 0) * (x.dim() - 1 - axis) + (0, 1))


def _first_layer_units_major(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """`first_layer` as `(T, H, Q, TH)`: rows innermost, so that the backward's sums over
    rows and over columns both keep or reduce a long axis (with the columns innermost,
    inductor's sum over the rows of 8 columns ran many times slower)."""
    row_terms, col_terms = _units_major_terms(a, b, c)
    return row_terms[:, :, None, :] + col_terms[..., None]


def _units_major_terms(a: Tensor, b: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """Row terms `a + c` `(T, H, TH)` and column terms `b` `(T, H, Q)`, in buffers of that
    layout: inductor picks a kernel's vector axis by its inputs' layouts, and with these
    read units-innermost it vectorised the backward's sums along the 8 hidden units and
    split each 8-column sum over threads, many times slower than due."""
    return contiguous_buffer((a + c[:, None]).transpose(1, 2)), contiguous_buffer(b.transpose(1, 2))


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
    vector register holds: the hidden units `_vectorised_units` counts reduced as the vector
    axis, the others one at a time."""
    split = _vectorised_units(row_terms)
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
    faster from units-major column terms (`tile_mlp`'s `b_t`): where the columns fill at
    least one vector register (`_one_output_by_columns`)."""
    return columns >= _vector_lanes(dtype, torch.device(device).type)


def _vectorised_units(row_terms: Tensor) -> int:
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
