"""`gb.plan`: build the plan of a model from its parameters, its rules and the options."""

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace

from torch import nn

from ._check_model import check_module
from ._entries import (
    Entry,
    check_labels,
    collect,
    free_reason,
    genome_for,
    param_cost,
    tile_for,
)
from ._genome import AUTO, Genome, check_genome
from ._numbers import integer, real
from ._options import (
    DEFAULT_TILE,
    check_free_kept,
    check_patterns,
    check_tile,
    normalise_overrides,
    resolve,
    warn_dropped,
    warn_unused,
)
from ._plan import (
    Block,
    Free,
    Generated,
    Plan,
    Stack,
    block_shapes,
    stack_geometry,
    tile_buckets,
    tile_grid,
)
from ._rules import Layout, free_init, step_scale, weight_fan_in
from ._search import SCOPES, Goal, UnreachableError, search_tile, size_tables


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
    window_in: str = "code",
    share: bool = False,
    embed_dim: int = 8,
    row_labels: str | tuple[int, ...] = "position",
    col_labels: str | tuple[int, ...] = "position",
    hashed: int | str = 0,
    condition: int = 0,
    tasks: int = 0,
    embeddings: bool = False,
    biases: bool = False,
    center: bool = False,
    compression: float | None = None,
    compression_of: str = "model",
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
        hidden: Width of every g-net hidden layer (the g-net architecture options that
            follow are `gb.Genome`'s fields, documented there).
        depth: Number of hidden layers.
        activation: The g-nets' nonlinearity.
        encoding: How positions are coded: `"binary"`, `"gray"` or `"fourier"`.
        fourier_features: Frequencies per axis for `encoding="fourier"`.
        outputs: Weights emitted per evaluation along a tile row.
        window_in: Where a convolution's kernel window goes: `"code"` or `"output"`.
        share: One g-net per weight matrix, shared by its tiles.
        embed_dim: Width of the per-tile embedding when `share=True`.
        row_labels: Labels of the output neurons: `"position"`, `"onehot"` or a grid.
        col_labels: Labels of the input neurons, as `row_labels`.
        hashed: Buckets of a per-tile HashedNets table, or `"auto"` (here or per parameter
            in `overrides`) to size the tables so that the plan reaches `compression`.
        condition: Width of a condition vector every g-net reads (`gb.Genome.condition`):
            one genome then generates a weight set per condition, `gb.apply(gparams, plan,
            condition=z)` or, with learned task embeddings (`tasks=n` below), `task=i`. An
            override `{"condition": 0}` leaves a layer unconditioned.
        tasks: Learned task embeddings of width `condition` that `gb.init` draws into
            `gparams["tasks"]` and `gb.apply(..., task=i)` reads (continual or multi-task
            learning: one genome, a weight set per task).
        embeddings: Generate `nn.Embedding` tables too.
        biases: Generate the biases of generated layers too, each by its own g-net on the
            layer's output-neuron labels (at high ratios free biases dominate the count);
            those a rule marks as biases: linear and convolution layers', not transformers'
            `Conv1D`'s or attention's fused in-projection bias.
        center: Remove each generated weight row's mean over its inputs (see `Generated`);
            with neuron labels it makes image-input genomes train stably.
        compression: The ratio to reach, within 10%: by default the whole model's, its
            parameters / the parameters stored (g-nets, free and frozen ones, frozen ones
            stored but not trained; `gb.report(plan).compression`). With `hashed="auto"`
            somewhere, by sizing those tables (each tile's buckets in proportion to the
            square root of its positions), with the tile given, or else the first of
            (64, 64), (128, 128), ... and "full" that can reach it; otherwise by choosing the
            `(TH, TW)` tile of every weight whose tile is not given (the squarest within 2%,
            or one about as square whose g-nets evaluate 5% fewer vectors; a weight whose
            g-nets would cost more than itself stays free), and then it is exclusive with
            `tile`.
        compression_of: `"model"` (default) for the whole model's ratio, or `"generated"`
            for generated weights / g-net parameters (`gb.report(plan).generated_compression`,
            the count of the genomic bottleneck papers and torchGB).
        overrides: `{name_pattern: {option: value}}` (fnmatch on parameter names, applied in
            order) with options `tile`, `generate`, `center` and any `gb.Genome` field, or
            `{name_pattern: "free"}`.
        free: Name patterns of parameters to leave free.

    Returns:
        A frozen, hashable `Plan`.

    Examples:
        >>> plan = gb.plan(nn.Linear(256, 128), tile=(32, 32))
        >>> plan.stacks[0].num_tiles
        32
    """
    check_module(model, "gb.plan")
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
        "window_in": window_in,
        "share": share,
        "embed_dim": embed_dim,
        "row_labels": row_labels,
        "col_labels": col_labels,
        "hashed": hashed,
        "condition": condition,
    }
    base = check_genome(base, "gb.plan")
    rules = normalise_overrides(overrides, free)
    entries = collect(model)
    check_patterns(rules, [e.name for e in entries], _tied_names(model))
    options = [resolve(e.name, base, rules) for e in entries]
    check_free_kept(free, [e.name for e in entries], options)
    for flag, value in (("biases", biases), ("embeddings", embeddings), ("center", center)):
        if not isinstance(value, bool):
            raise TypeError(f"gb.plan: {flag} must be a bool, got {value!r}.")
    flags = {"embeddings": embeddings, "biases": biases}
    compression = real("gb.plan", "compression", compression, minimum=1, optional=True)
    if compression_of not in SCOPES:
        raise ValueError(
            f"gb.plan: compression_of must be one of {', '.join(map(repr, SCOPES))}, got "
            f"{compression_of!r}."
        )
    if compression is None and compression_of != "model":
        raise ValueError(
            f"gb.plan: compression_of={compression_of!r} says which ratio compression= "
            "reaches; pass compression=<ratio> with it (without one, no ratio is sought)."
        )
    tasks = integer("gb.plan", "tasks", tasks, minimum=0)
    reasons = [free_reason(e, o, flags) for e, o in zip(entries, options, strict=True)]
    _check_generates(model, reasons)
    # The task table is (tasks, width), the width of whichever generated layers read a
    # condition: the top-level one or an override's (one width in all, `_check_condition`).
    width = max(
        (o["condition"] for o, r in zip(options, reasons, strict=True) if r is None),
        default=0,
    )
    task_params = tasks * width
    goal = (
        None
        if compression is None
        else Goal(entries, flags, compression, compression_of, task_params)
    )
    options = _compress(goal, options, tile is not None)
    result = replace(_build(entries, options, flags), tasks=tasks).naming(model)
    # the options of an override shape the g-nets of the parameters it matches that are not free
    # whatever their g-nets: generated, or left free by the search for what those would cost
    shaped = {e.name for e, r in zip(entries, reasons, strict=True) if r is None}
    warn_unused(rules, shaped, {p.name: p.reason for p in result.free if p.name not in shaped})
    warn_dropped(rules, result)
    _warn_constant(entries, result)
    _check_stored_size(result)
    _check_condition(result)
    return result


def _warn_constant(entries: list[Entry], plan: Plan) -> None:
    """Warn of generated weights that are constant in the model (zero-initialised, say): with
    no std to measure they start at their rule's (`start_scale`), not at that value. Biases
    are left out: layers zero theirs by default (attention's), and `biases=True` asks."""
    generated = {p.name for p in plan.generated}
    constant = [e.name for e in entries if e.constant and e.name in generated and not e.layout.bias]
    if constant:
        more = ", ..." if len(constant) > 4 else ""
        warnings.warn(
            f"gb.plan: {', '.join(constant[:4])}{more} is constant in the model (zero-"
            "initialised, say); generated, it starts at its rule's std, not at that value. "
            "Pass overrides={name: {'generate': False}} to keep it as it is.",
            UserWarning,
            stacklevel=3,
        )


def _check_generates(model: nn.Module, reasons: list[str | None]) -> None:
    """Refuse a model with no parameter to generate (`reasons`: why each stays free, `None`
    where it is generated), before `compression=` searches for one."""
    if not reasons:
        raise ValueError(f"gb.plan: {type(model).__name__} has no parameters to generate.")
    if None not in reasons:
        raise ValueError(
            f"gb.plan: {type(model).__name__} has no parameter to generate: every parameter is "
            f"free ({'; '.join(sorted(set(reasons))[:4])}). Register a rule with "
            "gb.register_rule, or pass embeddings=True for embeddings."
        )


def _check_condition(plan: Plan) -> None:
    """Every conditioned stack reads the one condition vector `gb.apply` takes, and task
    embeddings need one."""
    widths = {s.genome.condition for s in plan.stacks} - {0}
    if len(widths) > 1:
        raise ValueError(
            f"gb.plan: the layers read conditions of widths {sorted(widths)}; one condition "
            "vector feeds every g-net, so an override may only turn it off ({'condition': 0})."
        )
    if plan.tasks and not widths:
        raise ValueError(
            f"gb.plan: tasks={plan.tasks} needs a condition for the task embeddings to feed: "
            "pass condition=<width> (e.g. 8), and leave at least one generated layer conditioned."
        )


# A plan whose g-nets outweigh the weights they generate is refused from this many stored
# parameters on (64 MiB in float32): small expanding plans are common in tests and demos, a
# large one is a typo (`hidden=10**9`) that `gb.init` would try to allocate.
# `hashed="auto"` without `tile=`: the tiles tried in turn until the tables can reach the
# target (a tile's g-net costs parameters however few buckets it has, so small tiles cap it).
TABLE_TILES = (DEFAULT_TILE, (128, 128), (256, 256), (512, 512), (1024, 1024), "full")
MAX_EXPANDING_PARAMS = 1 << 24


def _check_stored_size(plan: Plan) -> None:
    """Raise `ValueError` where the g-nets would hold more parameters than both the weights
    they generate and `MAX_EXPANDING_PARAMS`: before `gb.init` allocates them."""
    table = plan.tasks * plan.condition if plan.tasks else 0  # the task embeddings
    stored = sum(s.num_params for s in plan.stacks) + table
    generated = sum(p.numel for p in plan.generated)
    if stored <= max(generated, MAX_EXPANDING_PARAMS):
        return
    largest = max(plan.stacks, key=lambda s: s.num_params)
    if table > largest.num_params:
        raise ValueError(
            f"gb.plan: the genome would hold {stored:,} parameters to generate {generated:,} "
            f"weights, {table:,} of them task embeddings (tasks={plan.tasks} x condition="
            f"{plan.condition}); lower tasks or condition."
        )
    genome = largest.genome
    raise ValueError(
        f"gb.plan: the g-nets would hold {stored:,} parameters to generate {generated:,} "
        f"weights (stack {largest.key}: hidden={genome.hidden}, depth={genome.depth}, "
        f"outputs={genome.outputs}, hashed={genome.hashed}, condition={plan.condition}, "
        f"tile={largest.tile}); lower hidden, depth, outputs, hashed or condition, or use "
        "larger tiles."
    )


def _check_outputs_are_rows(name: str, layout: Layout, genome: Genome, center: bool) -> None:
    """Refuse what reads a weight's rows as its output neurons on one stored the other way
    round (transformers' `Conv1D`): it would centre, or label, the inputs instead."""
    labels = genome.row_labels != "position" or genome.col_labels != "position"
    if layout.inputs_first and (center or labels):
        what, off = (
            ("center=True", "'center': False")
            if center
            else ("neuron labels", "'row_labels': 'position', 'col_labels': 'position'")
        )
        raise ValueError(
            f"gb.plan: {name} is stored (inputs, outputs), and {what} read a weight's rows as "
            f"its output neurons: they would act on its inputs. Turn them off for it: "
            f"overrides={{{name!r}: {{{off}}}}}."
        )


def _compress(
    goal: Goal | None, options: list[dict[str, object]], tile_given: bool
) -> list[dict[str, object]]:
    """`options` with the hashed tables sized, or the tiles chosen, to reach `goal` (None:
    no compression= asked)."""
    if any(o["hashed"] == AUTO for o in options):
        if goal is None:
            raise ValueError(
                "gb.plan: hashed='auto' sizes the tables to reach compression=; pass "
                "compression=, or give hashed= a number of buckets."
            )
        if tile_given:
            return size_tables(goal, options)
        for tile in TABLE_TILES:  # the first tile whose tables can reach the target
            chosen = {"tile": tile, "tile_chosen_by": "tables"}
            tiled = [o if o.get("explicit_tile") else {**o, **chosen} for o in options]
            try:
                return size_tables(goal, tiled)
            except UnreachableError as e:
                unreachable = e
        raise unreachable
    if goal is None:
        return options
    if tile_given:
        raise ValueError("gb.plan: pass either tile or compression, not both.")
    return search_tile(goal, options)


def _build(entries: list[Entry], options: list[dict[str, object]], flags: dict[str, bool]) -> Plan:
    params: list[Generated | Free] = []
    stacks = _Stacks()
    for entry, opts in zip(entries, options, strict=True):
        shape, layout = entry.shape, entry.layout
        reason = free_reason(entry, opts, flags)
        genome = None if reason is not None else genome_for(opts, shape[2:], layout)
        if genome is not None and opts.get("tile_chosen_by") == "search":
            blocks = tuple(block_shapes(shape, layout.splits, layout.split_dim))
            spent = param_cost(genome, shape[2:], blocks, opts["tile"])
            if spent >= math.prod(shape):
                reason = f"its g-nets would cost {spent:,} parameters for {math.prod(shape):,}"
        if reason is not None:
            init = free_init(entry.module, entry.local, shape)
            params.append(Free(entry.name, shape, entry.dtype, init, entry.trainable, reason))
            continue
        stack_id, blocks = None, []
        for rows, cols in block_shapes(shape, layout.splits, layout.split_dim):
            tile = tile_for(entry.name, opts, rows, cols, genome.outputs, layout)
            check_labels(entry.name, genome, rows, cols, tile)
            stack_id, block = stacks.add(genome, tile, shape[2:], rows, cols, entry.dtype)
            blocks.append(block)
        split_dim = layout.split_dim if layout.splits > 1 else 0
        # a bias, or a weight of one input per row, has no inputs to centre over (centred,
        # it would be zero, and stay zero: its gradient is centred too)
        center = opts["center"] and math.prod(shape[1:]) > 1
        _check_outputs_are_rows(entry.name, layout, genome, center)
        where = {"stack_index": stack_id, "blocks": tuple(blocks), "split_dim": split_dim}
        scale = step_scale(layout.init_std, shape, layout.inputs_first)
        fan_in = weight_fan_in(shape, layout.inputs_first)
        params.append(
            Generated(
                entry.name,
                shape,
                entry.dtype,
                **where,
                scale=scale,
                fan_in=fan_in,
                center=center,
                start=1.0 if scale == layout.init_std else layout.init_std / scale,
            )
        )
    return Plan(tuple(params), stacks.stacks())


class _Stacks:
    """The stacks of a plan being built: blocks of equal genome, tile, window and dtype share
    one."""

    def __init__(self) -> None:
        self._index: dict[tuple, int] = {}
        self._specs: list[tuple] = []  # (genome, tile, window, geometry) per stack
        self._tiles: list[list[int]] = []  # tiles per g-net, per stack

    def add(
        self,
        genome: Genome,
        tile: tuple[int, int],
        window: tuple[int, ...],
        rows: int,
        cols: int,
        dtype: str,
    ) -> tuple[int, Block]:
        """Lay a `rows x cols` block out as the next tiles of its stack: `(stack, block)`.
        Weights of different dtypes never share a stack, whose leaves (and so whose weights)
        are of one dtype."""
        genome = replace(genome, hashed=tile_buckets(genome, tile, window))
        spec = (genome, tile, window, stack_geometry(genome, tile, window))
        key = (*spec, dtype)
        if key not in self._index:
            self._index[key] = len(self._specs)
            self._specs.append(spec)
            self._tiles.append([])
        stack = self._index[key]
        grid = tile_grid(rows, cols, tile)
        first, count = sum(self._tiles[stack]), grid[0] * grid[1]
        self._tiles[stack].extend([count] if genome.share else [1] * count)
        return stack, Block(rows, cols, grid, first)

    def stacks(self) -> tuple[Stack, ...]:
        return tuple(
            Stack(
                key=f"s{i}_{tile[0]}x{tile[1]}"
                + (f"k{'x'.join(map(str, window))}" if window else ""),
                genome=genome,
                tile=tile,
                window=window,
                outputs=geometry[0],
                columns=geometry[1],
                row_width=geometry[2],
                col_width=geometry[3],
                tiles_per_gnet=tuple(self._tiles[i]),
            )
            for i, (genome, tile, window, geometry) in enumerate(self._specs)
        )


def _tied_names(model: nn.Module) -> dict[str, str]:
    """`{second name: first name}` of every parameter registered under more than one name
    (a tied head): the plan knows it by its first."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            tied[name] = first[id(param)]
    return tied
