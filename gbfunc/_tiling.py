"""Tile-and-cut: where a stack's tiles land in the parameters they generate.

A generated parameter is laid out on its blocks' tile grids (`Generated.blocks`), cut to its
shape (or to a region of it: a tensor-parallel shard, a pipeline stage's layers), centred if
asked and scaled. Below every generation path: the runners hand it tiles, the Triton
kernels' reference checks their fused layout against it.
"""

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ._plan import Block, Free, Generated, Stack
from ._tree import GParams

Region = tuple[tuple[int, int], ...]  # [start, stop) along every dim of a parameter


class Concat(NamedTuple):
    """Several regions of one parameter, joined along `dim`: e.g. a tensor-parallel rank's
    heads of GPT-2's fused Q/K/V weight, its slice of each of the three matrices."""

    regions: tuple[Region, ...]
    dim: int


def full_region(shape: Sequence[int]) -> Region:
    """The region covering a whole parameter."""
    return tuple((0, n) for n in shape)


class Piece(NamedTuple):
    """The part of a region inside one block: a range of the block's tile grid, then a cut."""

    block: int
    tile_rows: tuple[int, int]
    tile_cols: tuple[int, int]
    cut_rows: tuple[int, int]
    cut_cols: tuple[int, int]


def pieces(p: Generated, stack: Stack, region: Region) -> list[Piece]:
    """The pieces of `region` of `p` (in the matrix view: a bias is one column)."""
    if any(span != (0, n) for span, n in zip(region[2:], p.shape[2:], strict=True)):
        raise ValueError(
            f"gb.dist: {p.name} can only be split along dims 0 and 1, got region {region}."
        )
    th, tw = stack.tile
    pieces, offset = [], 0
    for index, block in enumerate(p.blocks):
        # Block `index` covers [offset, offset + size) along split_dim and everything across it.
        size = block.rows if p.split_dim == 0 else block.cols
        spans = [list(region[0]), list(region[1] if len(region) > 1 else (0, 1))]
        lo, hi = spans[p.split_dim]
        spans[p.split_dim] = [max(lo, offset) - offset, min(hi, offset + size) - offset]
        offset += size
        (r0, r1), (c0, c1) = spans
        if r0 >= r1 or c0 >= c1:
            continue
        rows, cols = (r0 // th, -(-r1 // th)), (c0 // tw, -(-c1 // tw))
        cut_rows = (r0 - rows[0] * th, r1 - rows[0] * th)
        cut_cols = (c0 - cols[0] * tw, c1 - cols[0] * tw)
        pieces.append(Piece(index, rows, cols, cut_rows, cut_cols))
    return pieces


def piece_tiles(p: Generated, piece: Piece) -> list[int]:
    block = p.blocks[piece.block]
    return [
        block.first_tile + i * block.grid[1] + j
        for i in range(*piece.tile_rows)
        for j in range(*piece.tile_cols)
    ]


def cuts_tiles(p: Generated, stack: Stack, region: Region) -> bool:
    """Whether an edge of `region` falls inside a tile (which neighbouring regions then share)."""
    th, tw = stack.tile
    for piece in pieces(p, stack, region):
        block = p.blocks[piece.block]
        for (t0, _), (cut0, cut1), size, extent in (
            (piece.tile_rows, piece.cut_rows, th, block.rows),
            (piece.tile_cols, piece.cut_cols, tw, block.cols),
        ):
            stop = t0 * size + cut1
            if cut0 or (stop % size and stop != extent):
                return True
    return False


def lay_out(
    p: Generated, stack: Stack, region: Region, covering: Sequence[Piece], tiles: Sequence[Tensor]
) -> Tensor:
    """`region` of `p` from each piece's tiles `(rows * cols, TH, TW * K)`, row-major in the
    piece's tile grid: laid out on the grid, cut, joined across blocks, centred and scaled."""
    th, tw = stack.tile
    taps = math.prod(stack.window)
    parts = []
    for piece, t in zip(covering, tiles, strict=True):
        rows, cols = (b - a for a, b in (piece.tile_rows, piece.tile_cols))
        t = t.reshape(rows, cols, th, tw, taps).permute(0, 2, 1, 3, 4)
        t = t.reshape(rows * th, cols * tw, taps)
        (r0, r1), (c0, c1) = piece.cut_rows, piece.cut_cols
        if r0 != 0 or c0 != 0 or r1 != rows * th or c1 != cols * tw:
            t = t[slice(*piece.cut_rows), slice(*piece.cut_cols)]  # backward: zero-filled
        parts.append(t)
    weight = parts[0] if len(parts) == 1 else torch.cat(parts, dim=p.split_dim)
    return finish(p, weight.reshape(tuple(b - a for a, b in region)))


def assemble(
    p: Generated, stack: Stack, tiles: Tensor | Mapping[tuple[int, int], Tensor]
) -> Tensor:
    """The whole parameter `p` from all of its stack's tiles `(T, TH, TW * K)`, or from its
    blocks' tiles by tile range (`block_spans`)."""
    region = full_region(p.shape)
    covering = pieces(p, stack, region)
    spans = [_span(p.blocks[piece.block]) for piece in covering]
    if isinstance(tiles, Tensor):
        parts = [tiles[start:stop] for start, stop in spans]
    else:
        parts = [tiles[span] for span in spans]
    return lay_out(p, stack, region, covering, parts)


def block_spans(params: Iterable[Generated], num_tiles: int) -> list[tuple[int, int]] | None:
    """The tile ranges `(start, stop)` of the blocks of `params` (a stack's parameters,
    whole), ascending, where they cover the stack's `num_tiles` tiles once each (`partition`).
    """
    return partition([_span(block) for p in params for block in p.blocks], num_tiles)


def partition(spans: Iterable[tuple[int, int]], total: int) -> list[tuple[int, int]] | None:
    """`spans`, ranges of `total` rows, ascending, where they are consecutive and cover every
    row once: a stack's tiles then split into them (one op, whose backward is one
    concatenation; a slice per range would add up a zero-filled stack-sized gradient each).
    None where they are not. (Sorted by their starts, ints: dynamo sorts no tuples.)"""
    stop_of: dict[int, int] = {}
    for start, stop in spans:
        if stop_of.setdefault(start, stop) != stop:
            return None  # two ranges from one row
    ordered = [(start, stop_of[start]) for start in sorted(stop_of)]
    stops = [0] + [stop for _, stop in ordered]
    covers = [start for start, _ in ordered] == stops[:-1] and stops[-1] == total
    return ordered if covers else None


def split_into(tiles: Tensor, spans: Sequence[tuple[int, int]]) -> dict[tuple[int, int], Tensor]:
    """`tiles` split into the consecutive row ranges `spans` (`partition`'s), by range: one
    op, whose backward is one concatenation."""
    sizes = [stop - start for start, stop in spans]
    parts = tiles.split(sizes) if len(sizes) > 1 else (tiles,)
    return dict(zip(spans, parts, strict=True))


def _span(block: Block) -> tuple[int, int]:
    return block.first_tile, block.first_tile + block.num_tiles


def finish(p: Generated, raw: Tensor) -> Tensor:
    """A parameter from its laid-out raw values `(rows, ...)`: centred rows if asked, scaled."""
    return (center_rows(raw) if p.center else raw) * p.scale


def center_rows(weight: Tensor) -> Tensor:
    """`weight` less each row's mean over its inputs (every dimension but the first)."""
    return weight - weight.mean(dim=tuple(range(1, weight.dim())), keepdim=True)


def parameters(
    params: Iterable[Generated | Free], gparams: GParams, generated: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """`{name: tensor}` for `params` in order: generated ones from `generated`, the rest the
    leaves of `gparams["free"]` or `gparams["frozen"]`."""
    return {
        p.name: generated[p.name]
        if isinstance(p, Generated)
        else gparams["free" if p.trainable else "frozen"][p.name]
        for p in params
    }
