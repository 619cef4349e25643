"""Where every tile of a stack lands in the stack's flat output (tile-and-cut, as data).

The fused kernels write a stack's parameters into one flat buffer: `params` one after the
other, each in its own row-major layout, so `flat[offset:offset + numel].view(shape)` *is*
the parameter. Tile `t` covers a `(rows, cols)` corner of a `(TH, TW * K)` block starting at
`flat[base]`, with row stride `ld`; what falls outside the weight (ragged edges) is masked.
This is `gbfunc._select.assemble` turned into a table: same tiles, same cut, same scale.
"""

import functools
import math

import torch
from torch import Tensor

from gbfunc._plan import Generated, Stack

# One row per tile: offset of its (0, 0) element, row stride, valid rows, valid flat columns.
Place = tuple[int, int, int, int]


def placement(
    stack: Stack, params: tuple[Generated, ...]
) -> tuple[tuple[Place, ...], tuple[float, ...], int]:
    """Per-tile placement and scale of `params` (a stack's, in plan order) and their total size.

    Cached per `(stack, params)`, both frozen dataclasses; traced into constants when compiling
    (dynamo warns about caches).

    Raises:
        ValueError: If the blocks of `params` do not cover every tile of `stack` exactly once.
    """
    if torch.compiler.is_compiling():
        return _placement(stack, params)
    return _cached_placement(stack, params)


def _placement(
    stack: Stack, params: tuple[Generated, ...]
) -> tuple[tuple[Place, ...], tuple[float, ...], int]:
    th, tw = stack.tile
    taps = math.prod(stack.window)
    places: list[Place | None] = [None] * stack.num_tiles
    scales = [0.0] * stack.num_tiles
    offset = 0
    for p in params:
        ld = (p.shape[1] if len(p.shape) > 1 else 1) * taps  # (M, N * K) view; biases (M, 1)
        start = 0  # where the block begins along p.split_dim
        for block in p.blocks:
            row0, col0 = (start, 0) if p.split_dim == 0 else (0, start)
            for r in range(block.grid[0]):
                for c in range(block.grid[1]):
                    t = block.first_tile + r * block.grid[1] + c
                    if not 0 <= t < stack.num_tiles or places[t] is not None:
                        raise ValueError(
                            _cover_error(
                                stack, params, f"tile {t} is placed twice or is out of range"
                            )
                        )
                    base = offset + (row0 + r * th) * ld + (col0 + c * tw) * taps
                    places[t] = (
                        base,
                        ld,
                        min(th, block.rows - r * th),
                        min(tw, block.cols - c * tw) * taps,
                    )
                    scales[t] = p.scale
            start += block.rows if p.split_dim == 0 else block.cols
        offset += p.numel
    missing = [t for t, place in enumerate(places) if place is None]
    if missing:
        raise ValueError(_cover_error(stack, params, f"tiles {missing[:8]} are not placed"))
    return tuple(places), tuple(scales), offset  # type: ignore[arg-type]


_cached_placement = functools.lru_cache(maxsize=256)(_placement)


def placement_tensors(
    stack: Stack, params: tuple[Generated, ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    """`placement` as tensors on `device`: `(T, 4)` int64 places and `(T,)` float32 scales."""
    if torch.compiler.is_compiling():
        return _tensors(stack, params, device)
    return _cached_tensors(stack, params, device)


def _tensors(
    stack: Stack, params: tuple[Generated, ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    places, scales, _ = placement(stack, params)
    return (
        torch.tensor(places, dtype=torch.int64, device=device),
        torch.tensor(scales, dtype=torch.float32, device=device),
    )


@functools.lru_cache(maxsize=256)
def _cached_tensors(
    stack: Stack, params: tuple[Generated, ...], device: torch.device
) -> tuple[Tensor, Tensor]:
    return _tensors(stack, params, device)


def _cover_error(stack: Stack, params: tuple[Generated, ...], what: str) -> str:
    names = [p.name for p in params]
    return (
        f"gbfunc.kernels: params {names} do not tile stack {stack.key!r} ({stack.num_tiles} "
        f"tiles): {what}. Pass the Generated parameters of this stack, in plan order."
    )
