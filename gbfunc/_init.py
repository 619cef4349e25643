"""`gb.init`: draw the g-net stacks and free parameters of a plan, reproducibly."""

import bisect
import contextlib
import itertools
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch
from torch import Tensor, nn

from ._check_gparams import TASKS
from ._check_model import check_matches
from ._numbers import integer
from ._plan import TILE_LEAVES, Free, Generated, Plan, Stack, shared_dtype
from ._spec import HASH_GAIN, reference, stack_terms
from ._tree import GParams
from .generate.torch_ops import CHUNK_ELEMENTS, tile_chunks

VALUES = ("model", "draw")
# Draws of a stack before a g-net constant over its positions is given up on: with few hidden
# units and tiles, every unit can start dead (or linear, where odd-tied units cancel) on each
# tile, and its weights would start equal: a stack of 4 shared ReLU units on 2 tiles did so
# on 34 seeds in 200, and on none when drawn again.
DRAWS = 8
# The dtypes g-nets generate in: torch's matmuls take no float8 (`gb.apply` would fail).
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def init(
    plan: Plan,
    seed: int = 0,
    *,
    values: str = "model",
    model: nn.Module | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    requires_grad: bool = True,
) -> GParams:
    """Draw g-net parameters for `plan` so generated weights start at the p-net's own scale.

    G-nets are drawn with fan-in scaling, then each tile's output layer is shifted and scaled
    so its raw output has zero mean and std `Generated.start` (1 but for weights drawn above a
    fan-in init, such as embeddings; data-dependent init, computed exactly in float64);
    `gb.apply` multiplies it by `Generated.scale`, so the weight starts at the std of the
    model's own (`scale * start`). A g-net that sees one position (a tile of one row and
    one column of evaluations) is a constant and starts as drawn values; a stack whose g-net
    starts constant over its positions (every unit inactive) is drawn again (`DRAWS`).
    Free and frozen parameters start from the model's own tensors, copied: its
    initialisation (a library's `_init_weights` included) or pretrained values, bitwise;
    a parallelized model's DTensors whole (then call it on every rank: it gathers them).
    Without a model that has values (a plan made on `meta` or read from a checkpoint, or
    `values="draw"`) they are drawn as their modules' `reset_parameters` would for the common
    layers (linear, convolution, embedding, attention, transformers' `Conv1D`), and as ones
    (other 1-D weights), zeros (other 1-D) or N(0, 0.02) (the rest) elsewhere.

    Args:
        plan: From `gb.plan`.
        seed: Same seed, same tensors, bitwise (drawn on the CPU, then moved).
        values: `"model"`: free and frozen parameters copy the model's; `"draw"`: drawn.
        model: Where `"model"` values come from; default the model the plan was made from.
        dtype: Floating dtype of every floating leaf (integer frozen parameters keep theirs):
            float16, bfloat16, float32 or float64.
            None: the model's, so that a bfloat16 model gets bfloat16 weights: a stack's
            leaves take the dtype of the weights it generates, free and frozen parameters
            keep theirs, task embeddings take the generated weights' (float32 where the
            weights' dtypes differ).
        device: Where the leaves live; default torch's default device, as for any tensor
            made without one (the CPU, unless `with torch.device(...)` or
            `torch.set_default_device` says otherwise). `"meta"`: empty leaves of the same
            shapes and dtypes, nothing drawn or evaluated. Elsewhere the leaves are drawn and
            the tiles evaluated on the CPU in chunks, so memory stays within a few times the
            largest stack's weights, then moved.
        requires_grad: Mark trainable leaves `requires_grad` (for `torch.optim` and
            `.backward()`); pass False for purely functional training with `torch.func`.

    Returns:
        The dict `{"stacks": {key: {leaf: Tensor}}, "free": {name: Tensor}, "frozen":
            {name: Tensor}}`, and `"tasks"` (the task embeddings `(tasks, condition)`, drawn
            from N(0, 1)) where the plan has them (`gb.plan(..., tasks=n)`).

    Examples:
        >>> gparams = gb.init(gb.plan(nn.Linear(64, 32), tile=(16, 16)), seed=0)
        >>> sorted(gparams)
        ['free', 'frozen', 'stacks']
    """
    if not isinstance(plan, Plan):
        raise TypeError(
            f"gb.init: plan must be a gb.Plan (from gb.plan), got {type(plan).__name__}."
        )
    if dtype is not None and dtype not in DTYPES:
        raise TypeError(
            f"gb.init: dtype must be one of {', '.join(map(str, DTYPES))} or None, got {dtype!r}."
        )
    seed = integer("gb.init", "seed", seed, minimum=-(2**63), maximum=2**64 - 1)  # torch's range
    source = _value_source(plan, values, model)
    default = torch.get_default_device()
    device = default if device is None else torch.device(device)
    if device.type == "meta":
        return _on_meta(plan, dtype, requires_grad)
    # Drawn on the CPU whatever the default device, then moved (the context's function mode
    # would slow every op where the default already is the CPU).
    on_cpu = contextlib.nullcontext() if default.type == "cpu" else torch.device("cpu")
    with on_cpu:
        return _drawn(plan, seed, dtype, device, requires_grad, source)


def _drawn(
    plan: Plan,
    seed: int,
    dtype: torch.dtype | None,
    device: torch.device,
    requires_grad: bool,
    source: Mapping[str, Tensor] | None,
) -> GParams:
    """`init`'s leaves, drawn on the CPU from `seed` (free ones copied from `source` where
    given) and moved to `device`."""
    gen = torch.Generator().manual_seed(seed)

    def finish(x: Tensor, trainable: bool, kind: torch.dtype) -> Tensor:
        x = x.to(dtype=kind if x.is_floating_point() else x.dtype, device=device)
        return x.requires_grad_(trainable and requires_grad)

    # Each stack is cast and moved once drawn, so only one stack's float64 leaves are alive.
    stacks = {}
    for i, s in enumerate(plan.stacks):
        kind = _leaf_dtype(dtype, plan.generated_by(i))
        for _ in range(DRAWS):  # again where a g-net starts constant (see `DRAWS`)
            leaves, constant = _init_stack(s, gen, _starts(plan, i))
            if not constant:
                break
        else:
            _warn_constant(plan, i, constant, seed)
        stacks[s.key] = {n: finish(v, True, kind) for n, v in leaves.items()}
    free: dict[str, Tensor] = {}
    frozen: dict[str, Tensor] = {}
    for p in plan.free:
        if source is not None:
            value = source[p.name].detach()
            if hasattr(value, "full_tensor"):  # a DTensor of a parallelized model: all of it
                value = value.full_tensor()  # (a collective: every rank calls gb.init)
            # Copied straight to where the leaf will live (no round trip through the CPU).
            value = value.to(device, copy=True)
        else:
            value = _draw_free(p.init, p.shape, gen)
            if not getattr(torch, p.dtype).is_floating_point:  # integer and bool keep theirs
                value = value.to(getattr(torch, p.dtype))
        kind = _leaf_dtype(dtype, (p,))
        (free if p.trainable else frozen)[p.name] = finish(value, p.trainable, kind)
    gparams = {"stacks": stacks, "free": free, "frozen": frozen}
    if plan.tasks:  # drawn last, so that a plan's other leaves do not depend on it
        table = _normal((plan.tasks, plan.condition), 1.0, gen)
        gparams[TASKS] = finish(table, True, _leaf_dtype(dtype, plan.generated))
    return gparams


def _leaf_dtype(dtype: torch.dtype | None, params: Iterable[Generated | Free]) -> torch.dtype:
    """The floating dtype of leaves standing for `params`: `dtype` where given, else theirs."""
    return shared_dtype(params) if dtype is None else dtype


def _on_meta(plan: Plan, dtype: torch.dtype | None, requires_grad: bool) -> GParams:
    """The leaves `init` returns, as empty `meta` tensors of the same shapes and dtypes:
    nothing is drawn, evaluated or copied, so a plan of any size costs no memory (to trace
    `gb.apply` or size a model before allocating it)."""

    def empty(shape: tuple[int, ...], kind: torch.dtype, trainable: bool) -> Tensor:
        x = torch.empty(shape, dtype=kind, device="meta")
        return x.requires_grad_(trainable and requires_grad)

    stacks = {}
    for i, s in enumerate(plan.stacks):
        kind = _leaf_dtype(dtype, plan.generated_by(i))
        stacks[s.key] = {n: empty(shape, kind, True) for n, shape in s.leaf_shapes().items()}
    free: dict[str, Tensor] = {}
    frozen: dict[str, Tensor] = {}
    for p in plan.free:
        own = getattr(torch, p.dtype)  # integer and bool keep theirs
        kind = _leaf_dtype(dtype, (p,)) if own.is_floating_point else own
        (free if p.trainable else frozen)[p.name] = empty(p.shape, kind, p.trainable)
    gparams = {"stacks": stacks, "free": free, "frozen": frozen}
    if plan.tasks:
        gparams[TASKS] = empty(
            (plan.tasks, plan.condition), _leaf_dtype(dtype, plan.generated), True
        )
    return gparams


def _value_source(plan: Plan, values: str, model: nn.Module | None) -> dict[str, Tensor] | None:
    """The model's parameters by name, when `values="model"` and the model has values."""
    if values not in VALUES:
        raise ValueError(f"gb.init: values must be one of {VALUES}, got {values!r}.")
    if model is not None:
        check_matches(plan, model, "gb.init", "the plan")
    elif values == "model" and (model := plan.model()) is not None:
        try:  # changed since gb.plan read it? (not its dtypes: values are cast)
            check_matches(plan, model, "gb.init", "the plan", dtypes=False)
        except ValueError as error:
            raise ValueError(
                f"{error} The model was changed after gb.plan read it; make the plan again."
            ) from None
    if values == "draw" or model is None:
        return None
    params = dict(model.named_parameters())
    if any(params[p.name].is_meta for p in plan.free):
        return None
    return params


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64).mul_(std)  # one buffer


def _starts(plan: Plan, index: int) -> Tensor:
    """The std each tile of stack `index` starts at in units of its parameter's `scale`
    (`Generated.start`), float64 `(T,)`."""
    stack = plan.stacks[index]
    starts = torch.ones(stack.num_tiles, dtype=torch.float64)
    for p in plan.generated_by(index):
        if p.start != 1.0:
            for b in p.blocks:
                starts[b.first_tile : b.first_tile + b.grid[0] * b.grid[1]] = p.start
    return starts


def _warn_constant(plan: Plan, index: int, gnets: list[int], seed: int) -> None:
    """Warn that the parameters of stack `index` that `gnets` generate start constant."""
    owner = plan.stacks[index].gnet_of_tile
    names = [
        p.name
        for p in plan.generated_by(index)
        if any(owner[b.first_tile] in gnets for b in p.blocks)
    ]
    warnings.warn(
        f"gb.init: {', '.join(names)} start constant at seed {seed}: every hidden unit of "
        "the g-nets generating them is inactive at each of their positions, so their weights "
        "would start equal (and a ReLU g-net learns nothing through dead units). Use another "
        "seed or more hidden units.",
        stacklevel=3,
    )


def _init_stack(
    stack: Stack, gen: torch.Generator, starts: Tensor
) -> tuple[dict[str, Tensor], list[int]]:
    """A stack's leaves, its raw tiles at std `starts` (per tile, `_starts`), and the g-nets
    whose output is constant over their positions at init (`_normalise_outputs`)."""
    genome = stack.genome
    shapes = stack.leaf_shapes()
    fan_in = stack.row_width + stack.col_width + (genome.embed_dim if genome.share else 0)
    leaves: dict[str, Tensor] = {}
    for name, shape in shapes.items():
        if name in ("w_in", "w_embed"):
            leaves[name] = _normal(shape, 1 / math.sqrt(fan_in), gen)
        elif name == "w_hidden":
            leaves[name] = _normal(shape, math.sqrt(2 / genome.hidden), gen)
        elif name == "w_out":
            leaves[name] = _normal(shape, 1 / math.sqrt(genome.hidden), gen)
        elif name == "tile_embed":
            leaves[name] = _normal(shape, 1.0, gen)
        else:
            leaves[name] = torch.zeros(shape, dtype=torch.float64)
    # One evaluation position per tile: its codes are zero, where tying units odd in them
    # (`_make_odd`) would zero every output.
    single = stack.tile[0] * stack.columns == 1
    if genome.depth == 1 and genome.activation != "tanh" and not single:
        _make_odd(leaves, stack.row_width)
    constant: list[int] = []
    if not genome.hashed and single and stack.num_tiles == stack.num_gnets:
        # A g-net of one constant input is a constant: it starts as the values it stands for
        # would, from its output bias (hidden units at zero bias and codes give exactly zero).
        leaves["b_out"] = _standardised(_normal(shapes["b_out"], 1.0, gen))
    elif not genome.hashed:
        constant = _normalise_outputs(stack, leaves)
        if bool((starts != 1).any()):  # a g-net's tiles are one parameter's: one start each
            owner = torch.tensor(stack.gnet_of_tile)
            per_gnet = torch.ones(stack.num_gnets, dtype=torch.float64).index_copy_(
                0, owner, starts
            )
            leaves["w_out"] = leaves["w_out"] * per_gnet[:, None, None]
            leaves["b_out"] = leaves["b_out"] * per_gnet[:, None]
    else:
        # Start as HashedNets does, the table carrying the tile's variance (std `start`, 1 but
        # for weights drawn above a fan-in init), and the g-nets at zero output (so
        # normalising it is moot), to learn what the sharing misses: better than an even split
        # of the variance (measured: benchmarks/results/design_measurements.md).
        table = _standardised(_normal(shapes["tile_hash"], 1.0, gen))
        leaves["tile_hash"] = table * starts[:, None] / HASH_GAIN
        leaves["w_out"].zero_()
        leaves["b_out"].zero_()
    return leaves, constant


def _standardised(x: Tensor) -> Tensor:
    """`x` `(N, K)` at exactly zero mean and unit std per row, as the g-nets' tiles start
    (left as drawn where a row holds one value)."""
    if x.shape[1] < 2:
        return x
    return (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)


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


def _normalise_outputs(stack: Stack, leaves: dict[str, Tensor]) -> list[int]:
    """Shift and scale each g-net's output layer so its raw tiles have mean 0 and std 1;
    returns the g-nets whose output is constant (left so)."""
    positions = stack.tile[0] * stack.columns
    with torch.no_grad():
        sums, sq = _tile_moments(stack, leaves)
        counts = torch.tensor(stack.tiles_per_gnet, dtype=sums.dtype) * positions  # (G,)
        owner = torch.tensor(stack.gnet_of_tile)
        mean = torch.zeros(stack.num_gnets, stack.outputs, dtype=sums.dtype)
        mean = mean.index_add_(0, owner, sums) / counts[:, None]  # (G, P)
        # Each tile's squares about its g-net's mean: about its own, plus its mean's offset.
        sq = sq + (sums / positions - mean[owner]).square().sum(1) * positions
        var = torch.zeros(stack.num_gnets, dtype=sums.dtype).index_add_(0, owner, sq)
        std = (var / (counts * stack.outputs)).sqrt()  # (G,)
        # A g-net constant over its positions (e.g. every unit dead behind a ReLU) is left
        # unscaled: dividing by a vanishing std would blow its rounding errors up to O(1).
        constant = std < 1e-6
        std = torch.where(constant, torch.ones_like(std), std)
        leaves["b_out"] = (leaves["b_out"] - mean) / std[:, None]
        leaves["w_out"] = leaves["w_out"] / std[:, None, None]
    return constant.nonzero().flatten().tolist()


def _tile_moments(stack: Stack, leaves: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Each tile's raw output summed over its positions, `(T, P)`, and its squares about its
    own mean, `(T,)`, in float64.

    The g-nets run on pieces of at most `_budget` hidden activations: chunks of tiles
    (`tile_chunks`), and rows of a tile where one tile holds more. A tile's pieces are merged
    by Chan et al.'s pairwise update. All tiles at once held `(T, TH, Q, H)` float64 values,
    1 GiB for a 4096 x 4096 weight in 16 x 16 tiles at 8 hidden units. The moments are those
    of all tiles at once to float64 rounding (torch's kernels round some sums differently
    over fewer tiles).
    """
    rows, cols, outputs = stack.tile[0], stack.columns, stack.outputs
    hidden = cols * stack.genome.hidden  # per row of a tile
    budget = _budget(stack)
    step = max(1, budget // hidden)  # rows of a tile at once
    sums = torch.empty(stack.num_tiles, outputs, dtype=torch.float64)
    sq = torch.empty(stack.num_tiles, dtype=torch.float64)
    starts = list(itertools.accumulate(stack.tiles_per_gnet, initial=0))
    for lo, hi in tile_chunks(stack.num_tiles, rows * hidden, budget):
        terms = stack_terms(*_tile_range(stack, leaves, starts, lo, hi))
        for first in range(0, rows, step):
            piece = terms._replace(a=terms.a[:, first : first + step])
            y = reference(piece, stack.genome.activation).reshape(hi - lo, -1, outputs)
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


def _draw_free(init: tuple[str, float], shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    kind, value = init
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "uniform":
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * value
    if kind == "normal":
        return _normal(shape, value, gen)
    if kind == "normal_padded":  # nn.Embedding's own init: its padding row `value` is zero
        table = _normal(shape, 1.0, gen)
        table[int(value)] = 0.0
        return table
    raise ValueError(f"gb.init: unknown free-parameter init {kind!r}.")
