"""The `torch` path's bodies of the tile MLP: its forward without saving the hidden
activations (`forward_no_save`) and the backward that recomputes them (`backward_recompute`),
in each form (`_traced_forms.FORMS`): eagerly one fused reduction (one layer, one output) or
units-major matmuls, which the traced `units-major` form runs too; the other traced forms'
bodies are in `_traced_forms`, and `plain-autograd` is the specification's `reference`.
`torch_ops.tile_mlp` and the `compiled-mlp` path's compiled bodies run them.
"""

import torch
from torch import Tensor

from .._realised import contiguous_buffer
from .._spec import Terms, activate, activate_grad, first_layer, reference
from . import _traced_forms as traced_forms
from ._traced_forms import C_LOOPS, EAGER, PLAIN, UNROLLED


def forward_no_save(
    terms: Terms, activation: str, b_t: Tensor | None = None, form: str = EAGER
) -> Tensor:
    """`reference` in `form` (`_traced_forms.forward_form`'s; `b_t` must fit it): eagerly one
    reduction (one layer, one output) or units-major matmuls, which the traced `units-major`
    runs too (`PLAIN`: `reference` itself); the other traced forms' bodies are in
    `_traced_forms`."""
    if form == PLAIN:
        return reference(terms, activation)
    a, b, c, _, _, w_out, b_out = terms
    if terms.one_reduction:
        if form == EAGER:
            h = activate(first_layer(a, b, c), activation)
            out = (h * w_out[:, None, None, :, 0]).sum(-1)
        else:
            out = traced_forms.one_output(a + c[:, None], b, b_t, w_out[..., 0], activation, form)
        return out[..., None] + b_out[:, None, None, :]
    if form == C_LOOPS:
        return traced_forms.relu_layer(terms)
    if form == UNROLLED:
        row_terms, col_terms = _units_major_terms(a, b, c)
        return traced_forms.one_layer_unrolled(row_terms, col_terms, w_out, b_out, activation)
    return _forward_units_major(terms, activation)


def _forward_units_major(terms: Terms, activation: str) -> Tensor:
    """`reference` with the hidden activations laid out units-major, `(T, H, Q * TH)`, so that
    each layer is a `(T, K, H) @ (T, H, Q * TH)` matmul: the positions are its long output
    axis instead of its contraction's partner, which MKL runs much faster for few hidden
    units and outputs. Returns `(T, TH, Q, P)`, a transposed view."""
    a, b, c, w_hidden, b_hidden, w_out, b_out = terms
    num_tiles, rows, hidden = a.shape
    h = activate(_first_layer_units_major(a, b, c), activation).reshape(num_tiles, hidden, -1)
    for layer in range(0 if w_hidden is None else w_hidden.shape[1]):
        z = w_hidden[:, layer].transpose(1, 2) @ h + b_hidden[:, layer, :, None]
        h = activate(z, activation)
    out = w_out.transpose(1, 2) @ h + b_out[..., None]  # (T, P, Q * TH)
    return out.reshape(num_tiles, -1, b.shape[1], rows).permute(0, 3, 2, 1)


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


def _first_layer_again(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """`first_layer` for the backward, bitwise equal (the last addition's operands swapped,
    which IEEE addition ignores) but not the same traced op. A graph that holds forward and
    backward together (AOTAutograd's) would otherwise merge the two as one common
    subexpression and keep the forward's `(T, TH, Q, H)` alive for the backward, instead of
    recomputing it there from the small terms."""
    return b[:, None, :, :] + (a + c[:, None])[:, :, None, :]


def backward_recompute(grad: Tensor, terms: Terms, activation: str, form: str = EAGER) -> Terms:
    """Gradients of `reference` w.r.t. every term (`terms.b_out` is not read), for the
    forward's `form` (`_traced_forms.forward_form`): eagerly, chunk by chunk; traced, the fused
    reductions, or the C loops where the forward ran them (`_traced_forms`); units-major
    matmuls for the other forms."""
    if terms.one_reduction and form != EAGER:
        return traced_forms.one_output_backward(grad, terms, activation)
    if form == C_LOOPS:
        return traced_forms.relu_layer_backward(grad, terms)
    if not terms.one_reduction:
        return _backward_units_major(grad, terms, activation)
    a, b, c, _, _, w_out, _ = terms
    z = _first_layer_again(a, b, c)  # (T, TH, Q, H), one chunk at a time in eager mode
    num_tiles, hidden = a.shape[0], a.shape[-1]
    h = activate(z, activation).reshape(num_tiles, -1, hidden)  # (T, TH*Q, H)
    g_w_out = h.transpose(1, 2) @ grad.reshape(num_tiles, -1, 1)  # (T, H, 1)
    del h
    # `grad` first out of place: under vmap (`jacrev`) it may be batched where `z` is not.
    g_z = (activate_grad(z, activation) * grad).mul_(w_out[:, None, None, :, 0])
    g_a = g_z.sum(2)
    g_b = g_z.sum(1)
    return Terms.one_layer_gradients(g_a, g_b, g_w_out, grad)


def _backward_units_major(grad: Tensor, terms: Terms, activation: str) -> Terms:
    """`backward_recompute` of g-nets with hidden layers or several outputs, the hidden
    activations recomputed units-major (`_forward_units_major`): every matmul has the
    positions as its long axis."""
    a, b, c, w_hidden, b_hidden, w_out, _ = terms
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
    return row_terms[:, :, None, :] + after(col_terms, grad)[..., None]


def after(x: Tensor, anchor: Tensor) -> Tensor:
    """`x` plus an exact zero computed from `anchor` (never NaN; a float 0.0, which inductor
    does not fold away): compiled code computes `x` and its readers once `anchor` exists."""
    return x + anchor.reshape(-1)[:1].isnan().to(x.dtype) * 0.0
