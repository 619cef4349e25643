"""Evaluate a stack of g-nets on every position of their tiles, without storing activations.

The first layer is separable: for tile `t`, row `i` and evaluation column `q`,
`z[t, i, q] = a[t, i] + b[t, q] + c[t]` with `a = row_code @ w_in[:R]`, `b = col_code @ w_in[R:]`.
A tile therefore costs two tiny matmuls and ~3H FLOPs per weight, and nothing of size
`(T, TH, Q, H)` has to be saved: the backward recomputes it (FlashAttention-style). With
several outputs or hidden layers the activations are laid out units-major, `(T, H, Q * TH)`,
so that every matmul has the tile's positions as its long axis (`_forward_units_major`).

`reference` is the specification (plain autograd). `tile_mlp` is the same function as an
`autograd.Function` whose backward recomputes; it composes with `grad`, `vmap` and
`torch.compile(fullgraph=True)`. Called eagerly with `compiled=True`, its forward and backward
bodies run as code compiled once per signature (shapes, dtypes, device, activation), which
is what makes eager training with large genomes fast; under `torch.func` transforms and
inside an outer `torch.compile` they run as plain torch code. The recomputing backward runs
there too, under `loss.backward()` and under `torch.func.grad` alike (checked with a backward
that returns zeros): dynamo drops a Function's backward under `grad` only where the Function
is applied to the transformed function's own argument (pytorch/pytorch#193279, torch 2.13),
and the tile MLP's terms are always computed from the leaves first.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ._compiled import CompiledCache
from ._realised import contiguous_buffer
from ._spec import Terms, activate, activate_grad, first_layer, plain_eager, tile_rows
from .cpu import _relu_loops

# Eager evaluation is chunked over tiles so that the transient (chunk, TH, Q, H) tensor stays
# cache-sized; graphs traced by an outer compile are left whole for inductor to fuse.
CHUNK_ELEMENTS = 1 << 18
# Compiled bodies called eagerly run whole where inductor fuses the MLP into reductions (one
# hidden layer, one output); elsewhere the hidden activations are matmul operands, which it
# materialises, so they run in chunks of this many (tile, row, column, hidden) elements.
COMPILED_CHUNK_ELEMENTS = 1 << 20


def _first_layer_again(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """`first_layer` for the backward, bitwise equal (the last addition's operands swapped,
    which IEEE addition ignores) but not the same traced op. A graph that holds forward and
    backward together (AOTAutograd's) would otherwise merge the two as one common
    subexpression and keep the forward's `(T, TH, Q, H)` alive for the backward, instead of
    recomputing it there from the small terms."""
    return b[:, None, :, :] + (a + c[:, None])[:, :, None, :]


def _forward_no_save(terms: Terms, activation: str, b_t: Tensor | None = None) -> Tensor:
    a, b, c, _, _, w_out, b_out = terms
    if terms.one_reduction:
        # One hidden layer, one output: a single fused reduction over H.
        if not torch.compiler.is_compiling():
            h = activate(first_layer(a, b, c), activation)
            out = (h * w_out[:, None, None, :, 0]).sum(-1)
        elif b_t is not None and _one_output_in_c(terms, activation):
            out = _relu_loops.relu_one_output(a + c[:, None], b_t, w_out[..., 0])
        elif b_t is not None:
            out = _one_output_by_columns(a + c[:, None], b_t, w_out[..., 0], activation)
        else:
            out = _one_output_by_units(a + c[:, None], b, w_out[..., 0], activation)
        return out[..., None] + b_out[:, None, None, :]
    return _forward_units_major(terms, activation)


def _forward_units_major(terms: Terms, activation: str) -> Tensor:
    """`reference` with the hidden activations laid out units-major, `(T, H, Q * TH)`, so that
    each layer is a `(T, K, H) @ (T, H, Q * TH)` matmul: the positions are its long output
    axis instead of its contraction's partner, which MKL runs much faster for few hidden
    units and outputs. Returns `(T, TH, Q, P)`, a transposed view."""
    a, b, c, w_hidden, b_hidden, w_out, b_out = terms
    num_tiles, rows, hidden = a.shape
    if _in_c(terms, activation):
        return _relu_loops.relu_layer_forward(a + c[:, None], b, w_out, b_out)
    if w_hidden is None and torch.compiler.is_compiling() and _unrolls(hidden, w_out.shape[-1]):
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
    matmul there. For ReLU in float32 on CPU the sum runs as a C loop instead
    (`_relu_loops.relu_layer_forward`), which computes each hidden activation once rather
    than once per output, and so does the backward (`_in_c`)."""
    return outputs <= 16 and hidden <= 32


def _in_c(terms: Terms, activation: str) -> bool:
    """Whether traced code runs a one-layer ReLU g-net with few outputs (`_unrolls`) through
    the C loops of `_relu_loops`, forward and backward (CPU, float32: `layer_usable`)."""
    hidden, outputs = terms.a.shape[-1], terms.w_out.shape[-1]
    return (
        terms.w_hidden is None
        and activation == "relu"
        and torch.compiler.is_compiling()
        and not torch.compiler.is_exporting()
        and _unrolls(hidden, outputs)
        and _relu_loops.layer_usable(hidden, outputs, terms.a.dtype, terms.a.device.type)
    )


def _one_output_in_c(terms: Terms, activation: str) -> bool:
    """Whether traced code runs a one-output ReLU g-net's forward through the C loop
    `_relu_loops.relu_one_output` (CPU, float32: `one_output_usable`) rather than inductor's
    sum (`_one_output_by_columns`): the loop holds four rows' sums in registers and loads each
    unit's column terms once for the four. Inductor fused the tiles' layout into its own
    sum; the layout now reads the loop's output."""
    a = terms.a
    return (
        activation == "relu"
        and not torch.compiler.is_exporting()  # exported graphs hold standard ops only
        and _relu_loops.one_output_usable(a.shape[-1], a.dtype, a.device.type)
    )


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


def _first_layer_units_major_again(a: Tensor, b: Tensor, c: Tensor, grad: Tensor) -> Tensor:
    """`_first_layer_units_major` for the backward, bitwise equal up to the sign of zeros,
    computed after `grad` exists. Traced with the forward as one graph (`torch.func.grad`
    under `torch.compile`), inductor otherwise fuses this recomputation, which reads only
    forward inputs, into a forward kernel that reads the same terms, and keeps its
    `(T, H, Q * TH)` result until the backward, above the plain model's peak
    (`benchmarks/results/design_measurements.md`)."""
    row_terms, col_terms = _units_major_terms(a, b, c)
    return row_terms[:, :, None, :] + _after(col_terms, grad)[..., None]


def _after(x: Tensor, anchor: Tensor) -> Tensor:
    """`x` plus an exact zero computed from `anchor`: a data dependency, so that compiled
    code computes `x` and what reads it only once `anchor` exists. The zero is 0 or 1 times
    0.0, never NaN whatever `anchor` holds; a float 0.0, since inductor folds products with
    the integer 0 (and the dependency with them)."""
    return x + anchor.reshape(-1)[:1].isnan().to(x.dtype) * 0.0


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


def _backward_recompute(grad: Tensor, terms: Terms, activation: str) -> Terms:
    """Gradients of `reference` w.r.t. every term (`terms.b_out` is not read)."""
    a, b, c, _, _, w_out, _ = terms
    if not terms.one_reduction:
        return _backward_units_major(grad, terms, activation)
    if torch.compiler.is_compiling():
        g_a, g_b, g_w_out = _fused_reductions(grad[..., 0], a, b, c, w_out[..., 0], activation)
        return Terms(g_a, g_b, g_a.sum(1), None, None, g_w_out[..., None], grad.sum((1, 2)))
    z = _first_layer_again(a, b, c)  # (T, TH, Q, H), one chunk at a time in eager mode
    num_tiles, hidden = a.shape[0], a.shape[-1]
    h = activate(z, activation).reshape(num_tiles, -1, hidden)  # (T, TH*Q, H)
    g_w_out = h.transpose(1, 2) @ grad.reshape(num_tiles, -1, 1)  # (T, H, 1)
    del h
    g_z = activate_grad(z, activation).mul_(grad).mul_(w_out[:, None, None, :, 0])
    g_a = g_z.sum(2)
    g_b = g_z.sum(1)
    return Terms(g_a, g_b, g_a.sum(1), None, None, g_w_out, grad.sum((1, 2)))


def _backward_units_major(grad: Tensor, terms: Terms, activation: str) -> Terms:
    """`_backward_recompute` of g-nets with hidden layers or several outputs, the hidden
    activations recomputed units-major (`_forward_units_major`): every matmul has the
    positions as its long axis."""
    a, b, c, w_hidden, b_hidden, w_out, _ = terms
    if _in_c(terms, activation):
        g_a, g_b, g_w_out = _relu_loops.relu_layer_backward(grad, a + c[:, None], b, w_out)
        return Terms(g_a, g_b, g_a.sum(1), None, None, g_w_out, grad.sum((1, 2)))
    num_tiles, rows, hidden = a.shape
    cols = b.shape[1]
    g_out = grad.permute(0, 3, 2, 1).reshape(num_tiles, grad.shape[-1], -1)  # (T, P, Q*TH)
    zs = [_first_layer_units_major_again(a, b, c, grad).reshape(num_tiles, hidden, -1)]
    for layer in range(0 if w_hidden is None else w_hidden.shape[1]):
        h = activate(zs[-1], activation)
        zs.append(w_hidden[:, layer].transpose(1, 2) @ h + b_hidden[:, layer, :, None])
    g_w_out = activate(zs[-1], activation) @ g_out.transpose(1, 2)  # (T, H, P)
    g_h = w_out @ g_out  # (T, H, Q*TH)
    g_ws, g_bs = [], []
    for layer in range(len(zs) - 1, 0, -1):
        g_z = g_h * activate_grad(zs[layer], activation)
        g_ws.append(activate(zs[layer - 1], activation) @ g_z.transpose(1, 2))
        g_bs.append(g_z.sum(-1))
        g_h = w_hidden[:, layer - 1] @ g_z
    g_z = (g_h * activate_grad(zs[0], activation)).reshape(num_tiles, hidden, cols, rows)
    g_w_hidden = torch.stack(g_ws[::-1], 1) if g_ws else None
    g_b_hidden = torch.stack(g_bs[::-1], 1) if g_bs else None
    g_a = g_z.sum(2)  # (T, H, TH)
    g_b = g_z.sum(-1)  # (T, H, Q)
    g_c = g_a.sum(-1)
    return Terms(
        g_a.transpose(1, 2),
        g_b.transpose(1, 2),
        g_c,
        g_w_hidden,
        g_b_hidden,
        g_w_out,
        g_out.sum(-1),
    )


def _fused_reductions(g: Tensor, a: Tensor, b: Tensor, c: Tensor, w: Tensor, activation: str):
    """dA, dB and dw of the one-layer, one-output g-net as reductions for inductor.

    Each is written with its reduced axis innermost, so inductor emits one vectorised
    reduction loop per gradient that recomputes the pre-activation in registers instead of
    materialising `(T, TH, Q, H)` (as it does for the shared-`z` form, many times slower).
    Hidden units that fill half a vector register or less go one at a time
    (`_vectorised_units`). ReLU's on CPU, in float32, take one pass in C instead where
    `_relu_loops.sums_usable`.
    Shapes: g `(T, TH, Q)`, a `(T, TH, H)`, b `(T, Q, H)`, c and w `(T, H)`.
    """
    row_terms = a + c[:, None]  # (T, TH, H)
    if activation == "relu" and _relu_loops.sums_usable(a.shape[-1], g.dtype, g.device.type):
        rows, cols = _relu_loops.relu_unit_sums(g, -row_terms, b)  # one pass, in C
        g_w = _relu_weight_gradient(row_terms, b, rows, cols)
        return rows * w[:, None, :], cols * w[:, None, :], g_w
    g_t = g.transpose(1, 2).contiguous()  # (T, Q, TH): unit-stride innermost reads
    split = _vectorised_units(row_terms)
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


def tile_chunks(
    num_tiles: int, per_tile: int, budget: int = CHUNK_ELEMENTS
) -> list[tuple[int, int]]:
    """Balanced consecutive tile ranges of at most `budget` elements at `per_tile` each (at
    least one tile); one range while traced by an outer compile."""
    if torch.compiler.is_compiling():
        return [(0, num_tiles)]
    count = max(1, math.ceil(num_tiles / max(1, budget // max(1, per_tile))))
    size = max(1, math.ceil(num_tiles / count))  # balanced: at most two sizes, often one
    return [(s, min(num_tiles, s + size)) for s in range(0, num_tiles, size)]


def _compiled_chunks(terms: Terms) -> list[tuple[int, int]]:
    """The tile ranges that compiled bodies run on: the whole stack where inductor fuses it."""
    num_tiles, rows, hidden = terms.a.shape
    if terms.one_reduction:
        return [(0, num_tiles)]
    return tile_chunks(num_tiles, rows * terms.b.shape[1] * hidden, COMPILED_CHUNK_ELEMENTS)


def _joined(parts: list) -> object:
    """One tensor, or one tuple of tensors (None kept), from the results of tile chunks."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], Tensor):
        return torch.cat(parts)
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts, strict=True))


_BODIES = CompiledCache("the tile MLP")


def _compiled(body: Callable, *args: object) -> object | None:
    """`body(*args)` through code compiled once per signature of the arguments (shapes,
    dtypes, devices, activation); None where that signature cannot be compiled."""
    signature = ((tuple(a.shape), a.dtype, a.device) if isinstance(a, Tensor) else a for a in args)
    return _BODIES.call((body.__name__, *signature), body, *args)


def _forward_body(*inputs) -> Tensor:
    *flat, b_t, activation = inputs
    return _forward_no_save(Terms(*flat), activation, b_t)


def _backward_body(grad: Tensor, *inputs) -> tuple:
    *saved, activation = inputs
    return tuple(_backward_recompute(grad, Terms(*saved, None), activation))


def _backward_per_range(terms: Terms) -> bool:
    """Whether traced code runs the backward once per tile range (`tile_mlp`'s `spans`)
    rather than once on their concatenation: except for one-layer, one-output g-nets whose
    hidden units are reduced one at a time (`_vectorised_units`), three reductions per unit,
    which per range multiplied the compiled graph and its compile time."""
    return not terms.one_reduction or _vectorised_units(terms.a) == terms.a.shape[-1]


class _TileMLP(torch.autograd.Function):
    """`reference` with a recomputing backward; its arguments are a flat `Terms`, `b_t`
    (see `tile_mlp`), the activation, whether to run compiled bodies and the tile ranges
    to return apart, or None (`autograd.Function` takes tensors one by one)."""

    @staticmethod
    def forward(a, b, c, w_hidden, b_hidden, w_out, b_out, b_t, activation, compiled, spans):
        # Named, not `*inputs`: dynamo, inlining a Function none of whose inputs requires grad
        # (under vmap, with frozen g-nets), passes `ctx` first unless the arity matches.
        terms = Terms(a, b, c, w_hidden, b_hidden, w_out, b_out)
        out = None
        if compiled and plain_eager():
            # Detached: autograd records this Function, not what runs inside (no_grad here).
            detached = Terms(*(None if x is None else x.detach() for x in terms))
            b_t = None if b_t is None else b_t.detach()
            outs = [
                _compiled(
                    _forward_body, *detached.tiles(lo, hi), tile_rows(b_t, lo, hi), activation
                )
                for lo, hi in _compiled_chunks(detached)
            ]
            if all(part is not None for part in outs):
                out = _joined(outs)
        if out is None:
            num_tiles, rows, hidden = terms.a.shape
            parts = tile_chunks(num_tiles, rows * terms.b.shape[1] * hidden)
            out = _joined(
                [
                    _forward_no_save(terms.tiles(lo, hi), activation, tile_rows(b_t, lo, hi))
                    for lo, hi in parts
                ]
            )
        return out if spans is None else tuple(out[lo:hi] for lo, hi in spans)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *flat, _, activation, compiled, spans = inputs
        ctx.save_for_backward(*flat[:-1])  # b_out is not needed, nor b_t (b holds its values)
        ctx.activation, ctx.compiled, ctx.spans = activation, compiled, spans

    @staticmethod
    def backward(ctx, *grads):
        terms = Terms(*ctx.saved_tensors, None)
        if ctx.spans is not None and torch.compiler.is_compiling():
            if _backward_per_range(terms):
                # Each range's gradient goes through the backward on its own: the whole
                # stack's gradient is never assembled (see `tile_mlp`).
                results = [
                    tuple(_backward_recompute(g.contiguous(), terms.tiles(lo, hi), ctx.activation))
                    for g, (lo, hi) in zip(grads, ctx.spans, strict=True)
                ]
                return (*_joined(results), None, None, None, None)
            # Assembled once every range's gradient exists, not from the first one on.
            last = torch.cat([g.reshape(-1)[:1] for g in grads])
            grads = tuple(_after(g, last) for g in grads)
        grad = _joined(list(grads)).contiguous()
        if ctx.compiled and plain_eager() and not torch.is_grad_enabled():  # not create_graph
            saved = Terms(*(None if x is None else x.detach() for x in terms))
            results = [
                _compiled(_backward_body, grad[lo:hi], *saved.tiles(lo, hi)[:-1], ctx.activation)
                for lo, hi in _compiled_chunks(saved)
            ]
            if all(result is not None for result in results):
                return (*_joined(results), None, None, None, None)
        a, b = terms.a, terms.b
        parts = tile_chunks(a.shape[0], a.shape[1] * b.shape[1] * a.shape[2])
        results = [
            tuple(_backward_recompute(grad[lo:hi], terms.tiles(lo, hi), ctx.activation))
            for lo, hi in parts
        ]
        return (*_joined(results), None, None, None, None)

    @staticmethod
    def vmap(info, in_dims, *inputs):
        # Fold the vmapped genomes into the tile axis: K stacks of T tiles are one stack of K*T.
        size = info.batch_size

        def fold(x: Tensor | None, dim: int | None) -> Tensor | None:
            if x is None:
                return None
            x = x.unsqueeze(0).expand(size, *x.shape) if dim is None else x.movedim(dim, 0)
            return x.reshape(size * x.shape[1], *x.shape[2:])

        *flat, activation, compiled, spans = inputs
        args = [fold(x, d) for x, d in zip(flat, in_dims, strict=False)]
        out = _TileMLP.apply(*args, activation, compiled, None)
        out = out.reshape(size, -1, *out.shape[1:])
        if spans is None:
            return out, 0
        return tuple(out[:, lo:hi] for lo, hi in spans), (0,) * len(spans)


def tile_mlp(
    terms: Terms,
    activation: str,
    compiled: bool = False,
    b_t: Tensor | None = None,
    spans: tuple[tuple[int, int], ...] | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """`reference`, with a backward that recomputes instead of saving `(T, TH, Q, H)`.

    With `compiled`, plain eager calls run the forward and the backward as code compiled
    once per signature (the first call of a signature compiles: seconds). `b_t`, optional,
    is `terms.b` laid out units-major, `(T, H, Q)`, computed apart (from the same leaves):
    compiled code's one-layer, one-output forward reads it instead of `b` (pass it where
    `reads_units_major_columns`). Its gradient is returned through `b` (None for `b_t`), so
    the two must hold the same values.

    `spans`, optional: consecutive tile ranges `(start, stop)` covering the stack; the output
    is returned cut into them, one tensor each. Traced, the backward then runs once per range
    on that range's gradient, so the whole stack's gradient is never assembled: a concatenation
    of gradients arriving one weight at a time, which inductor allocates whole at the first,
    at the start of a training step's backward, where the model's activations peak.
    """
    return _TileMLP.apply(*terms, b_t, activation, compiled, spans)
