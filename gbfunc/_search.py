"""`gb.plan(compression=...)`: the tile whose compression ratio is nearest the target."""

import math

from ._entries import Entry, block_cost, free_reason, genome_for, param_cost, tile_for
from ._plan import block_shapes


def search_tile(
    entries: list[Entry],
    options: list[dict[str, object]],
    target: float,
    flags: dict[str, bool],
) -> list[dict[str, object]]:
    """Pick the `(TH, TW)` whose generated-weights / g-net-params ratio is closest to `target`.

    Costs are counted per distinct block shape, so the search over a few thousand candidate
    tiles (sizes that split some weight dimension evenly, plus powers of two) takes well
    under a second even for GPT-2-sized plans.
    """
    if not (isinstance(target, int | float) and not isinstance(target, bool) and target >= 1):
        raise ValueError(f"gb.plan: compression must be a number >= 1, got {target!r}.")
    fixed_weights, fixed = 0, 0  # weights and g-net parameters of tiles the caller fixed
    searched: dict[tuple, int] = {}  # (genome, kernel, block shapes) -> parameters like it
    for entry, opts in zip(entries, options, strict=True):
        name, shape, layout = entry.name, entry.shape, entry.layout
        if free_reason(entry, opts, flags) is not None:
            continue
        genome = genome_for(opts, shape[2:], layout)
        blocks = tuple(block_shapes(shape, layout.splits, layout.split_dim))
        if opts.get("explicit_tile"):
            fixed_weights += math.prod(shape)
            for rows, cols in blocks:
                tile = tile_for(name, opts, rows, cols, genome.outputs)
                fixed += block_cost(genome, shape[2:], rows, cols, tile)
        else:
            key = (genome, shape[2:], blocks)
            searched[key] = searched.get(key, 0) + 1
    if not searched:
        raise ValueError("gb.plan: compression= has no parameter to choose a tile for.")
    dims = {d for (_, _, blocks) in searched for shape in blocks for d in shape}
    sizes = sorted({-(-d // n) for d in dims for n in range(1, 65)} | {2**k for k in range(13)})
    sizes = [s for s in sizes if s <= max(dims)]
    # A tile narrower than `outputs` is refused by `tile_for` (a weight whose own columns are
    # fewer is refused there whatever the tile).
    widest = max(genome.outputs for genome, *_ in searched)
    widths = [s for s in sizes if s >= widest] or sizes[-1:]
    best: tuple[bool, float, tuple[int, int]] | None = None
    lo, hi, best_err = math.inf, 0.0, math.inf
    for th in sizes:
        for tw in widths:
            weights, cost = fixed_weights, fixed
            for (genome, kernel, blocks), count in searched.items():
                spent = param_cost(genome, kernel, blocks, (th, tw))
                size = sum(r * c for r, c in blocks) * math.prod(kernel)
                if spent < size:  # otherwise it stays free (as the plan builder decides)
                    weights, cost = weights + count * size, cost + count * spent
            if cost == 0:
                continue
            ratio = weights / cost
            lo, hi = min(lo, ratio), max(hi, ratio)
            err = abs(ratio / target - 1)
            # Within 2% of the target, prefer the squarest tile; otherwise the closest ratio.
            rank = (err > 0.02, abs(math.log(th / tw)) if err <= 0.02 else err, (th, tw))
            if best is None or rank[:2] < best[:2]:
                best, best_err = rank, err
    if best is None or best_err > 0.10:
        raise ValueError(
            f"gb.plan: compression={target} cannot be reached within 10% with these g-nets: tiles "
            f"give {lo:.2f}x to {hi:.2f}x. Change hidden/depth, use share=True for higher "
            "ratios, or pass tile= directly."
        )
    tile = best[2]
    return [o if o.get("explicit_tile") else {**o, "tile": tile, "searched": True} for o in options]
