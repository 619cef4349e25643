"""Triton backward of the fused forward: recompute the g-nets, reduce into their gradients.

Grid: `(B * T, S)`. Program `(g, s)` owns rows blocks `s, s + S, ...` of tile `g`. For each
`BLOCK_I x BLOCK_Q` block it recomputes the hidden activations from `a`, `b`, `c` (nothing of
size `(T, TH, Q, H)` is ever stored), gathers the weight gradient through the same
placement as the forward, and back-propagates layer by layer; a deeper layer's activations are
recomputed from the first layer again rather than kept (depth is small, registers are not).

Reductions are deterministic: `grad a` rows are complete within a program; everything summed
over rows goes to a per-split partial `(S, B * T, ...)` that the program alone updates, and the
launcher adds the S partials. S > 1 only when there are too few tiles to fill the device.
"""

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from gbfunc._plan import Generated, Stack
from gbfunc._spec import Terms

from .. import _checks, _runtime
from .._checks import Launch
from .._gnet import (
    activate_grad,
    first_layer,
    hidden_layer,
    hidden_stack,
    hidden_weight,
    output_weight,
    tile_place,
)
from ..generate.kernel import meta_parameters, sizes, tile_blocks


@triton.jit
def _accumulate(ptr, value, mask):
    """`*ptr += value` on memory this program alone updates; the barrier orders the next read."""
    tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + value, mask=mask)
    tl.debug_barrier()


@triton.jit
def _column_partial(gb_ptr, part, q, hid, Q, H):
    """Pointers and mask of partial `part`'s `grad b` at columns `q`, `(BLOCK_Q, BLOCK_H)`."""
    mask = (q[:, None] < Q) & (hid[None, :] < H)
    return gb_ptr + (part * Q + q[:, None]) * H + hid[None, :], mask


@triton.jit
def _hidden_partials(gwh_ptr, gbh_ptr, slot, hid, H):
    """Pointers and masks of slot `slot`'s `grad w_hidden` `(BLOCK_H, BLOCK_H)` and
    `grad b_hidden` `(BLOCK_H,)`; a slot is one hidden layer of one partial."""
    h_ok = hid < H
    w = gwh_ptr + (slot * H + hid[:, None]) * H + hid[None, :]
    return w, h_ok[:, None] & h_ok[None, :], gbh_ptr + slot * H + hid, h_ok


@triton.jit
def _zero_partials(
    gb_ptr,
    gwh_ptr,
    gbh_ptr,
    part,
    hid,
    Q,
    H,
    DEPTH: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Zero this program's slots of the partials it accumulates into.

    The kernel starts its own sums rather than relying on zeroed buffers: the autotuner runs
    it repeatedly on the same buffers, and its `reset_to_zero` fails on the `None` hidden-layer
    partials of a one-layer g-net (and a custom `pre_hook` would not compile under dynamo).
    """
    for col_block in range(0, tl.cdiv(Q, BLOCK_Q)):
        q = col_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
        b, b_ok = _column_partial(gb_ptr, part, q, hid, Q, H)
        tl.store(b, tl.zeros((BLOCK_Q, BLOCK_H), dtype=tl.float32), mask=b_ok)
    if DEPTH > 1:
        for layer in range(0, DEPTH - 1):
            w, w_ok, bias, bias_ok = _hidden_partials(
                gwh_ptr, gbh_ptr, part * (DEPTH - 1) + layer, hid, H
            )
            tl.store(w, tl.zeros((BLOCK_H, BLOCK_H), dtype=tl.float32), mask=w_ok)
            tl.store(bias, tl.zeros((BLOCK_H,), dtype=tl.float32), mask=bias_ok)
    tl.debug_barrier()  # the first `_accumulate` reads what other threads zeroed


@triton.autotune(
    configs=_runtime.configs((32, 64, 128), (4, 8)),
    key=["TH", "Q", "H", "P", "DEPTH"],
)
@tile_blocks
@triton.jit
def _generate_backward_kernel(
    # Incoming gradient of the weights (B, NUMEL).
    grad_ptr,
    # G-net terms as in the forward (genome-major tile axis B * T); b_out is not needed.
    a_ptr,
    b_ptr,
    c_ptr,
    wh_ptr,
    bh_ptr,
    wo_ptr,
    # Placement (T, 4) int64 and scale (T,) float32, as in the forward.
    place_ptr,
    scale_ptr,
    # Gradients, float32: ga (B*T, TH, H); per-split partials gb (S, B*T, Q, H),
    # gwh (S, B*T, DEPTH-1, H, H), gbh (S, B*T, DEPTH-1, H), gwo (S, B*T, H, P), gbo (S, B*T, P).
    ga_ptr,
    gb_ptr,
    gwh_ptr,
    gbh_ptr,
    gwo_ptr,
    gbo_ptr,
    # Sizes.
    NUM_TILES,
    NUMEL,
    TH,
    Q,
    H,
    # Meta-parameters.
    P: tl.constexpr,
    DEPTH: tl.constexpr,
    ACTIVATION: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    g = tl.program_id(0).to(tl.int64)
    t = g % NUM_TILES
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    part = split * tl.num_programs(0) + g  # this program's slot in the partials
    hid = tl.arange(0, BLOCK_H)
    p = tl.arange(0, BLOCK_P)
    h_ok = hid < H
    base, ld, rows, cols, scale = tile_place(place_ptr, scale_ptr, t)
    w_out = output_weight(wo_ptr, g, hid, p, H, P, BLOCK_P)
    if BLOCK_P == 1:
        g_w_out = tl.zeros((BLOCK_H,), dtype=tl.float32)
    else:
        g_w_out = tl.zeros((BLOCK_H, BLOCK_P), dtype=tl.float32)
    g_b_out = tl.zeros((BLOCK_P,), dtype=tl.float32)
    _zero_partials(gb_ptr, gwh_ptr, gbh_ptr, part, hid, Q, H, DEPTH, BLOCK_Q, BLOCK_H)

    for row_block in range(split, tl.cdiv(TH, BLOCK_I), splits):
        i = row_block * BLOCK_I + tl.arange(0, BLOCK_I)
        g_a = tl.zeros((BLOCK_I, BLOCK_H), dtype=tl.float32)
        for col_block in range(0, tl.cdiv(Q, BLOCK_Q)):
            q = col_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
            # The weight gradient at this block's outputs, through the forward's cut and scale.
            i3, q3, p3 = i[:, None, None], q[None, :, None], p[None, None, :]
            j = q3 * P + p3
            g_y = tl.load(
                grad_ptr + (g // NUM_TILES) * NUMEL + base + i3 * ld + j,
                mask=(i3 < rows) & (p3 < P) & (j < cols),
                other=0.0,
            )
            g_y = tl.reshape(g_y.to(tl.float32) * scale, (BLOCK_I * BLOCK_Q, BLOCK_P))

            z = first_layer(a_ptr, b_ptr, c_ptr, g, i, q, hid, TH, Q, H, BLOCK_I, BLOCK_Q, BLOCK_H)
            h = hidden_stack(z, wh_ptr, bh_ptr, g, DEPTH - 1, hid, H, DEPTH, ACTIVATION, PRECISION)
            g_b_out += tl.sum(g_y, axis=0)
            if BLOCK_P == 1:
                g_w_out += tl.sum(h * g_y, axis=0)
                g_h = g_y * w_out[None, :]
            else:
                g_w_out += tl.dot(tl.trans(h), g_y, input_precision=PRECISION)
                g_h = tl.dot(g_y, tl.trans(w_out), input_precision=PRECISION)
            if DEPTH > 1:
                for step in range(0, DEPTH - 1):
                    layer = (
                        DEPTH - 2 - step
                    )  # hidden weight `layer` maps activations layer -> layer + 1
                    h_in = hidden_stack(
                        z, wh_ptr, bh_ptr, g, layer, hid, H, DEPTH, ACTIVATION, PRECISION
                    )
                    g_z = g_h * activate_grad(
                        hidden_layer(h_in, wh_ptr, bh_ptr, g, layer, hid, H, DEPTH, PRECISION),
                        ACTIVATION,
                    )
                    w_slot, w_ok, bias_slot, bias_ok = _hidden_partials(
                        gwh_ptr, gbh_ptr, part * (DEPTH - 1) + layer, hid, H
                    )
                    g_w = tl.dot(tl.trans(h_in), g_z, input_precision=PRECISION)
                    _accumulate(w_slot, g_w, w_ok)
                    _accumulate(bias_slot, tl.sum(g_z, axis=0), bias_ok)
                    w = hidden_weight(wh_ptr, g, layer, hid, H, DEPTH)
                    g_h = tl.dot(g_z, tl.trans(w), input_precision=PRECISION)
            g_z = tl.reshape(g_h * activate_grad(z, ACTIVATION), (BLOCK_I, BLOCK_Q, BLOCK_H))
            g_a += tl.sum(g_z, axis=1)
            b_slot, b_ok = _column_partial(gb_ptr, part, q, hid, Q, H)
            _accumulate(b_slot, tl.sum(g_z, axis=0), b_ok)
        tl.store(
            ga_ptr + (g * TH + i[:, None]) * H + hid[None, :],
            g_a,
            mask=(i[:, None] < TH) & h_ok[None, :],
        )

    tl.store(gbo_ptr + part * P + p, g_b_out, mask=p < P)
    if BLOCK_P == 1:
        tl.store(gwo_ptr + part * H + hid, g_w_out, mask=h_ok)
    else:
        mask = h_ok[:, None] & (p[None, :] < P)
        tl.store(gwo_ptr + (part * H + hid[:, None]) * P + p[None, :], g_w_out, mask=mask)


def splits_for(device: torch.device, genome_tiles: int, rows: int) -> int:
    """Row splits per tile: enough programs to fill the device, at least 4 rows per split."""
    return max(
        1, min(triton.cdiv(_runtime.target_programs(device), genome_tiles), triton.cdiv(rows, 4))
    )


def generate_backward(
    grad: Tensor,
    terms: Terms,
    stack: Stack,
    params: tuple[Generated, ...],
    run: Callable | None = None,
) -> Terms:
    """Launch `_generate_backward_kernel`; same contract as `reference.generate_backward`.

    `run`: what launches it on the checked inputs, `launch`'s arguments but `wrap` (default:
    `launch` itself; `_op.py` passes its op's).
    """
    a, b, c, w_hidden, b_hidden, w_out, _ = terms
    tensors = {"a": a, "grad": grad, "b": b, "c": c, "w_out": w_out}
    tensors |= {"w_hidden": w_hidden, "b_hidden": b_hidden}
    checked = _checks.check_launch("kernels.generate_backward", stack, params, tensors)
    return (run or launch)(grad, terms, checked)


def launch(
    grad: Tensor, terms: Terms, checked: Launch, wrap: Callable = lambda kernel: kernel
) -> Terms:
    """`_generate_backward_kernel` on checked inputs (`checked`: `_checks.check_launch`'s),
    the stack's sizes read from the tensors' shapes: what the op in `_op.py` traces, with
    `wrap=torch.library.wrap_triton`. `terms.b_out` is not read (`None` is fine)."""
    places, scales, numel, outputs, activation = checked
    size = sizes(terms)
    a, hidden, depth = terms.a, size.hidden, size.depth
    genome_tiles = math.prod(size.batch) * size.num_tiles
    splits = splits_for(a.device, genome_tiles, size.th)
    # float32 accumulators; sums over rows are per-split partials, zeroed by the kernel.
    f32 = {"dtype": torch.float32, "device": a.device}
    g_a = torch.empty(genome_tiles, size.th, hidden, **f32)
    g_b = torch.empty(splits, genome_tiles, size.q, hidden, **f32)
    g_w_hidden = g_b_hidden = None
    if depth > 1:
        g_w_hidden = torch.empty(splits, genome_tiles, depth - 1, hidden, hidden, **f32)
        g_b_hidden = torch.empty(splits, genome_tiles, depth - 1, hidden, **f32)
    g_w_out = torch.empty(splits, genome_tiles, hidden, outputs, **f32)
    g_b_out = torch.empty(splits, genome_tiles, outputs, **f32)
    wrap(_generate_backward_kernel)[(genome_tiles, splits)](
        grad, *terms[:-1],
        places, scales,
        g_a, g_b, g_w_hidden, g_b_hidden, g_w_out, g_b_out,
        size.num_tiles, numel, size.th, size.q, hidden,
        **meta_parameters(size, outputs, activation, a.dtype),
    )  # fmt: skip

    def total(partials: Tensor | None, like: Tensor | None) -> Tensor | None:
        # Sum the per-split partials, back in the inputs' batch shape and dtype.
        return None if partials is None else partials.sum(0).reshape(like.shape).to(a.dtype)

    g_a = g_a.reshape(a.shape)
    return Terms(
        g_a.to(a.dtype),
        total(g_b, terms.b),
        g_a.sum(-2).to(a.dtype),  # c is added at every row: its gradient sums a's
        total(g_w_hidden, terms.w_hidden),
        total(g_b_hidden, terms.b_hidden),
        total(g_w_out, terms.w_out),
        g_b_out.sum(0).reshape(*size.batch, size.num_tiles, outputs).to(a.dtype),
    )
