"""The model's parameters as the planner sees them, and what is decided for each one.

Free or generated, by which genome, in which tiles, at what cost in g-net parameters: the
plan builder (`_planner`) and the compression search (`_search`) both ask these questions.
"""

import math
from dataclasses import dataclass, replace

from torch import Tensor, nn

from ._genome import Genome
from ._options import GENOME_OPTIONS
from ._plan import stack_geometry, tile_buckets, tile_grid
from ._rules import Layout, layouts_of, rule_for


@dataclass(frozen=True)
class Entry:
    """One parameter of the model: where it lives and the rule's layout for it (if any).

    Attributes:
        name: Its name in `named_parameters()`.
        shape, dtype: Its shape, and its dtype without the `torch.` prefix.
        trainable: `requires_grad`.
        module, local: The module that holds it, and its name there.
        layout: How its rule generates it, with the start scale measured; `None`: no rule.
        constant: Under a rule, whether its values are one number throughout (a std of 0:
            it starts at the rule's std, not at that value).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    module: nn.Module
    local: str
    layout: Layout | None
    constant: bool = False


def collect(model: nn.Module) -> list[Entry]:
    """Every parameter once, under its first name. A tied one (`head.weight = emb.weight`)
    is judged by one of the modules holding it whose rule covers it, whatever their order:
    an embedding that keeps its table free (`padding_idx`, ...) if one does, so that the
    table stays free, else an embedding, else the first (a weight registered on a parent
    without a rule and shared into its layers is judged by the first layer)."""
    # per parameter, every (name, module, local name, layout) that holds it
    holders: dict[int, tuple[Tensor, list[tuple[str, nn.Module, str, Layout | None]]]] = {}
    for prefix, module in model.named_modules():
        layouts = layouts_of(module)
        for local, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{local}" if prefix else local
            held = holders.setdefault(id(param), (param, []))[1]
            held.append((name, module, local, layouts.get(local)))
    entries: list[Entry] = []
    for param, held in holders.values():  # tied: generated once, functional_call keeps the tie
        name = held[0][0]
        covered = [h for h in held if h[3] is not None]
        tables = [h for h in covered if h[3].embedding]
        kept = [h for h in tables if _kept_table(h[1]) is not None]
        _, module, local, layout = (kept or tables or covered or held)[0]
        dtype = str(param.dtype).removeprefix("torch.")
        std = None if layout is None else measured_std(param)
        if layout is not None:
            layout = replace(layout, init_std=start_scale(std, param.numel(), layout.init_std))
        shape, trainable = tuple(param.shape), param.requires_grad
        entries.append(Entry(name, shape, dtype, trainable, module, local, layout, std == 0.0))
    return entries


# A measured std within this fraction of the rule's std is taken to be the rule's, so that
# plans of equally built models agree whatever their seed; for a tensor of n values, within
# `_SNAP_DEVIATIONS / sqrt(n)` if wider: about 5.7 standard errors of the std of n normal
# draws (`1 / sqrt(2n)` relative), more for uniform ones. At 20% alone, 3 seeds in 100 of
# `nn.Linear(8, 4)` gave another plan, and a generated bias of 4 values most seeds.
_SNAP = 0.2
_SNAP_DEVIATIONS = 4.0


def measured_std(param: Tensor) -> float | None:
    """The std of `param`'s values; None where there is none to measure: on the `meta`
    device, a single value, not floating point, not finite."""
    if param.is_meta or param.numel() < 2 or not param.is_floating_point():
        return None
    std = float(param.detach().double().std())
    return std if math.isfinite(std) else None


def start_scale(std: float | None, numel: int, rule_std: float) -> float:
    """The std a generated weight of `numel` values starts at: its model tensor's own,
    measured now (`measured_std`).

    Where none was measured and for constant tensors (e.g. zero-initialised: a std of 0), the
    rule's std. A measured std within 20% of the rule's (within `4 / sqrt(n)` for a tensor of
    n < 400 values, whose std is a noisy measure) is the rule's, and others are rounded to two
    significant digits, so that equally built models with different seeds get equal plans;
    pretrained or custom-initialised weights keep their own scale.
    """
    if std is None or std == 0.0:
        return rule_std
    if abs(std / rule_std - 1) <= max(_SNAP, _SNAP_DEVIATIONS / math.sqrt(numel)):
        return rule_std
    return float(f"{std:.2g}")


def free_reason(entry: Entry, opts: dict[str, object], flags: dict[str, bool]) -> str | None:
    """Why `entry` stays free under `opts` and the plan's `flags`; `None`: it is generated."""
    name, shape, module, local, layout = (
        entry.name, entry.shape, entry.module, entry.local, entry.layout
    )  # fmt: skip
    if not entry.trainable:
        if opts["generate"]:
            raise ValueError(
                f"gb.plan: {name} was asked to be generated, but it is frozen "
                "(requires_grad=False), and generated weights train through their g-nets: "
                "unfreeze it, or do not ask."
            )
        return "frozen (requires_grad=False)"
    if entry.dtype.startswith("complex"):
        raise ValueError(
            f"gb.plan: {name} {shape} is {entry.dtype}: g-nets generate real weights and "
            "gparams hold real floating tensors; make it real (two real parameters) or freeze "
            "it (requires_grad=False)."
        )
    if math.prod(shape) == 0:
        if opts["generate"]:
            raise ValueError(
                f"gb.plan: {name} {shape} was asked to be generated, but it is empty (a "
                "dimension of size 0): there is nothing to generate."
            )
        return "empty (a dimension of size 0)"
    if layout is None:
        if opts["generate"]:
            raise ValueError(
                f"gb.plan: {name} {shape} was asked to be generated but no rule covers "
                f"{type(module).__name__}.{local}; register one with gb.register_rule."
            )
        if rule_for(module) is None:
            return f"no rule for {type(module).__name__}"
        return f"{type(module).__name__}.{local} is not generated"
    if opts["generate"] is False:
        return "left free by the caller"
    if layout.embedding and not (flags["embeddings"] or opts["generate"]):
        return "embedding (pass embeddings=True to generate)"
    kept = _kept_table(module) if layout.embedding else None
    if kept is not None:
        if opts["generate"]:
            raise ValueError(f"gb.plan: {name} was asked to be generated, but stays free: {kept}.")
        return kept
    if layout.bias and not (flags["biases"] or opts["generate"]):
        return "bias (pass biases=True to generate)"
    if len(shape) < 2 and not layout.bias:
        if opts["generate"]:
            raise ValueError(
                f"gb.plan: {name} {shape} was asked to be generated, but g-nets generate "
                f"matrices and biases, and the rule for {type(module).__name__}.{local} gives "
                "it fewer than 2 dims without gb.Layout(bias=True)."
            )
        return "fewer than 2 dims"
    return None


def _kept_table(module: nn.Module) -> str | None:
    """Why an embedding table must stay free (as `gb.report` says it), if it must: its module
    keeps a padding row at zero (no gradient reaches it), renormalises looked-up rows in
    place (`max_norm`), or gives the table a sparse gradient (`sparse=True`), none of which a
    generated table, rebuilt by every step from dense g-nets, can do."""
    padding, max_norm = getattr(module, "padding_idx", None), getattr(module, "max_norm", None)
    if padding is not None:
        return f"embedding with padding_idx={padding}, whose row must stay zero"
    if max_norm is not None:
        return f"embedding with max_norm={max_norm}, which renormalises the table in place"
    if getattr(module, "sparse", False):
        return "embedding with sparse=True, whose gradient is sparse"
    return None


def tile_for(
    name: str, opts: dict[str, object], rows: int, cols: int, outputs: int, layout: Layout
) -> tuple[int, int]:
    """The tile of a `(rows, cols)` block of parameter `name` (`layout` says whether it is a
    bias, a column of one value per row, and into how many blocks the parameter splits). An
    explicit tile larger than the block is refused; a bias takes only its rows (a tile set
    for a whole layer, weight and bias, fits the bias); a tile `compression=` chose
    (`tile_chosen_by`) leaves an axis of labelled neurons whole (`clip_tile`)."""
    tile = opts["tile"]
    if tile == "full":
        th, tw = rows, cols
    else:
        th, tw = tile
        if layout.bias:
            tw = cols
        if opts.get("tile_chosen_by"):
            th = rows if opts["row_labels"] != "position" else th
            tw = cols if opts["col_labels"] != "position" else tw
        if opts.get("explicit_tile") and (th > rows or tw > cols):
            part = (
                f"{name}'s weight matrix"
                if layout.splits == 1
                else f"each of the {layout.splits} blocks that {name} is cut into"
            )
            raise ValueError(
                f"gb.plan: tile {tile} is larger than {part} ({rows}, {cols}); use a tile that "
                "fits, or 'full'."
            )
        th, tw = min(th, rows), min(tw, cols)
    if outputs > tw:
        clipped = "" if tile == "full" or tile[1] <= cols else f" (the tile {tile} cut to it)"
        raise ValueError(
            f"gb.plan: {name}: outputs={outputs} is wider than its tile's {tw} columns"
            f"{clipped}; use outputs <= the tile width (a row of evaluations may not outgrow "
            f"the weight), for this one: overrides={{{name!r}: {{'outputs': {tw}}}}}."
        )
    return th, -(-tw // outputs) * outputs  # a whole number of evaluations per row


def genome_for(opts: dict[str, object], window: tuple[int, ...], layout: Layout) -> Genome:
    genome = Genome(**{k: opts[k] for k in GENOME_OPTIONS})
    if math.prod(window) > 1:
        genome = replace(genome, outputs=1)  # `outputs` is for matrices; kernels use `window_in`
    if layout.bias:  # one value per output neuron, labelled like its weight's rows
        genome = replace(genome, outputs=1, col_labels="position")
    return genome


def check_labels(name: str, genome: Genome, rows: int, cols: int, tile: tuple[int, int]) -> None:
    """Labels other than positions name neurons: their axis must be one tile, of matching size."""
    for axis, labels, size, span in (
        ("row_labels", genome.row_labels, rows, tile[0]),
        ("col_labels", genome.col_labels, cols, tile[1]),
    ):
        if labels == "position":
            continue
        if span != size:
            raise ValueError(
                f"gb.plan: {name} has {axis}={labels!r}, which label neurons, but its tile "
                f"{tile} splits that axis ({size}); use tile='full' for it."
            )
        if isinstance(labels, tuple) and math.prod(labels) != size:
            raise ValueError(
                f"gb.plan: {name} has {axis}={labels} ({math.prod(labels)} cells) for an axis "
                f"of {size} neurons."
            )
        if axis == "col_labels" and genome.outputs > 1:
            raise ValueError(
                f"gb.plan: {name} has col_labels={labels!r} with outputs={genome.outputs}; "
                "neuron labels on columns need outputs=1."
            )


def block_cost(
    genome: Genome, window: tuple[int, ...], rows: int, cols: int, tile: tuple[int, int]
) -> int:
    """G-net parameters that generate one block (as the plan builder lays it out)."""
    outputs, _, row_width, col_width = stack_geometry(genome, tile, window)
    tiles = math.prod(tile_grid(rows, cols, tile))
    per_gnet = genome.param_count(row_width + col_width, outputs)
    gnets = per_gnet + tiles * genome.embed_dim if genome.share else tiles * per_gnet
    return gnets + tiles * tile_buckets(genome, tile, window)


def param_cost(
    genome: Genome, window: tuple[int, ...], blocks: tuple[tuple[int, int], ...], tile: tuple
) -> int:
    """G-net parameters of a parameter with these blocks under a candidate `tile`."""
    total = 0
    for rows, cols in blocks:
        total += block_cost(genome, window, rows, cols, clip_tile(genome, rows, cols, tile))
    return total


def clip_tile(genome: Genome, rows: int, cols: int, tile: tuple) -> tuple[int, int]:
    """A candidate `tile` as a `(rows, cols)` block gets it: cut to the block, an axis of
    labelled neurons whole (`check_labels` refuses a tile that splits one), its width a whole
    number of evaluations (as `tile_for` lays it out)."""
    th = rows if genome.row_labels != "position" else min(tile[0], rows)
    tw = cols if genome.col_labels != "position" else min(tile[1], cols)
    return th, -(-tw // genome.outputs) * genome.outputs
