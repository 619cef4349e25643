"""Triton forward of a g-net stack with tile-and-cut fused: outputs go straight to the weights.

Grid: `B * T * position blocks`. A program evaluates one tile's g-net on a `BLOCK_I x BLOCK_Q`
block of (row, evaluation column) positions with the separable first layer, runs the hidden
layers as `tl.dot` on the block, and stores the outputs, scaled, where `assemble` would put
them; positions past a ragged edge are masked. Nothing but the weights is written.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from gbfunc._plan import Generated, Stack
from gbfunc._spec import Terms

from .. import _checks, _runtime
from .._checks import Launch
from .._gnet import ACTIVATIONS, first_layer, hidden_stack, output_layer, tile_place


def block_sizes(args: dict) -> dict[str, int]:
    """`BLOCK_I x BLOCK_Q` positions per block from the tuned `BLOCK_N`.

    Columns first (they are contiguous in the weight), then rows; at least 16 positions,
    which `tl.dot` needs, even when a tile has fewer.
    """
    block_q = min(triton.next_power_of_2(args["Q"]), args["BLOCK_N"])
    block_i = min(
        args["BLOCK_N"] // block_q, max(triton.next_power_of_2(args["TH"]), 16 // block_q)
    )
    return {"BLOCK_Q": block_q, "BLOCK_I": block_i}


def block_h(hidden: int, depth: int, outputs: int) -> int:
    """Padded hidden width: a power of two, at least 16 when `tl.dot` runs on it."""
    width = triton.next_power_of_2(hidden)
    return width if depth == 1 and outputs == 1 else max(width, 16)


def block_p(outputs: int) -> int:
    """Padded output width: 1 (a reduction) or a power of two >= 16 (a `tl.dot`)."""
    return 1 if outputs == 1 else max(triton.next_power_of_2(outputs), 16)


# The tile's row and column blocks, from its shape; the backward kernel uses them too.
tile_blocks = triton.heuristics(
    {
        "BLOCK_Q": lambda args: block_sizes(args)["BLOCK_Q"],
        "BLOCK_I": lambda args: block_sizes(args)["BLOCK_I"],
    }
)


@triton.autotune(
    configs=_runtime.configs((32, 64, 128, 256), (2, 4, 8)),
    key=["TH", "Q", "H", "P", "DEPTH"],
)
@tile_blocks
@triton.jit
def _generate_kernel(
    # G-net terms, contiguous, genome-major tile axis (B * T): a (., TH, H), b (., Q, H), c (., H),
    a_ptr,
    b_ptr,
    c_ptr,
    # w_hidden (., DEPTH-1, H, H), b_hidden (., DEPTH-1, H), w_out (., H, P), b_out (., P).
    wh_ptr,
    bh_ptr,
    wo_ptr,
    bo_ptr,
    # Placement (T, 4) int64 [offset, row stride, rows, flat cols] and scale (T,) float32.
    place_ptr,
    scale_ptr,
    # Output: (B, NUMEL) weights.
    out_ptr,
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
    # A 1-D grid: CUDA caps the other axes at 65535, too few for tiles or for blocks.
    blocks_q = tl.cdiv(Q, BLOCK_Q)
    blocks = tl.cdiv(TH, BLOCK_I) * blocks_q
    pid = tl.program_id(0).to(tl.int64)
    g = pid // blocks  # tile of the whole batch: genome g // T, tile g % T
    t = g % NUM_TILES
    block = pid % blocks
    i = (block // blocks_q) * BLOCK_I + tl.arange(0, BLOCK_I)  # tile rows
    q = (block % blocks_q) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # evaluation columns
    hid = tl.arange(0, BLOCK_H)
    p = tl.arange(0, BLOCK_P)

    z = first_layer(a_ptr, b_ptr, c_ptr, g, i, q, hid, TH, Q, H, BLOCK_I, BLOCK_Q, BLOCK_H)
    h = hidden_stack(z, wh_ptr, bh_ptr, g, DEPTH - 1, hid, H, DEPTH, ACTIVATION, PRECISION)
    # (BLOCK_I * BLOCK_Q, BLOCK_P) outputs
    y = output_layer(h, wo_ptr, bo_ptr, g, hid, p, H, P, BLOCK_P, PRECISION)

    # Tile-and-cut: output (i, q, p) is flat column q * P + p of the tile's row i.
    base, ld, rows, cols, scale = tile_place(place_ptr, scale_ptr, t)
    i3, q3, p3 = i[:, None, None], q[None, :, None], p[None, None, :]
    j = q3 * P + p3
    mask = (i3 < rows) & (p3 < P) & (j < cols)
    y = tl.reshape(y, (BLOCK_I, BLOCK_Q, BLOCK_P)) * scale
    tl.store(
        out_ptr + (g // NUM_TILES) * NUMEL + base + i3 * ld + j,
        y.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def generate(
    terms: Terms, stack: Stack, params: tuple[Generated, ...], run: Callable | None = None
) -> Tensor:
    """Launch `_generate_kernel`; same contract as `reference.generate`, contiguous inputs only.

    `run`: what launches it on the checked inputs, `launch`'s arguments but `wrap` (default:
    `launch` itself; `_op.py` passes its op's).
    """
    checked = _checks.check_launch("kernels.generate", stack, params, terms._asdict())
    return (run or launch)(terms, checked)


def launch(terms: Terms, checked: Launch, wrap: Callable = lambda kernel: kernel) -> Tensor:
    """`_generate_kernel` on checked inputs (`checked`: `_checks.check_launch`'s), the stack's
    sizes read from the tensors' shapes: what the op in `_op.py` traces, with
    `wrap=torch.library.wrap_triton`."""
    places, scales, numel, outputs, activation = checked
    size = sizes(terms)
    out = torch.empty((*size.batch, numel), dtype=terms.a.dtype, device=terms.a.device)
    grid = lambda meta: (
        math.prod(size.batch)
        * size.num_tiles
        * triton.cdiv(size.th, meta["BLOCK_I"])
        * triton.cdiv(size.q, meta["BLOCK_Q"]),
    )
    wrap(_generate_kernel)[grid](
        *terms, places, scales, out,
        size.num_tiles, numel, size.th, size.q, size.hidden,
        **meta_parameters(size, outputs, activation, terms.a.dtype),
    )  # fmt: skip
    return out


class Sizes(NamedTuple):
    """A stack's sizes, read from its terms' shapes (`sizes`)."""

    batch: tuple[int, ...]  # leading genome dims
    num_tiles: int
    th: int  # tile rows
    q: int  # evaluation columns
    hidden: int
    depth: int


def sizes(terms: Terms) -> Sizes:
    """The sizes of the stack whose g-net `terms` these are (`Terms`' shapes)."""
    *batch, num_tiles, th, hidden = terms.a.shape
    depth = 1 if terms.w_hidden is None else terms.w_hidden.shape[-3] + 1
    return Sizes(tuple(batch), num_tiles, th, terms.b.shape[-2], hidden, depth)


def meta_parameters(size: Sizes, outputs: int, activation: str, dtype: torch.dtype) -> dict:
    """The meta-parameters both kernels take for a stack of `size` (all but the tuned blocks)."""
    return {
        "P": outputs,
        "DEPTH": size.depth,
        "ACTIVATION": ACTIVATIONS[activation],
        "PRECISION": _runtime.dot_precision(dtype),
        "BLOCK_H": block_h(size.hidden, size.depth, outputs),
        "BLOCK_P": block_p(outputs),
    }
