"""Triton building blocks of a g-net, shared by the forward and the backward kernel.

Every block is a `(BLOCK_I * BLOCK_Q, BLOCK_H)` float32 tile of hidden values for `BLOCK_I`
tile rows x `BLOCK_Q` evaluation columns, row-major (at most the tuned `BLOCK_N` positions:
`generate.kernel.block_sizes`). Hidden units past `H` are
zero-padded: their weights load as zero, so they never reach a real output or gradient.

Kernels import these blocks by name and call them unqualified (`first_layer(...)`, never
`_gnet.first_layer(...)`): under `torch.compile`, inductor rebuilds a user kernel's source from
the `@triton.jit` functions its globals name, and drops any reached through a module, which
failed on an H200 with `NameError: _gnet` (2026-11-28). `test_kernel_sources_are_self_contained`
keeps it so.
"""

import triton
import triton.language as tl

from . import _interpreter  # noqa: F401  (Triton 3.6's interpreter, fixed before a kernel runs)

RELU, GELU, TANH, SILU = range(4)
ACTIVATIONS = {"relu": RELU, "gelu": GELU, "tanh": TANH, "silu": SILU}


@triton.jit
def activate(z, ACTIVATION: tl.constexpr):
    """The activation, as in `gbfunc._spec.activate` (exact erf GELU)."""
    if ACTIVATION == 0:
        return tl.maximum(z, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN kept, as torch
    elif ACTIVATION == 1:
        return 0.5 * z * (1.0 + tl.erf(z * 0.7071067811865476))
    elif ACTIVATION == 2:
        return 1.0 - 2.0 / (1.0 + tl.exp(2.0 * z))  # tanh, saturating cleanly at +-inf
    else:
        return z * tl.sigmoid(z)


@triton.jit
def activate_grad(z, ACTIVATION: tl.constexpr):
    """Derivative of the activation at `z`, as in `gbfunc._spec.activate_grad`."""
    if ACTIVATION == 0:
        return tl.where(z > 0.0, 1.0, 0.0)
    elif ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))
        return cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    elif ACTIVATION == 2:
        t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * z))
        return 1.0 - t * t
    else:
        s = tl.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))


@triton.jit
def first_layer(
    a_ptr,
    b_ptr,
    c_ptr,
    g,
    i,
    q,
    hid,
    TH,
    Q,
    H,
    BLOCK_I: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Separable first layer of tile `g`: `z[i, q] = a[i] + b[q] + c`,
    `(BLOCK_I * BLOCK_Q, BLOCK_H)`."""
    h_ok = hid < H
    a = tl.load(
        a_ptr + (g * TH + i[:, None]) * H + hid[None, :],
        mask=(i[:, None] < TH) & h_ok[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + (g * Q + q[:, None]) * H + hid[None, :],
        mask=(q[:, None] < Q) & h_ok[None, :],
        other=0.0,
    )
    c = tl.load(c_ptr + g * H + hid, mask=h_ok, other=0.0)
    z = (
        a.to(tl.float32)[:, None, :]
        + b.to(tl.float32)[None, :, :]
        + c.to(tl.float32)[None, None, :]
    )
    return tl.reshape(z, (BLOCK_I * BLOCK_Q, BLOCK_H))


@triton.jit
def hidden_weight(wh_ptr, g, layer, hid, H, DEPTH: tl.constexpr):
    """Hidden-to-hidden weight `layer` of tile `g`, `(BLOCK_H, BLOCK_H)` float32."""
    mask = (hid[:, None] < H) & (hid[None, :] < H)
    w = tl.load(
        wh_ptr + ((g * (DEPTH - 1) + layer) * H + hid[:, None]) * H + hid[None, :],
        mask=mask,
        other=0.0,
    )
    return w.to(tl.float32)


@triton.jit
def hidden_layer(h, wh_ptr, bh_ptr, g, layer, hid, H, DEPTH: tl.constexpr, PRECISION: tl.constexpr):
    """Pre-activation of hidden layer `layer + 1` from the activations `h` of layer `layer`."""
    w = hidden_weight(wh_ptr, g, layer, hid, H, DEPTH)
    bias = tl.load(bh_ptr + (g * (DEPTH - 1) + layer) * H + hid, mask=hid < H, other=0.0).to(
        tl.float32
    )
    return tl.dot(h, w, input_precision=PRECISION) + bias[None, :]


@triton.jit
def hidden_stack(
    z,
    wh_ptr,
    bh_ptr,
    g,
    layers,
    hid,
    H,
    DEPTH: tl.constexpr,
    ACTIVATION: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Activations after the first `layers` hidden-to-hidden layers, from first-layer `z`."""
    h = activate(z, ACTIVATION)
    if DEPTH > 1:
        for layer in range(0, layers):
            h = activate(
                hidden_layer(h, wh_ptr, bh_ptr, g, layer, hid, H, DEPTH, PRECISION), ACTIVATION
            )
    return h


@triton.jit
def output_weight(wo_ptr, g, hid, p, H, P, BLOCK_P: tl.constexpr):
    """Output weight of tile `g`: `(BLOCK_H,)` when `P == 1`, else `(BLOCK_H, BLOCK_P)`; float32."""
    if BLOCK_P == 1:
        w = tl.load(wo_ptr + g * H + hid, mask=hid < H, other=0.0)
    else:
        mask = (hid[:, None] < H) & (p[None, :] < P)
        w = tl.load(wo_ptr + (g * H + hid[:, None]) * P + p[None, :], mask=mask, other=0.0)
    return w.to(tl.float32)


@triton.jit
def output_layer(
    h, wo_ptr, bo_ptr, g, hid, p, H, P, BLOCK_P: tl.constexpr, PRECISION: tl.constexpr
):
    """G-net outputs `(BLOCK_I * BLOCK_Q, BLOCK_P)`; one output is a row reduction, not a
    padded dot."""
    w = output_weight(wo_ptr, g, hid, p, H, P, BLOCK_P)
    bias = tl.load(bo_ptr + g * P + p, mask=p < P, other=0.0).to(tl.float32)
    # The compiler, unlike the interpreter, goes on past a `return` inside a constexpr `if`.
    if BLOCK_P == 1:
        y = tl.sum(h * w[None, :], axis=1)[:, None]
    else:
        y = tl.dot(h, w, input_precision=PRECISION)
    return y + bias[None, :]


@triton.jit
def tile_place(place_ptr, scale_ptr, t):
    """Where tile `t` lands (`_placement.Place`): its first element's offset, row stride, valid
    rows and valid flat columns, and its parameter's scale."""
    base = tl.load(place_ptr + t * 4)
    ld = tl.load(place_ptr + t * 4 + 1)
    rows = tl.load(place_ptr + t * 4 + 2)
    cols = tl.load(place_ptr + t * 4 + 3)
    scale = tl.load(scale_ptr + t)
    return base, ld, rows, cols, scale
