"""`gb.init`: draw the g-net stacks and free parameters of a plan, reproducibly."""

import contextlib
import warnings
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from ._check_gparams import TASKS
from ._check_model import check_matches
from ._devices import checked_device
from ._numbers import integer
from ._plan import Free, Generated, Plan, check_is_plan, shared_dtype
from ._stack_init import DRAWS, init_stack, normal, raw_tiles
from ._tiling import assemble
from ._tree import GParams

VALUES = ("model", "draw")
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
    model's own (`scale * start`); a centred parameter (`center=True`) at that std once
    centred. A g-net that sees one position (a tile of one row and one column of
    evaluations) is a constant and starts as drawn values; where a tile's output starts
    constant over its positions (every unit inactive), its g-net (or, shared, its tile
    embedding) is drawn again, up to `DRAWS` draws, then named in a warning.
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
    check_is_plan(plan, "gb.init")
    if dtype is not None and dtype not in DTYPES:
        raise TypeError(
            f"gb.init: dtype must be one of {', '.join(map(str, DTYPES))} or None, got {dtype!r}."
        )
    seed = integer("gb.init", "seed", seed, minimum=-(2**63), maximum=2**64 - 1)  # torch's range
    if not isinstance(requires_grad, bool):
        raise TypeError(f"gb.init: requires_grad must be a bool, got {requires_grad!r:.100}.")
    source = _value_source(plan, values, model)
    default = torch.get_default_device()
    device = checked_device("gb.init", "device", device) or default
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
        leaves, constant = init_stack(s, gen, _starts(plan, i))
        _start_centred(plan, i, leaves)
        if constant:
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
        table = normal((plan.tasks, plan.condition), 1.0, gen)
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


def _starts(plan: Plan, index: int) -> Tensor:
    """The std each tile of stack `index` starts at in units of its parameter's `scale`
    (`Generated.start`), float64 `(T,)`."""
    stack = plan.stacks[index]
    starts = torch.ones(stack.num_tiles, dtype=torch.float64)
    for p in plan.generated_by(index):
        if p.start != 1.0:
            starts[_tiles_of(p)] = p.start
    return starts


def _tiles_of(p: Generated) -> list[int]:
    """The tiles of its stack that generate `p`."""
    return [t for b in p.blocks for t in range(b.first_tile, b.first_tile + b.num_tiles)]


def _warn_constant(plan: Plan, index: int, tiles: list[int], seed: int) -> None:
    """Warn that `tiles` of stack `index` start constant, naming their parameters."""
    dead = set(tiles)
    names = [p.name for p in plan.generated_by(index) if dead.intersection(_tiles_of(p))]
    warnings.warn(
        f"gb.init: {len(dead)} of {plan.stacks[index].num_tiles} tiles of "
        f"{', '.join(names)} start constant at seed {seed} after {DRAWS} draws: every hidden "
        "unit of their g-nets is inactive (or cancels) at each of their positions, so those "
        "weights start equal, and a ReLU g-net learns nothing through dead units. Use more "
        "hidden units.",
        stacklevel=4,
    )


def _start_centred(plan: Plan, index: int, leaves: dict[str, Tensor]) -> None:
    """Scale what generates each centred parameter of stack `index` (`center=True`) so that
    it starts at its std (`Generated.start`) once centred: centring removes each row's mean,
    a share of the variance that normalising tile by tile cannot see (the main job's MLP
    started its first layer at 0.49-0.79 of its std, by seed)."""
    centred = [p for p in plan.generated_by(index) if p.center]
    if not centred:
        return
    stack = plan.stacks[index]
    tiles_of = {p.name: _tiles_of(p) for p in plan.generated_by(index)}
    gnets_of = {name: {stack.gnet_of_tile[t] for t in ts} for name, ts in tiles_of.items()}
    raw = raw_tiles(stack, leaves)  # float64, in pieces
    for p in centred:
        shared = any(gnets_of[p.name] & g for name, g in gnets_of.items() if name != p.name)
        std = float(assemble(p, stack, raw).std()) / p.scale
        if shared or not std > 1e-6:  # g-nets that generate another parameter too
            continue
        factor, rows = p.start / std, torch.tensor(sorted(gnets_of[p.name]))
        leaves["w_out"][rows] *= factor
        leaves["b_out"][rows] *= factor
        if "tile_hash" in leaves:
            leaves["tile_hash"][torch.tensor(tiles_of[p.name])] *= factor


def _draw_free(init: tuple[str, float], shape: tuple[int, ...], gen: torch.Generator) -> Tensor:
    kind, value = init
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "ones":
        return torch.ones(shape)
    if kind == "uniform":
        return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * value
    if kind == "normal":
        return normal(shape, value, gen)
    if kind == "normal_padded":  # nn.Embedding's own init: its padding row `value` is zero
        table = normal(shape, 1.0, gen)
        table[int(value)] = 0.0
        return table
    raise ValueError(f"gb.init: unknown free-parameter init {kind!r}.")
