"""Where every tile of a stack lands in the stack's flat output (tile-and-cut, as data).

The fused kernels write a stack's parameters into one flat buffer: `params` one after the
other, each in its own row-major layout, so `flat[offset:offset + numel].view(shape)` *is*
the parameter. Tile `t` covers a `(rows, cols)` corner of a `(TH, TW * K)` block starting at
`flat[base]`, with row stride `ld`; what falls outside the weight (ragged edges) is masked.
This is `gbfunc._tiling.assemble` turned into a table: same tiles, same cut, same scale.
"""

import functools

import torch
from torch import Tensor

from gbfunc._plan import Generated, Place, Stack, tile_places


def placement(
    stack: Stack, params: tuple[Generated, ...]
) -> tuple[tuple[Place, ...], tuple[float, ...], int]:
    """Per-tile placement and scale of `params` (a stack's, in plan order) and their total size
    (`gbfunc._plan.tile_places`).

    Cached per `(stack, params)`, both frozen dataclasses; traced into constants when compiling
    (dynamo warns about caches).

    Raises:
        ValueError: If the blocks of `params` do not cover every tile of `stack` exactly once.
    """
    if torch.compiler.is_compiling():
        return tile_places(stack, params)
    return _cached_placement(stack, params)


_cached_placement = functools.lru_cache(maxsize=256)(tile_places)


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
