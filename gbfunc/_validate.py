"""A plan read from a file is checked for consistency and bounds before anything is allocated.

The SHA-256 of a checkpoint catches accidental damage, not a crafted file: anyone can write
a plan and recompute the hash. `check_plan` makes sure such a plan describes exactly the
model it is loaded for (names and shapes are checked by `check_matches`): every stack's
geometry follows from its genome, every generated parameter is tiled exactly by its blocks,
tiles are owned by exactly one parameter, scales are finite and positive, and free
parameters are drawn by a known rule. So a loaded plan can do no more than `gb.plan` could.
"""

import math

import torch

from ._genome import Genome
from ._plan import Free, Generated, Plan, stack_geometry

_FREE_INITS = ("zeros", "ones", "uniform", "normal")


def check_plan(plan: Plan, where: str) -> None:
    """Raise `ValueError` naming the first inconsistent or out-of-bounds field of `plan`."""
    owners: list[list[str]] = []
    for i, stack in enumerate(plan.stacks):
        if not isinstance(stack.genome, Genome):
            raise ValueError(f"{where}: stack {i} has no genome.")
        th, tw = _positive_pair(stack.tile, f"stack {stack.key!r} tile", where)
        expected = stack_geometry(stack.genome, (th, tw), tuple(stack.kernel))
        got = (stack.outputs, stack.columns, stack.row_width, stack.col_width)
        if got != expected:
            raise ValueError(
                f"{where}: stack {stack.key!r} has geometry {got}; its genome and tile give "
                f"{expected}."
            )
        counts = stack.tiles_per_gnet
        if not counts or not all(isinstance(n, int) and n >= 1 for n in counts):
            raise ValueError(f"{where}: stack {stack.key!r} has tiles_per_gnet {counts}.")
        if not stack.genome.share and set(counts) != {1}:
            raise ValueError(f"{where}: stack {stack.key!r} shares g-nets but share=False.")
        owners.append([""] * stack.num_tiles)
    for p in plan.params:
        _check_dtype(p.dtype, p.name, where)
        if isinstance(p, Free):
            _check_free(p, where)
        elif isinstance(p, Generated):
            _check_generated(p, plan, owners, where)
        else:
            raise ValueError(f"{where}: parameter {p!r} is neither generated nor free.")
    for i, (stack, tiles) in enumerate(zip(plan.stacks, owners, strict=True)):
        if "" in tiles:
            raise ValueError(
                f"{where}: stack {stack.key!r} tile {tiles.index('')} belongs to no parameter."
            )
        _check_tile_fits(plan, i, where)


def _check_tile_fits(plan: Plan, index: int, where: str) -> None:
    """A tile is never larger than the blocks it covers (`gb.plan` clips it to them)."""
    stack = plan.stacks[index]
    blocks = [b for p in plan.generated if p.stack == index for b in p.blocks]
    rows = max(b.rows for b in blocks)
    cols = max(b.cols for b in blocks)
    th, tw = stack.tile
    if th > rows or tw >= cols + max(1, stack.outputs):
        raise ValueError(
            f"{where}: stack {stack.key!r} has tile {stack.tile}, larger than its blocks "
            f"(at most {rows} x {cols})."
        )


def _check_generated(p: Generated, plan: Plan, owners: list[list[str]], where: str) -> None:
    name = f"parameter {p.name!r}"
    if not (isinstance(p.stack, int) and 0 <= p.stack < len(plan.stacks)):
        raise ValueError(f"{where}: {name} names stack {p.stack!r} of {len(plan.stacks)}.")
    if not (isinstance(p.scale, int | float) and math.isfinite(p.scale) and p.scale > 0):
        raise ValueError(f"{where}: {name} has scale {p.scale!r}; expected a positive number.")
    if p.split_dim not in (0, 1) or not p.blocks:
        raise ValueError(f"{where}: {name} has split_dim {p.split_dim!r}, {len(p.blocks)} blocks.")
    stack = plan.stacks[p.stack]
    th, tw = stack.tile
    rows = p.shape[0]
    cols = p.shape[1] if len(p.shape) > 1 else 1
    if tuple(p.shape[2:]) != tuple(stack.kernel):
        raise ValueError(f"{where}: {name} has kernel {p.shape[2:]}; stack has {stack.kernel}.")
    along = [b.rows if p.split_dim == 0 else b.cols for b in p.blocks]
    across = {b.cols if p.split_dim == 0 else b.rows for b in p.blocks}
    if sum(along) != (rows if p.split_dim == 0 else cols) or across != {
        cols if p.split_dim == 0 else rows
    }:
        raise ValueError(f"{where}: {name}'s blocks do not tile its {rows} x {cols} matrix.")
    tiles = owners[p.stack]
    for block in p.blocks:
        grid = (-(-block.rows // th), -(-block.cols // tw))
        if min(block.rows, block.cols) < 1 or tuple(block.grid) != grid:
            raise ValueError(f"{where}: {name} has block {block}; its tile gives grid {grid}.")
        first = block.first_tile
        if not (isinstance(first, int) and 0 <= first <= len(tiles) - block.num_tiles):
            raise ValueError(f"{where}: {name}'s tiles start at {first!r}, outside its stack.")
        for t in range(first, first + block.num_tiles):
            if tiles[t]:
                raise ValueError(f"{where}: {name} and {tiles[t]!r} both claim tile {t}.")
            tiles[t] = p.name


def _check_free(p: Free, where: str) -> None:
    kind, value = p.init
    if kind not in _FREE_INITS or not (isinstance(value, int | float) and math.isfinite(value)):
        raise ValueError(f"{where}: parameter {p.name!r} has init {p.init!r}.")


def _check_dtype(name: str, param: str, where: str) -> None:
    if not isinstance(getattr(torch, str(name), None), torch.dtype):
        raise ValueError(f"{where}: parameter {param!r} has dtype {name!r}.")


def _positive_pair(value: object, what: str, where: str) -> tuple[int, int]:
    ok = isinstance(value, tuple) and len(value) == 2
    if not ok or not all(isinstance(v, int) and v >= 1 for v in value):
        raise ValueError(f"{where}: {what} is {value!r}; expected two positive integers.")
    return value
