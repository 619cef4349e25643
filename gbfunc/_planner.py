"""`gb.plan`: build the plan of a model from its parameters, its rules and the options."""

import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace

from torch import nn

from ._entries import (
    Entry,
    check_labels,
    collect,
    free_reason,
    genome_for,
    param_cost,
    tile_for,
)
from ._genome import check_genome
from ._model import check_module
from ._options import DEFAULT_TILE, check_patterns, check_tile, normalise_overrides, resolve
from ._plan import Block, Free, Generated, Plan, Stack, block_shapes, stack_geometry, tile_grid
from ._rules import free_init
from ._search import search_tile


def plan(
    model: nn.Module,
    *,
    tile: tuple[int, int] | str | None = None,
    hidden: int = 32,
    depth: int = 1,
    activation: str = "relu",
    encoding: str = "binary",
    fourier_features: int = 4,
    outputs: int = 1,
    kernel: str = "code",
    share: bool = False,
    embed_dim: int = 8,
    row_labels: str | tuple[int, ...] = "position",
    col_labels: str | tuple[int, ...] = "position",
    embeddings: bool = False,
    biases: bool = False,
    center: bool = False,
    compression: float | None = None,
    overrides: Mapping[str, Mapping[str, object] | str] | None = None,
    free: Sequence[str] = (),
) -> Plan:
    """Describe how g-nets generate the weights of `model`.

    Weights of `nn.Linear`, `nn.Conv1d/2d/3d`, `nn.MultiheadAttention` (Q, K and V tiled
    separately) and transformers' `Conv1D` are generated; `nn.Embedding` tables too when
    `embeddings=True`. Biases, norms and anything without a rule stay free.

    A generated weight starts at the std of the model's own tensor, measured here (its
    init, a library's `_init_weights` or pretrained values); on the `meta` device, at the std
    its module's default initialisation gives (`start_scale`). The plan remembers `model`
    (weakly), so `gb.init` starts free and frozen parameters from its values.

    Args:
        model: Any `nn.Module`; only shapes are read (the `meta` device works).
        tile: `(TH, TW)` tile in matrix units (conv tiles span `TW` input channels and the
            whole kernel), or `"full"` for one tile per weight matrix. Clipped to smaller
            weights. Default `(64, 64)`, or chosen by `compression`.
        hidden, depth, activation, encoding, fourier_features, outputs, kernel, share,
            embed_dim, row_labels, col_labels: The g-net architecture, see `gb.Genome`.
        embeddings: Generate `nn.Embedding` tables too.
        biases: Generate the biases of generated layers too, each by its own g-net on the
            layer's output-neuron labels (at high ratios free biases dominate the count).
        center: Remove each generated weight row's mean over its inputs (see `Generated`);
            with neuron labels it makes image-input genomes train stably.
        compression: Choose the `(TH, TW)` tile (one for every weight whose tile is not given)
            so that generated weights / g-net parameters is within 10% of this ratio (the
            squarest within 2%); a weight whose g-nets would cost more than itself stays
            free. Exclusive with `tile`.
        overrides: `{name_pattern: {option: value}}` (fnmatch on parameter names, applied in
            order) with options `tile`, `generate`, `center` and any `gb.Genome` field, or
            `{name_pattern: "free"}`.
        free: Name patterns of parameters to leave free.

    Returns:
        A frozen, hashable `Plan`.

    Example:
        >>> plan = gb.plan(nn.Linear(256, 128), tile=(32, 32))
        >>> plan.stacks[0].num_tiles
        32
    """
    check_module(model, "gb.plan")
    if tile is not None and compression is not None:
        raise ValueError("gb.plan: pass either tile or compression, not both.")
    base = {
        "tile": check_tile("tile", DEFAULT_TILE if tile is None else tile),
        "generate": None,
        "center": center,
        "hidden": hidden,
        "depth": depth,
        "activation": activation,
        "encoding": encoding,
        "fourier_features": fourier_features,
        "outputs": outputs,
        "kernel": kernel,
        "share": share,
        "embed_dim": embed_dim,
        "row_labels": row_labels,
        "col_labels": col_labels,
    }
    check_genome(base, "gb.plan")
    rules = normalise_overrides(overrides, free)
    entries = collect(model)
    check_patterns(rules, [e.name for e in entries])
    options = [resolve(e.name, base, rules) for e in entries]
    for flag, value in (("biases", biases), ("embeddings", embeddings), ("center", center)):
        if not isinstance(value, bool):
            raise TypeError(f"gb.plan: {flag} must be a bool, got {value!r}.")
    flags = {"embeddings": embeddings, "biases": biases}
    if compression is not None:
        options = search_tile(entries, options, compression, flags)
    result = replace(_build(entries, options, flags), source=weakref.ref(model))
    if not result.generated:
        raise ValueError(
            f"gb.plan: {type(model).__name__} has no parameter to generate: "
            + _why_free(result)
            + " Register a rule with gb.register_rule, or pass embeddings=True for embeddings."
        )
    return result


def _build(entries: list[Entry], options: list[dict[str, object]], flags: dict[str, bool]) -> Plan:
    params: list[Generated | Free] = []
    stack_index: dict[tuple, int] = {}
    stack_tiles: list[list[int]] = []  # tiles per g-net, per stack
    stack_specs: list[tuple] = []
    stack_counts: list[int] = []
    for entry, opts in zip(entries, options, strict=True):
        name, shape, dtype, layout = entry.name, entry.shape, entry.dtype, entry.layout
        reason = free_reason(entry, opts, flags)
        if reason is not None:
            init = free_init(entry.module, entry.local, shape)
            params.append(Free(name, shape, dtype, init, entry.trainable, reason))
            continue
        kernel = shape[2:]
        genome = genome_for(opts, kernel, layout)
        if opts.get("searched"):
            spent = param_cost(
                genome,
                kernel,
                tuple(block_shapes(shape, layout.splits, layout.split_dim)),
                opts["tile"],
            )
            if spent >= math.prod(shape):
                reason = f"its g-nets would cost {spent:,} parameters for {math.prod(shape):,}"
                init = free_init(entry.module, entry.local, shape)
                params.append(Free(name, shape, dtype, init, entry.trainable, reason))
                continue
        blocks = []
        stack_id = None
        for rows, cols in block_shapes(shape, layout.splits, layout.split_dim):
            tile = tile_for(name, opts, rows, cols, genome.outputs)
            check_labels(name, genome, rows, cols, tile)
            geometry = stack_geometry(genome, tile, kernel)
            key = (genome, tile, kernel, geometry)
            if key not in stack_index:
                stack_index[key] = len(stack_specs)
                stack_specs.append(key)
                stack_tiles.append([])
                stack_counts.append(0)
            stack_id = stack_index[key]
            grid = tile_grid(rows, cols, tile)
            first = stack_counts[stack_id]
            n = grid[0] * grid[1]
            stack_counts[stack_id] += n
            stack_tiles[stack_id].extend([n] if genome.share else [1] * n)
            blocks.append(Block(rows, cols, grid, first))
        split_dim = layout.split_dim if layout.splits > 1 else 0
        center = opts["center"] and len(shape) > 1  # a bias has no inputs to centre over
        params.append(
            Generated(
                name, shape, dtype, stack_id, tuple(blocks), split_dim, layout.init_std, center
            )
        )
    stacks = tuple(
        Stack(
            key=f"s{i}_{tile[0]}x{tile[1]}" + (f"k{'x'.join(map(str, kernel))}" if kernel else ""),
            genome=genome,
            tile=tile,
            kernel=kernel,
            outputs=geometry[0],
            columns=geometry[1],
            row_width=geometry[2],
            col_width=geometry[3],
            tiles_per_gnet=tuple(stack_tiles[i]),
        )
        for i, (genome, tile, kernel, geometry) in enumerate(stack_specs)
    )
    return Plan(tuple(params), stacks)


def _why_free(p: Plan) -> str:
    reasons = sorted({f.reason for f in p.free})
    return "every parameter is free (" + "; ".join(reasons[:4]) + ")."
