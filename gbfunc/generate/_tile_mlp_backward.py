"""The tile MLP's recomputing backward bodies (`generate.torch_ops.tile_mlp`): the gradients of
every term from the output's gradient, the hidden activations recomputed from the small terms
rather than saved. Eagerly, one chunk of tiles at a time; traced, one-layer one-output
g-nets as vectorised reductions over the positions (`_fused_reductions`, or the C loop
`relu_unit_sums`), the others units-major like their forward (or the C loop
`relu_layer_backward`).
"""

import torch
from torch import Tensor

from .._spec import Terms, activate, activate_grad
from ..cpu import _relu_loops
from ._tile_mlp_forward import C_LOOPS, EAGER, _units_major_terms, _vectorised_units


def _first_layer_again(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """`first_layer` for the backward, bitwise equal (the last addition's operands swapped,
    which IEEE addition ignores) but not the same traced op. A graph that holds forward and
    backward together (AOTAutograd's) would otherwise merge the two as one common
    subexpression and keep the forward's `(T, TH, Q, H)` alive for the backward, instead of
    recomputing it there from the small terms."""
    return b[:, None, :, :] + (a + c[:, None])[:, :, None, :]


def _backward_recompute(grad: Tensor, terms: Terms, activation: str, form: str = EAGER) -> Terms:
    """Gradients of `reference` w.r.t. every term (`terms.b_out` is not read), for the
    forward's `form` (`forward_form`): eagerly, chunk by chunk; traced, the fused
    reductions, or the C loops where the forward ran them."""
    a, b, c, _, _, w_out, _ = terms
    if not terms.one_reduction:
        return _backward_units_major(grad, terms, activation, form)
    if form != EAGER:
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


def _backward_units_major(grad: Tensor, terms: Terms, activation: str, form: str) -> Terms:
    """`_backward_recompute` of g-nets with hidden layers or several outputs, the hidden
    activations recomputed units-major (`_forward_units_major`): every matmul has the
    positions as its long axis."""
    a, b, c, w_hidden, b_hidden, w_out, _ = terms
    if form == C_LOOPS:
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
