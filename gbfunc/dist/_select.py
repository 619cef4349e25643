"""Generate only part of a plan: the tiles that cover given regions of given parameters.

A tensor-parallel rank needs its shard of each weight, a pipeline stage its own layers; both
evaluate just the tiles under those regions, in one batched call per stack, and lay them out
exactly as `gb.apply` would. A tile that straddles a region's edge is generated whole and cut.
"""

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .._apply import GParams, evaluate_stack, finish
from .._plan import TILE_LEAVES, Generated, Plan, Stack

Region = tuple[tuple[int, int], ...]  # [start, stop) along every dim of a parameter


def full_region(shape: Sequence[int]) -> Region:
    """The region covering a whole parameter."""
    return tuple((0, n) for n in shape)


def evaluate_tiles(stack: Stack, leaves: Mapping[str, Tensor], tiles: Sequence[int]) -> Tensor:
    """Tiles `tiles` (ascending indices into the stack) of a stack, `(len(tiles), TH, TW * K)`.

    Args:
        stack: The stack's description.
        leaves: Its parameters, `gparams["stacks"][stack.key]`; gradients flow back into them.
        tiles: Ascending tile indices.
    """
    if list(tiles) == list(range(stack.num_tiles)):
        return evaluate_stack(stack, dict(leaves))
    device = leaves["w_in"].device
    owner = stack.gnet_of_tile
    per_gnet = Counter(owner[t] for t in tiles)
    gnets = sorted(per_gnet)
    counts = tuple(per_gnet[g] for g in gnets)
    by_gnet = torch.tensor(gnets, device=device)
    by_tile = torch.tensor(list(tiles), device=device)
    sub = {
        k: v.index_select(0, by_tile if k in TILE_LEAVES else by_gnet) for k, v in leaves.items()
    }
    return evaluate_stack(replace(stack, tiles_per_gnet=counts), sub)


@dataclass(frozen=True)
class _Piece:
    """The part of a region inside one block: a range of the block's tile grid, then a cut."""

    block: int
    tile_rows: tuple[int, int]
    tile_cols: tuple[int, int]
    cut_rows: tuple[int, int]
    cut_cols: tuple[int, int]


def _pieces(p: Generated, stack: Stack, region: Region) -> list[_Piece]:
    if any(span != (0, n) for span, n in zip(region[2:], p.shape[2:], strict=True)):
        raise ValueError(
            f"gb.dist: {p.name} can only be split along dims 0 and 1, got region {region}."
        )
    th, tw = stack.tile
    pieces, offset = [], 0
    for index, block in enumerate(p.blocks):
        # Block `index` covers [offset, offset + size) along split_dim and everything across it.
        size = block.rows if p.split_dim == 0 else block.cols
        spans = [list(region[0]), list(region[1])]
        lo, hi = spans[p.split_dim]
        spans[p.split_dim] = [max(lo, offset) - offset, min(hi, offset + size) - offset]
        offset += size
        (r0, r1), (c0, c1) = spans
        if r0 >= r1 or c0 >= c1:
            continue
        rows, cols = (r0 // th, -(-r1 // th)), (c0 // tw, -(-c1 // tw))
        cut_rows = (r0 - rows[0] * th, r1 - rows[0] * th)
        cut_cols = (c0 - cols[0] * tw, c1 - cols[0] * tw)
        pieces.append(_Piece(index, rows, cols, cut_rows, cut_cols))
    return pieces


def _piece_tiles(p: Generated, piece: _Piece) -> list[int]:
    block = p.blocks[piece.block]
    return [
        block.first_tile + i * block.grid[1] + j
        for i in range(*piece.tile_rows)
        for j in range(*piece.tile_cols)
    ]


def cuts_tiles(p: Generated, stack: Stack, region: Region) -> bool:
    """Whether an edge of `region` falls inside a tile (which neighbouring regions then share)."""
    th, tw = stack.tile
    for piece in _pieces(p, stack, region):
        block = p.blocks[piece.block]
        for (t0, _), (cut0, cut1), size, extent in (
            (piece.tile_rows, piece.cut_rows, th, block.rows),
            (piece.tile_cols, piece.cut_cols, tw, block.cols),
        ):
            stop = t0 * size + cut1
            if cut0 or (stop % size and stop != extent):
                return True
    return False


def region_tiles(p: Generated, stack: Stack, region: Region) -> list[int]:
    """Ascending indices of the stack's tiles that cover `region` of `p`."""
    return sorted({t for piece in _pieces(p, stack, region) for t in _piece_tiles(p, piece)})


class Selection:
    """Generate `regions` of some parameters of `plan`, evaluating only the tiles under them.

    Args:
        plan: The model's plan.
        regions: `{name: region}` for the parameters to produce (generated or free).

    Example:
        >>> model = nn.ModuleDict({"fc": nn.Linear(128, 256)})
        >>> plan = gb.plan(model, tile=(32, 32))
        >>> sel = Selection(plan, {"fc.weight": ((0, 64), (0, 128))})  # the first 64 rows
        >>> sel.apply(gb.init(plan))["fc.weight"].shape
        torch.Size([64, 128])
    """

    def __init__(self, plan: Plan, regions: Mapping[str, Region]) -> None:
        params = {p.name: p for p in plan.params}
        for name, region in regions.items():
            if name not in params:
                raise ValueError(f"gb.dist: {name!r} is not a parameter of the plan.")
            shape = params[name].shape
            ok = len(region) == len(shape) and all(
                0 <= a < b <= n for (a, b), n in zip(region, shape, strict=True)
            )
            if not ok:
                raise ValueError(f"gb.dist: region {region} does not fit {name} of shape {shape}.")
            whole_rows = all(r == (0, n) for r, n in zip(region[1:], shape[1:], strict=True))
            if getattr(params[name], "center", False) and not whole_rows:
                raise ValueError(
                    f"gb.dist: {name} has center=True, which needs whole rows, but region "
                    f"{region} splits its columns; shard it by rows or plan it without center."
                )
        self.plan = plan
        self.regions = dict(regions)
        self._params = {name: params[name] for name in regions}
        needed: dict[int, set[int]] = {}
        self._pieces: dict[str, list[_Piece]] = {}
        for name, p in self._params.items():
            if isinstance(p, Generated):
                stack = plan.stacks[p.stack]
                self._pieces[name] = _pieces(p, stack, self.regions[name])
                needed.setdefault(p.stack, set()).update(region_tiles(p, stack, self.regions[name]))
        self.tiles = {s: sorted(t) for s, t in sorted(needed.items())}  # per stack, evaluated
        self._position = {s: {t: i for i, t in enumerate(tiles)} for s, tiles in self.tiles.items()}
        self._index: dict[tuple[str, torch.device], list[Tensor]] = {}

    @property
    def num_tiles(self) -> int:
        """Tiles evaluated per call."""
        return sum(len(t) for t in self.tiles.values())

    def apply(self, gparams: GParams) -> dict[str, Tensor]:
        """`{name: tensor of the region's shape}` for every selected parameter (differentiable)."""
        tiles = {
            s: evaluate_tiles(self.plan.stacks[s], gparams["stacks"][self.plan.stacks[s].key], t)
            for s, t in self.tiles.items()
        }
        out: dict[str, Tensor] = {}
        for name, p in self._params.items():
            region = self.regions[name]
            if isinstance(p, Generated):
                out[name] = self._assemble(p, tiles[p.stack])
            else:
                value = gparams["free" if p.trainable else "frozen"][name]
                out[name] = value[tuple(slice(a, b) for a, b in region)]
        return out

    def _assemble(self, p: Generated, tiles: Tensor) -> Tensor:
        stack = self.plan.stacks[p.stack]
        th, tw = stack.tile
        taps = math.prod(stack.kernel)
        parts = []
        for piece, index in zip(self._pieces[p.name], self._indices(p, tiles.device), strict=True):
            rows, cols = (b - a for a, b in (piece.tile_rows, piece.tile_cols))
            t = (
                tiles.index_select(0, index)
                .reshape(rows, cols, th, tw, taps)
                .permute(0, 2, 1, 3, 4)
            )
            t = t.reshape(rows * th, cols * tw, taps)
            parts.append(t[slice(*piece.cut_rows), slice(*piece.cut_cols)])
        weight = parts[0] if len(parts) == 1 else torch.cat(parts, dim=p.split_dim)
        (r0, r1), (c0, c1) = self.regions[p.name][:2]
        return finish(p, weight.reshape(r1 - r0, c1 - c0, *p.shape[2:]))

    def _indices(self, p: Generated, device: torch.device) -> list[Tensor]:
        key = (p.name, device)
        if key not in self._index:
            position = self._position[p.stack]
            self._index[key] = [
                torch.tensor([position[t] for t in _piece_tiles(p, piece)], device=device)
                for piece in self._pieces[p.name]
            ]
        return self._index[key]
