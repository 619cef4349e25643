"""A g-net stack's starting leaves, `gb.init`'s part per stack: drawn at fan-in scale, tied
odd where tiles have several positions, drawn again where a tile starts constant, and
normalised so each tile's raw output has mean 0 and std 1 (exactly, in float64)."""

import bisect
import itertools
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from ._plan import TILE_LEAVES, Stack
from ._spec import HASH_GAIN, code_tables, hashed_tiles, reference, stack_terms
from .generate.torch_ops import CHUNK_ELEMENTS, tile_chunks

# Draws of a stack before a g-net constant over its positions is given up on: with few hidden
# units and tiles, every unit can start dead (or linear, where odd-tied units cancel) on each
# tile, and its weights would start equal: a stack of 4 shared ReLU units on 2 tiles did so
# on 34 seeds in 200, and on none when drawn again.
DRAWS = 8


def normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64).mul_(std)  # one buffer


def init_stack(
    stack: Stack, gen: torch.Generator, starts: Tensor
) -> tuple[dict[str, Tensor], list[int]]:
    """A stack's leaves, its raw tiles at std `starts` (per tile, `_starts`), and the tiles
    still constant over their positions after `DRAWS` draws of their g-nets."""
    leaves = _draw(stack, gen)
    if stack.genome.hashed:
        # Start as HashedNets does, the table carrying the tile's variance (std `start`, 1 but
        # for weights drawn above a fan-in init), and the g-nets at zero output (so
        # normalising it is moot), to learn what the sharing misses: better than an even split
        # of the variance (measured: benchmarks/results/design_measurements.md).
        table = _standardised(normal(stack.leaf_shapes()["tile_hash"], 1.0, gen))
        leaves["tile_hash"] = table * starts[:, None] / HASH_GAIN
        leaves["w_out"].zero_()
        leaves["b_out"].zero_()
        return leaves, []
    with torch.no_grad():
        moments = _tile_moments(stack, leaves)
        for attempt in range(DRAWS - 1):
            if not (dead := _constant_tiles(stack, *moments)):
                break
            _redraw(stack, leaves, _draw(stack, gen), dead, shrink=0.5 ** (attempt + 1))
            moments = _tile_moments(stack, leaves)
        dead = _constant_tiles(stack, *moments)
        _normalise_outputs(stack, leaves, moments, gen)
    if bool((starts != 1).any()):  # a g-net's tiles are one parameter's: one start each
        owner = torch.tensor(stack.gnet_of_tile)
        per_gnet = torch.ones(stack.num_gnets, dtype=torch.float64).index_copy_(0, owner, starts)
        leaves["w_out"] = leaves["w_out"] * per_gnet[:, None, None]
        leaves["b_out"] = leaves["b_out"] * per_gnet[:, None]
    return leaves, dead


def _draw(stack: Stack, gen: torch.Generator) -> dict[str, Tensor]:
    """A stack's leaves as drawn, before their outputs are normalised."""
    genome = stack.genome
    fan_in = stack.row_width + stack.col_width + (genome.embed_dim if genome.share else 0)
    leaves: dict[str, Tensor] = {}
    for name, shape in stack.leaf_shapes().items():
        if name in ("w_in", "w_embed"):
            leaves[name] = normal(shape, 1 / math.sqrt(fan_in), gen)
        elif name == "w_hidden":
            leaves[name] = normal(shape, math.sqrt(2 / genome.hidden), gen)
        elif name == "w_out":
            leaves[name] = normal(shape, 1 / math.sqrt(genome.hidden), gen)
        elif name == "tile_embed":
            leaves[name] = normal(shape, 1.0, gen)
        elif name != "tile_hash":  # (drawn by the caller)
            leaves[name] = torch.zeros(shape, dtype=torch.float64)
    # Tying units odd in the row and the column codes (`_make_odd`) cancels every output of a
    # tile whose code along one of them is zero throughout (one row or one column, in the
    # codes that centre it); a hashed stack's g-nets start at zero output, and keep the tie
    # wherever there are positions.
    zero = any(not bool(code.any()) for code in code_tables(stack, leaves["w_in"]))
    if (
        genome.depth == 1
        and genome.activation != "tanh"
        and (not zero or (genome.hashed and _positions(stack) > 1))
    ):
        _make_odd(leaves, stack.row_width)
    if _positions(stack) == 1 and not genome.hashed:
        # One evaluation position: its codes are zero (tying units odd in them, `_make_odd`,
        # would cancel every output), so its units' inputs are their biases, drawn nonzero
        # (at zero a ReLU unit passes no gradient, and a conditioned g-net never learned to
        # depend on its condition).
        leaves["b_in"] = normal(leaves["b_in"].shape, 1.0, gen)
    return leaves


def _positions(stack: Stack) -> int:
    """Positions each tile's g-net is evaluated at (each emits `outputs` values there)."""
    return stack.tile[0] * stack.columns


def _constant_tiles(stack: Stack, sums: Tensor, sq: Tensor) -> list[int]:
    """The tiles whose raw output is constant at init (to 1e-6 of the unit std it is scaled
    to): over their positions; with one position, over their g-net's tiles (a g-net of one
    tile and one position is a constant: `_normalise_outputs` starts it as drawn values)."""
    if _positions(stack) > 1:
        return (sq < 1e-12 * stack.tile_positions).nonzero().flatten().tolist()
    _, std = _gnet_moments(stack, sums, sq)
    flat = (std < 1e-6) & (torch.tensor(stack.tiles_per_gnet) > 1)
    return flat[torch.tensor(stack.gnet_of_tile)].nonzero().flatten().tolist()


def _redraw(
    stack: Stack,
    leaves: dict[str, Tensor],
    fresh: dict[str, Tensor],
    tiles: list[int],
    *,
    shrink: float,
) -> None:
    """Take the constant `tiles`' draws from `fresh`: their tile embeddings where the g-nets
    are shared, times `shrink`, and whole g-nets where all of a g-net's tiles are constant.
    A shared g-net's tile is constant where its embedding puts every unit past its kink for
    all the tile's positions; a smaller embedding moves the units back within reach of the
    codes (at zero, an odd-tied group is not constant)."""
    owner = stack.gnet_of_tile
    counts = Counter(owner[t] for t in tiles)
    gnets = torch.tensor([g for g, n in counts.items() if n == stack.tiles_per_gnet[g]])
    for name, value in leaves.items():
        if name == "tile_embed":
            rows, scale = torch.tensor(tiles), shrink
        elif name not in TILE_LEAVES:
            rows, scale = gnets, 1.0
        else:
            continue
        if len(rows):
            value[rows] = fresh[name][rows] * scale


def _standardised(x: Tensor, correction: int = 1) -> Tensor:
    """`x` `(N, K)` at exactly zero mean and unit std per row (left as drawn where a row
    holds one value), the std with Bessel's `correction`: the hashed tables have always
    started with 1, i.e. at `sqrt((K - 1) / K)` of their std (0.996 at 124 buckets)."""
    if x.shape[1] < 2:
        return x
    return (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True, correction=correction)


_ROW_SIGNS = (1.0, 1.0, -1.0, -1.0)
_COL_SIGNS = (1.0, -1.0, 1.0, -1.0)


def _make_odd(leaves: dict[str, Tensor], row_width: int) -> None:
    """Tie hidden units in fours so each g-net starts odd in its row code and in its column code.

    Units `4k..4k+3` share first-layer weights up to the signs (+a+b, +a-b, -a+b, -a-b) and
    their bias, and enter the output with signs (+, -, -, +), so for any activation `f`:
    `f(a+b+c) - f(a-b+c) - f(-a+b+c) + f(-a-b+c)`, which is odd in `a` and in `b`. With
    symmetric codes every row and column of a tile then sums to zero at init. Without it, a
    tile's weights are mostly additive row + column effects at init, whose correlated row
    sums inflate the p-net's activations (measured: `benchmarks/results/design_measurements.md`).
    A g-net is free to leave this structure as it trains. Only for one hidden layer (deeper
    g-nets mix units again) and non-odd activations (for an odd `f` the four terms cancel).
    """
    w_in, w_out = leaves["w_in"], leaves["w_out"]  # (G, R + C, H), (G, H, P)
    groups = w_in.shape[-1] // 4
    if groups == 0:
        return
    for unit in range(4 * groups, w_in.shape[-1]):
        w_out[:, unit] = 0.0  # units left over from the fours stay silent at init
    for s in range(1, 4):
        w_in[:, :row_width, s : 4 * groups : 4] = (
            _ROW_SIGNS[s] * w_in[:, :row_width, 0 : 4 * groups : 4]
        )
        w_in[:, row_width:, s : 4 * groups : 4] = (
            _COL_SIGNS[s] * w_in[:, row_width:, 0 : 4 * groups : 4]
        )
        w_out[:, s : 4 * groups : 4] = _ROW_SIGNS[s] * _COL_SIGNS[s] * w_out[:, 0 : 4 * groups : 4]
        for name in ("b_in", "w_embed"):
            if name in leaves:
                leaves[name][..., s : 4 * groups : 4] = leaves[name][..., 0 : 4 * groups : 4]


def _normalise_outputs(
    stack: Stack, leaves: dict[str, Tensor], moments: tuple[Tensor, Tensor], gen: torch.Generator
) -> None:
    """Shift and scale each g-net's output layer so its raw tiles have mean 0 and std 1
    (`moments`: `_tile_moments`); a g-net of one tile and one position, a constant, starts
    its outputs at drawn values of mean 0 and std 1 instead."""
    mean, std = _gnet_moments(stack, *moments)
    # A g-net constant over its positions (every unit dead behind a ReLU, after `DRAWS`) is
    # left unscaled: dividing by a vanishing std would blow its rounding errors up to O(1).
    std = torch.where(std < 1e-6, torch.ones_like(std), std)
    single = torch.tensor(stack.tiles_per_gnet) * _positions(stack) == 1
    if bool(single.any()):
        drawn = normal((int(single.sum()), stack.outputs), 1.0, gen)
        drawn = _standardised(drawn, correction=0)
        mean[single] -= drawn
    leaves["b_out"] = (leaves["b_out"] - mean) / std[:, None]
    leaves["w_out"] = leaves["w_out"] / std[:, None, None]


def _gnet_moments(stack: Stack, sums: Tensor, sq: Tensor) -> tuple[Tensor, Tensor]:
    """Each g-net's raw output mean `(G, P)` and std `(G,)` over its tiles' positions and
    outputs, from the tiles' moments (`_tile_moments`)."""
    positions = _positions(stack)
    counts = torch.tensor(stack.tiles_per_gnet, dtype=sums.dtype) * positions  # (G,)
    owner = torch.tensor(stack.gnet_of_tile)
    mean = torch.zeros(stack.num_gnets, stack.outputs, dtype=sums.dtype)
    mean = mean.index_add_(0, owner, sums) / counts[:, None]  # (G, P)
    # Each tile's squares about its g-net's mean: about its own, plus its mean's offset.
    sq = sq + (sums / positions - mean[owner]).square().sum(1) * positions
    var = torch.zeros(stack.num_gnets, dtype=sums.dtype).index_add_(0, owner, sq)
    return mean, (var / (counts * stack.outputs)).sqrt()


def _tile_moments(stack: Stack, leaves: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Each tile's raw output summed over its positions, `(T, P)`, and its squares about its
    own mean, `(T,)`, in float64, from `_pieces`, merged by Chan et al.'s pairwise update.
    The moments are those of all tiles at once to float64 rounding (torch's kernels round
    some sums differently over fewer tiles)."""
    cols, outputs = stack.columns, stack.outputs
    sums = torch.empty(stack.num_tiles, outputs, dtype=torch.float64)
    sq = torch.empty(stack.num_tiles, dtype=torch.float64)
    for lo, hi, first, y in _pieces(stack, leaves):
        new, seen = y.shape[1], first * cols  # positions in the piece, and before it
        piece_sums = y.sum(1)
        piece_sq = (y - (piece_sums / new)[:, None, :]).square().sum((1, 2))
        if seen == 0:
            sums[lo:hi], sq[lo:hi] = piece_sums, piece_sq
            continue
        offset = piece_sums / new - sums[lo:hi] / seen
        sq[lo:hi] += piece_sq + offset.square().sum(1) * (seen * new / (seen + new))
        sums[lo:hi] += piece_sums
    return sums, sq


def raw_tiles(stack: Stack, leaves: dict[str, Tensor]) -> Tensor:
    """Every tile of the stack, `(T, TH, Q * P)` in float64, hashed tables added: computed
    from `_pieces`, so memory stays within twice the stack's float32 weights."""
    rows, cols, outputs = stack.tile[0], stack.columns, stack.outputs
    tiles = torch.empty(stack.num_tiles, rows, cols * outputs, dtype=torch.float64)
    for lo, hi, first, y in _pieces(stack, leaves):
        piece = y.reshape(hi - lo, -1, cols * outputs)
        tiles[lo:hi, first : first + piece.shape[1]] = piece
    if stack.genome.hashed:
        tiles += hashed_tiles(stack, leaves["tile_hash"])
    return tiles


def _pieces(stack: Stack, leaves: dict[str, Tensor]) -> Iterator[tuple[int, int, int, Tensor]]:
    """The stack's raw outputs in pieces of at most `_budget` hidden activations: chunks of
    tiles (`tile_chunks`), and rows of a tile where one tile holds more. Yields `(lo, hi,
    first, y)`: tiles `lo:hi` from their row `first`, `y` `(hi - lo, positions, P)` float64.
    All tiles at once held `(T, TH, Q, H)` float64 values, 1 GiB for a 4096 x 4096 weight in
    16 x 16 tiles at 8 hidden units."""
    rows, cols, outputs = stack.tile[0], stack.columns, stack.outputs
    hidden = cols * stack.genome.hidden  # per row of a tile
    budget = _budget(stack)
    step = max(1, budget // hidden)  # rows of a tile at once
    starts = list(itertools.accumulate(stack.tiles_per_gnet, initial=0))
    for lo, hi in tile_chunks(stack.num_tiles, rows * hidden, budget):
        terms = stack_terms(*_tile_range(stack, leaves, starts, lo, hi))
        for first in range(0, rows, step):
            piece = terms._replace(a=terms.a[:, first : first + step])
            y = reference(piece, stack.genome.activation).reshape(hi - lo, -1, outputs)
            yield lo, hi, first, y


def _budget(stack: Stack) -> int:
    """Hidden activations `gb.init` evaluates at once: at most a quarter of the stack's
    weights, so that their float64 transients stay under the weights' own float32 size, and
    at most `CHUNK_ELEMENTS` (cache-sized)."""
    return min(CHUNK_ELEMENTS, stack.num_tiles * stack.tile_positions // 4)


def _tile_range(
    stack: Stack, leaves: dict[str, Tensor], starts: list[int], lo: int, hi: int
) -> tuple[Stack, dict[str, Tensor]]:
    """Tiles `lo:hi` of a stack as a stack of their own, with views of its leaves' rows;
    `starts` are the g-nets' first tiles, then the number of tiles."""
    first, last = bisect.bisect_right(starts, lo) - 1, bisect.bisect_left(starts, hi)
    counts = tuple(min(hi, starts[g + 1]) - max(lo, starts[g]) for g in range(first, last))
    rows = {k: v[lo:hi] if k in TILE_LEAVES else v[first:last] for k, v in leaves.items()}
    return replace(stack, tiles_per_gnet=counts), rows
