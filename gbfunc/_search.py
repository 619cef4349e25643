"""`gb.plan(compression=...)`: the tile, or the hashed tables' sizes, that reach the target.

The target is the whole model's ratio by default, dense parameters / stored ones as
`gb.report(plan).compression` counts them (free and frozen parameters stored whole), or,
with `compression_of="generated"`, generated weights / g-net parameters (the genomic
bottleneck papers' and torchGB's count, `gb.report(plan).generated_compression`).
"""

import math
from collections.abc import Callable
from typing import NamedTuple

from ._advice import Reach, advice
from ._entries import (
    Entry,
    block_cost,
    clip_tile,
    free_reason,
    genome_for,
    param_cost,
    tile_for,
)
from ._genome import AUTO, Genome
from ._plan import block_shapes, one_reduction, stack_geometry, tile_grid

SCOPES = ("model", "generated")  # what `compression=` counts, see the module docstring


class UnreachableError(ValueError):
    """No tile or table size reaches `compression=` within 10%."""


class Goal(NamedTuple):
    """What `compression=` asks of a plan: the ratio `target` of `scope` (one of `SCOPES`)
    over its `entries`, with its `flags`; `stored` parameters that the plan stores besides
    the model's (task embeddings), which the whole model's ratio counts as `gb.report` does."""

    entries: list[Entry]
    flags: dict[str, bool]
    target: float
    scope: str
    stored: int

    def unreachable(
        self, options: list[dict[str, object]], reach: Reach, found: str, otherwise: str
    ) -> UnreachableError:
        """The error for a target that `options` miss: the ratios they give (`found`), then
        `advice` on options that would reach it, then what else to change (`otherwise`)."""
        return UnreachableError(
            f"gb.plan: compression={self.target} cannot be reached within 10% {found}."
            + advice(self.entries, options, self.flags, self.target, self.scope, reach, self.stored)
            + f" Otherwise {otherwise}."
        )


class _Ratio:
    """The ratio `compression=` targets: `generated` weights / `spent` g-net parameters, plus
    (whole model) the `kept` parameters stored whole on both sides and the `stored` ones
    (task embeddings) on the stored side."""

    def __init__(self, whole: bool, kept: int, stored: int) -> None:
        self.whole, self.kept, self.stored = whole, kept, stored

    def __call__(self, generated: int, spent: int, left_free: int = 0) -> float:
        if not self.whole:
            return generated / spent
        kept = self.kept + left_free
        return (generated + kept) / (spent + kept + self.stored)


class _Scan(NamedTuple):
    """What the tiles give: the lowest and highest ratio, the tile nearest the target (with
    its relative error), and `(aspect, vector work, tile)` of those within 2% of it."""

    lo: float
    hi: float
    nearest: tuple[float, tuple[int, int]] | None
    close: list[tuple[float, int, tuple[int, int]]]

    @property
    def reached(self) -> bool:
        return self.nearest is not None and self.nearest[0] <= 0.10


def search_tile(goal: Goal, options: list[dict[str, object]]) -> list[dict[str, object]]:
    """Pick a `(TH, TW)` whose ratio is within 2% of the goal's target (else the
    closest): the squarest, unless one about as square has its g-nets
    evaluate at least 5% fewer vectors (`vector_work`); then the one that evaluates fewest.

    Costs are counted per distinct block shape, so the search over a few thousand candidate
    tiles (sizes that split some weight dimension evenly, powers of two and multiples of
    `VECTOR_LANES`) takes well under a second even for GPT-2-sized plans.
    """
    scan = _scan_tiles(goal, options)
    if not scan.reached:

        def reach(opts: list[dict[str, object]], fl: dict[str, bool]) -> tuple[float, float, bool]:
            found = _scan_tiles(goal._replace(flags=fl), opts)
            return found.lo, found.hi, found.reached

        found = "with these g-nets: " + (
            f"tiles give {scan.lo:.2f}x to {scan.hi:.2f}x"
            if scan.nearest is not None
            else "under every tile the g-nets of the parameters that read the condition (which "
            "tasks= feeds) cost more than those parameters, which then stay free"
            if goal.stored
            else "under every tile they cost more than the weights they would generate, which "
            "then stay free"
        )
        raise goal.unreachable(options, reach, found, "change hidden/depth, or pass tile= directly")
    tile = scan.nearest[1]
    if scan.close:
        squarest = min(scan.close, key=lambda c: (c[0], c[2]))
        shaped = [c for c in scan.close if c[0] <= max(MAX_ASPECT, squarest[0] + ASPECT_SLACK)]
        least = min(shaped, key=lambda c: (c[1], c[0], c[2]))
        tile = least[2] if least[1] <= WORK_GAIN * squarest[1] else squarest[2]
    chosen = {"tile": tile, "tile_chosen_by": "search"}
    return [o if o.get("explicit_tile") else {**o, **chosen} for o in options]


def _scan_tiles(goal: Goal, options: list[dict[str, object]]) -> _Scan:
    """The ratio of every candidate tile, against the goal's target."""
    entries, flags, target, scope, stored = goal
    fixed_weights, fixed = 0, 0  # weights and g-net parameters of tiles the caller fixed
    fixed_condition = False  # whether one of those reads the condition
    kept = 0  # parameters that stay free whatever the tile
    searched: dict[tuple, int] = {}  # (genome, window, block shapes) -> parameters like it
    for entry, opts in zip(entries, options, strict=True):
        name, shape, layout = entry.name, entry.shape, entry.layout
        if free_reason(entry, opts, flags) is not None:
            kept += math.prod(shape)
            continue
        genome = genome_for(opts, shape[2:], layout)
        blocks = tuple(block_shapes(shape, layout.splits, layout.split_dim))
        if opts.get("explicit_tile"):
            fixed_weights += math.prod(shape)
            fixed_condition = fixed_condition or genome.condition > 0
            for rows, cols in blocks:
                tile = tile_for(name, opts, rows, cols, genome.outputs, layout)
                fixed += block_cost(genome, shape[2:], rows, cols, tile)
        else:
            key = (genome, shape[2:], blocks)
            searched[key] = searched.get(key, 0) + 1
    if not searched:
        given = [
            e.name
            for e, o in zip(entries, options, strict=True)
            if o.get("explicit_tile") and free_reason(e, o, flags) is None
        ]
        raise ValueError(
            "gb.plan: compression= has no tile to choose: every generated parameter's tile is "
            f"given in overrides ({', '.join(given[:4])}{', ...' if len(given) > 4 else ''}); "
            "drop compression=, or one of those tiles."
        )
    measure = _Ratio(scope == "model", kept, stored)
    dims = {d for (_, _, blocks) in searched for shape in blocks for d in shape}
    sizes = sorted(
        {-(-d // n) for d in dims for n in range(1, 65)}
        | {2**k for k in range(13)}
        | {VECTOR_LANES * k for k in range(1, 65)}
    )
    sizes = [s for s in sizes if s <= max(dims)]
    # A tile narrower than `outputs` is refused by `tile_for` (a weight whose own columns are
    # fewer is refused there whatever the tile).
    widest = max(genome.outputs for genome, *_ in searched)
    widths = [s for s in sizes if s >= widest] or sizes[-1:]
    close: list[tuple[float, int, tuple[int, int]]] = []  # (aspect, work, tile) within 2%
    nearest: tuple[float, tuple[int, int]] | None = None  # (error, tile) of the closest ratio
    lo, hi = math.inf, 0.0
    for th in sizes:
        for tw in widths:
            weights, cost, left_free = fixed_weights, fixed, 0
            generated = []  # (key, count) of the searched parameters this tile generates
            for key, count in searched.items():
                genome, window, blocks = key
                spent = param_cost(genome, window, blocks, (th, tw))
                size = sum(r * c for r, c in blocks) * math.prod(window)
                if spent < size:
                    weights, cost = weights + count * size, cost + count * spent
                    generated.append((key, count))
                else:  # it stays free (as the plan builder decides)
                    left_free += count * size
            conditioned = fixed_condition or any(key[0].condition for key, _ in generated)
            if cost == 0 or (stored and not conditioned):
                continue  # nothing generated, or no g-net left to read the task embeddings
            ratio = measure(weights, cost, left_free)
            lo, hi = min(lo, ratio), max(hi, ratio)
            err = abs(ratio / target - 1)
            if err <= 0.02:
                work = sum(n * vector_work(*key, (th, tw)) for key, n in generated)
                close.append((abs(math.log(th / tw)), work, (th, tw)))
            if nearest is None or err < nearest[0]:
                nearest = (err, (th, tw))
    return _Scan(lo, hi, nearest, close)


# Compiled one-output g-nets evaluate a tile row on CPU as vectors of its columns: 16 floats
# on AVX-512 (two AVX2 registers), a row that ends in a partial vector paying about a whole
# one more. The MLP 784-512-512-10 at `compression=10` (torchGB's genome; compiled generation,
# forward and backward): a 74-wide tile row took 1.16x the time of an 80-wide one. Fixed, not
# read from the machine: a plan is the same wherever it is built (checkpoints, ranks). The
# Triton kernels pad a tile row to a power of two, which this does not model.
VECTOR_LANES = 16
# The search leaves the squarest tile that reaches the target for one with at most this share
# of its vector work, of aspect ratio up to 2 or up to 1.5 times the squarest's.
WORK_GAIN = 0.95
MAX_ASPECT, ASPECT_SLACK = math.log(2), math.log(1.5)


def vector_work(
    genome: Genome, window: tuple[int, ...], blocks: tuple[tuple[int, int], ...], tile: tuple
) -> int:
    """What a parameter's g-nets evaluate under `tile`, over its tile grid (the overhang
    past its edges included): for one-layer, one-output g-nets (`Stack.one_reduction`), the
    vectors of each tile row's evaluation columns, a partial vector counted twice; for the
    others, which compiled code lays out units-major (`gbfunc.generate.torch_ops`), positions."""
    total = 0
    for rows, cols in blocks:
        clipped = clip_tile(genome, rows, cols, tile)
        outputs, columns, _, _ = stack_geometry(genome, clipped, window)
        if one_reduction(genome, outputs):
            per_row = columns // VECTOR_LANES + 2 * (columns % VECTOR_LANES > 0)
        else:
            per_row = columns * outputs
        total += math.prod(tile_grid(rows, cols, clipped)) * clipped[0] * per_row
    return total


# Under `hashed="auto"` a tile's table grows as (its positions) ** TABLE_EXPONENT: against
# tables sized by hand, 0.5 ties them on two of three digits genomes and 0.6 on the third
# (benchmarks/results/design_measurements.md).
TABLE_EXPONENT = 0.5


def size_tables(goal: Goal, options: list[dict[str, object]]) -> list[dict[str, object]]:
    """Buckets for every `hashed="auto"` parameter, so that the plan's ratio is near the
    goal's target.

    A tile's table gets `round(k * positions ** TABLE_EXPONENT)` buckets (the square root;
    at least one, at most one per position), one factor `k` for the whole plan, found by
    bisection. On the digits CNN this gives nearly the tables that were tuned by hand per
    layer: small layers get more buckets per weight than large ones, and equal tiles get
    equal tables. A target that the sizes on either side of it both miss by more than 10% is
    unreachable too.
    """
    target = goal.target
    ratio, auto, top = _tables(goal, options)
    k, (above, below) = _factor(ratio, top, target)
    if abs(ratio(k) / target - 1) > 0.10:

        def reach(opts: list[dict[str, object]], fl: dict[str, bool]) -> tuple[float, float, bool]:
            their_ratio, _, their_top = _tables(goal._replace(flags=fl), opts)
            their_k, _ = _factor(their_ratio, their_top, target)
            reached = abs(their_ratio(their_k) / target - 1) <= 0.10
            return their_ratio(their_top), their_ratio(0.0), reached

        found = (
            f"by sizing the hashed tables: they give {ratio(top):.2f}x (a bucket per position) "
            f"to {ratio(0.0):.2f}x (one per tile)"
        )
        if ratio(top) <= target <= ratio(0.0):  # spanned, but stepped over
            found += f", and the sizes on either side of it give {above:.2f}x and {below:.2f}x"
        raise goal.unreachable(
            options, reach, found, "change hidden/tile, or give hashed= a number of buckets"
        )
    sized = {index: _buckets(k, positions) for index, _, positions in auto}
    return [{**opts, "hashed": sized[i]} if i in sized else opts for i, opts in enumerate(options)]


def _buckets(k: float, positions: int) -> int:
    """Buckets of a table over `positions` at the plan's factor `k`."""
    return min(positions, max(1, round(k * positions**TABLE_EXPONENT)))


def _factor(
    ratio: Callable[[float], float], top: float, target: float
) -> tuple[float, tuple[float, float]]:
    """The table factor, from 0 (a bucket per tile) to `top` (one per position), whose ratio
    is nearest `target`, and the ratios on either side of it: of the largest factor whose
    ratio stays at or above the target (found by bisection), and of the next one."""
    lo, hi = 0.0, top
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) >= target else (lo, mid)
    k = lo if abs(ratio(lo) / target - 1) <= abs(ratio(hi) / target - 1) else hi
    return k, (ratio(lo), ratio(hi))


def _tables(
    goal: Goal, options: list[dict[str, object]]
) -> tuple[Callable[[float], float], list[tuple[int, int, int]], float]:
    """The plan's ratio (of the goal's scope) as a function of the table factor `k`, the
    `hashed="auto"` tables as `(entry index, tiles, positions per tile)`, and the `k` of one
    bucket per position."""
    entries, flags, _, scope, stored = goal
    weights, spent = 0, 0  # generated weights, and g-net parameters other than auto tables
    kept = 0  # parameters that stay free
    auto: list[tuple[int, int, int]] = []  # (entry index, tiles, positions per tile)
    for index, (entry, opts) in enumerate(zip(entries, options, strict=True)):
        if free_reason(entry, opts, flags) is not None:
            kept += math.prod(entry.shape)
            continue
        shape, layout, window = entry.shape, entry.layout, entry.shape[2:]
        sized = opts["hashed"] == AUTO
        genome = genome_for({**opts, "hashed": 0} if sized else opts, window, layout)
        weights += math.prod(shape)
        for rows, cols in block_shapes(shape, layout.splits, layout.split_dim):
            tile = tile_for(entry.name, opts, rows, cols, genome.outputs, layout)
            spent += block_cost(genome, window, rows, cols, tile)
            if sized:
                positions = tile[0] * tile[1] * math.prod(window)
                auto.append((index, math.prod(tile_grid(rows, cols, tile)), positions))

    if not auto:
        asked = [(e, o) for e, o in zip(entries, options, strict=True) if o["hashed"] == AUTO]
        entry, opts = asked[0]
        raise ValueError(
            f"gb.plan: hashed='auto' reaches only parameters that stay free, so it has no table "
            f"to size: {entry.name} {entry.shape} is free ({free_reason(entry, opts, flags)})"
            f"{f' and {len(asked) - 1} more' if len(asked) > 1 else ''}. Give it to generated "
            "weights, or generate these."
        )
    measure = _Ratio(scope == "model", kept, stored)

    def ratio(k: float) -> float:
        return measure(weights, spent + sum(tiles * _buckets(k, p) for _, tiles, p in auto))

    return ratio, auto, max(p ** (1 - TABLE_EXPONENT) for _, _, p in auto)
