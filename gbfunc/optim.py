"""Optimising gparams: default learning rates, and a functional AdamW for compiled steps.

`param_groups` gives `torch.optim` (Adam/AdamW with warm-up and cosine decay, `schedule`) the
g-nets' default learning rates, which depend on the genome: g-nets with a bounded activation
(tanh) take steps ten times larger than unbounded ones (ReLU, GELU, SiLU), which diverge
there, and the hashed tables theirs (`GNET_LR`, `TABLE_LR`; measured in
`benchmarks/results/lr_rule.md`); g-nets whose weights have few inputs per output take up
to three times larger steps (`fan_in_factor`; `benchmarks/results/lr_first_layer.md`).

`torch.optim` works on gparams' leaves as on any parameters; the pure AdamW here exists so a
step (generate, forward, loss, grad, update) can run under `torch.compile(fullgraph=True)`.
The `"frozen"` group is carried through unchanged.

Examples:
    >>> model = nn.Linear(8, 2)
    >>> plan = gb.plan(model, tile=(4, 4))
    >>> gparams = gb.init(plan, requires_grad=False)  # see adamw_update
    >>> def loss_fn(gparams, x):
    ...     out = functional_call(model, gb.apply(gparams, plan), (x,))
    ...     return out.square().mean()
    >>> state = gb.optim.adamw_init(gparams)
    >>> grads = torch.func.grad(loss_fn)(gparams, torch.randn(16, 8))
    >>> gparams, state = gb.optim.adamw_update(gparams, grads, state, lr=1e-3)
"""

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map

from ._check_gparams import TASKS, check_gparams
from ._condition import COND_LEAF
from ._numbers import integer, real
from ._plan import Plan, Stack

AdamState = dict[str, Any]

# Peak learning rates of g-net leaves by activation, and of hashed tables (Adam, warm-up then
# cosine decay). tanh g-nets took 0.3 in every sweep of the paper's genome on the digits MLP;
# ReLU g-nets diverged at 0.3 on some seeds of the digits CNN; GELU and SiLU, not measured,
# count as unbounded, like ReLU.
GNET_LR = {"tanh": 0.3, "relu": 0.03, "gelu": 0.03, "silu": 0.03}
TABLE_LR = 0.03
TABLE_LEAF = "tile_hash"
# A stack's g-nets take `FULL_FAN_IN / fan-in` times their rate, between 1 and
# `MOST_FAN_IN_FACTOR`, where the fan-in is the largest of the weights it generates.
FULL_FAN_IN = 128
MOST_FAN_IN_FACTOR = 3.0


def gnet_lr(plan: Plan, stack: Stack, leaf: str) -> float:
    """The default peak learning rate of one leaf of `plan`'s `stack`: a hashed table's
    `TABLE_LR`; a g-net leaf's `GNET_LR` by activation, times `fan_in_factor`.

    Examples:
        >>> plan = gb.plan(nn.Linear(64, 256), tile="full", hidden=4)
        >>> gb.optim.gnet_lr(plan, plan.stacks[0], "w_out")  # 0.03 * 128 / 64
        0.06
    """
    if leaf == TABLE_LEAF:
        return TABLE_LR
    return GNET_LR[stack.genome.activation] * fan_in_factor(plan, stack)


def fan_in_factor(plan: Plan, stack: Stack) -> float:
    """How much larger than `GNET_LR` the g-nets of `plan`'s `stack` step: `FULL_FAN_IN`
    over the largest fan-in of the weights the stack generates, clipped to
    `[1, MOST_FAN_IN_FACTOR]`; 1 for a stack of vectors (biases).

    A generated weight is `scale * raw` with `scale` about `1 / sqrt(fan_in)`, and Adam moves
    `raw` by about the rate whatever the layer, so at one rate a layer of small fan-in (a
    small image's first layer, a 3x3 convolution's of few channels) changes its outputs
    less per step than the layers after it. On the digits MLP (64 inputs) its stack at 3x
    the rate lowered the validation loss on 10 of 10 seeds, while the same layer fed 784
    inputs gained nothing; `FULL_FAN_IN` leaves the transformers measured, whose weights
    all have fan-in 128 or more, as they were (`benchmarks/results/lr_first_layer.md`).
    """
    index = next((i for i, s in enumerate(plan.stacks) if s == stack), None)
    if index is None:
        raise ValueError(
            f"gb.optim.fan_in_factor: stack {getattr(stack, 'key', stack)!r:.100} is not one "
            "of the plan's stacks."
        )
    fan_ins = [p.fan_in for p in plan.generated_by(index) if len(p.shape) >= 2]
    if not fan_ins:
        return 1.0
    return min(MOST_FAN_IN_FACTOR, max(1.0, FULL_FAN_IN / max(fan_ins)))


def param_groups(
    gparams: dict, plan: Plan, *, free_lr: float, scale: float = 1.0
) -> list[dict[str, Any]]:
    """`torch.optim` parameter groups of `gparams`' trainable leaves at the default rates.

    One group per distinct rate: g-net leaves at `gnet_lr` (by activation and fan-in) times
    `scale`, free parameters at `free_lr` (the rate the dense model would train at), task
    embeddings at the largest rate of the g-nets they feed (an embedding and its `w_cond`
    make one product, which learns as a g-net's first layer does). Where the default does
    not hold, sweep `scale` (e.g. 1/3, 1, 3). `gparams` may be a rank's shard
    (`gb.dist.RankOwned.shard`, fewer g-nets per stack).

    Examples:
        >>> model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))
        >>> plan = gb.plan(model, tile="full", hidden=4, hashed=16)
        >>> groups = gb.optim.param_groups(gb.init(plan), plan, free_lr=1e-3)
        >>> # free, tables, g-nets of fan-in 64 (2x), of fan-in 32 (3x)
        >>> sorted(g["lr"] for g in groups)
        [0.001, 0.03, 0.06, 0.09]
        >>> opt = torch.optim.AdamW(groups)
    """
    check_gparams(gparams, plan, "gb.optim.param_groups", shard=True)
    free_lr = real("gb.optim.param_groups", "free_lr", free_lr, above=0)
    scale = real("gb.optim.param_groups", "scale", scale, above=0)
    by_rate = _leaves_by_rate(gparams["stacks"], plan, scale)
    if gparams["free"]:
        by_rate.setdefault(free_lr, []).extend(gparams["free"].values())
    if plan.tasks:
        fed = [s for s in plan.stacks if s.genome.condition]
        rate = max(gnet_lr(plan, s, COND_LEAF) for s in fed) * scale
        by_rate.setdefault(rate, []).append(gparams[TASKS])
    return [{"params": params, "lr": rate} for rate, params in by_rate.items()]


def schedule(
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    warmup: int | None = None,
    final: float = 0.1,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up to each group's peak rate, then cosine decay to `final` times it at
    `steps`: the schedule the default rates were measured with. Call its `.step()` after
    each optimizer step.

    Args:
        optimizer: Over `param_groups`' groups (or any).
        steps: Training steps.
        warmup: Warm-up steps; default a quarter of `steps`. A short warm-up lets Adam's first
            updates, taken before its second moments have settled, move a genome's
            generated embeddings far from their start, which made a transformer genome's
            result depend on the seed (`benchmarks/results/stability.md`). One longer than
            `steps` never reaches the peak (a smoke run may want that).
        final: The rate the cosine ends at, as a fraction of the peak in `[0, 1]`: reached
            after the last step (the last step itself takes a rate a little above it).

    Examples:
        >>> plan = gb.plan(nn.Linear(8, 2), tile=(4, 4))
        >>> groups = gb.optim.param_groups(gb.init(plan), plan, free_lr=1e-3)
        >>> opt = torch.optim.AdamW(groups)
        >>> sched = gb.optim.schedule(opt, steps=800)  # 200 steps of warm-up
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"gb.optim.schedule: optimizer must be a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}."
        )
    steps = integer("gb.optim.schedule", "steps", steps, minimum=1)
    warmup = max(1, steps // 4) if warmup is None else warmup
    warmup = integer("gb.optim.schedule", "warmup", warmup, minimum=1)
    final = real("gb.optim.schedule", "final", final, minimum=0)
    if final > 1:
        raise ValueError(
            f"gb.optim.schedule: final must be a fraction of the peak rate in [0, 1], got {final}."
        )

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return final + (1 - final) / 2 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _leaves_by_rate(
    stacks: Mapping[str, Mapping[str, Tensor]], plan: Plan, scale: float = 1.0
) -> dict[float, list[Tensor]]:
    """`{rate: [leaf, ...]}` of the g-net leaves `stacks` (`gparams["stacks"]`) at `gnet_lr`
    times `scale`."""
    by_rate: dict[float, list[Tensor]] = {}
    for stack in plan.stacks:
        for leaf, tensor in stacks[stack.key].items():
            by_rate.setdefault(gnet_lr(plan, stack, leaf) * scale, []).append(tensor)
    return by_rate


def _trainable(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != "frozen"}


def adamw_init(gparams: dict) -> AdamState:
    """Zero moments for every trainable leaf and a step counter.

    The counter is float64, so the bias corrections `1 - beta ** step` keep full precision
    (in float32, `1 - 0.999 ** 1` is off by 1e-4 relative) without leaving the graph. The
    moments of float16 and bfloat16 leaves are float32: in float16 a gradient below 2.4e-4
    squares to 0 and `eps` (1e-8) is 0 too, so the step divided by zero (inf leaves after
    one step, as `torch.optim.AdamW` gives there).
    """
    if not isinstance(gparams, dict) or "frozen" not in gparams:
        raise TypeError(
            f"gb.optim.adamw_init: gparams must be the dict made by gb.init, got "
            f"{type(gparams).__name__}."
        )
    zeros = tree_map(
        lambda p: torch.zeros_like(p, dtype=_moment_dtype(p.dtype), requires_grad=False),
        _trainable(gparams),
    )
    return {
        "step": torch.zeros((), dtype=torch.float64),
        "m": zeros,
        "v": tree_map(torch.clone, zeros),
    }


def adamw_update(
    gparams: dict,
    grads: dict,
    state: AdamState,
    *,
    lr: float | Tensor = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> tuple[dict, AdamState]:
    """One AdamW step (decoupled weight decay, bias-corrected), returning new trees.

    `grads` (from `torch.func.grad` of the same gparams) and `state` (from `adamw_init`) must
    hold the trainable leaves of `gparams` at their shapes: checked from the shapes alone.
    Each new leaf keeps its leaf's dtype. Unlike `torch.optim`, the step is recorded by
    autograd like any function (so a loss can be differentiated through it): train on
    `gb.init(..., requires_grad=False)`, else each step's leaves hang on to every earlier
    step's graph. The default `weight_decay` is 0 (torch's AdamW: 0.01).
    """
    if not torch.compiler.is_compiling():  # eager calls: dynamo need not trace the checks
        _check_like(gparams, grads, state)
        _check_hyperparameters(lr, betas, eps, weight_decay)
    b1, b2 = betas
    step = state["step"] + 1
    m = tree_map(lambda m, g: b1 * m + (1 - b1) * g.to(m.dtype), state["m"], _trainable(grads))
    v = tree_map(lambda v, g: b2 * v + (1 - b2) * g.to(v.dtype) ** 2, state["v"], _trainable(grads))
    c1, c2 = 1 - b1**step, 1 - b2**step

    def update(p: Tensor, m: Tensor, v: Tensor) -> Tensor:
        # a 0-dim leaf would take the float64 of the 0-dim bias corrections
        delta = lr * (m / c1) / ((v / c2).sqrt() + eps)
        return p * (1 - lr * weight_decay) - delta.to(p.dtype)

    new = tree_map(update, _trainable(gparams), m, v)
    new["frozen"] = gparams["frozen"]
    return new, {"step": step, "m": m, "v": v}


def _moment_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a leaf's moments: float32 for 16-bit floats, else the leaf's own."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_hyperparameters(lr: object, betas: object, eps: object, weight_decay: object) -> None:
    """Raise, naming the argument, unless the rates and decay are finite and >= 0 and each
    beta lies in [0, 1) (as `torch.optim.AdamW` asks; a beta of 1 makes every leaf NaN)."""
    call = "gb.optim.adamw_update"
    real(call, "lr", lr, minimum=0)
    real(call, "eps", eps, minimum=0)
    real(call, "weight_decay", weight_decay, minimum=0)
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise TypeError(f"{call}: betas must be a pair of numbers, got {betas!r:.100}.")
    for i, beta in enumerate(betas):
        if real(call, f"betas[{i}]", beta, minimum=0) >= 1:
            raise ValueError(f"{call}: betas[{i}] must be in [0, 1), got {beta!r:.100}.")


def _check_like(gparams: dict, grads: dict, state: AdamState) -> None:
    """Raise unless `grads` and `state`'s moments hold `gparams`' trainable leaves at their
    shapes: trees of another plan raised pytree's arity errors, and a wrongly shaped
    gradient was broadcast into the update."""
    where = "gb.optim.adamw_update"
    if not isinstance(state, dict) or "step" not in state:
        got = "a dict without 'step'" if isinstance(state, dict) else type(state).__name__
        raise TypeError(f"{where}: state must be adamw_init's dict, got {got}.")
    want = dict(tree_flatten_with_path(_trainable(gparams))[0])
    for name, tree in (
        ("grads", grads),
        ("state['m']", state.get("m")),
        ("state['v']", state.get("v")),
    ):
        if not isinstance(tree, dict):
            raise TypeError(
                f"{where}: {name} must be a dict like gparams, got {type(tree).__name__}."
            )
        got = dict(tree_flatten_with_path(_trainable(tree) if name == "grads" else tree)[0])
        missing = [path for path in want if path not in got]  # in gparams' order
        if missing:
            raise ValueError(
                f"{where}: {name} has no leaf at {keystr(missing[0])}; is it of another plan?"
            )
        extra = [path for path in got if path not in want]
        if extra:
            raise ValueError(f"{where}: {name} has a leaf at {keystr(extra[0])} that gparams lack.")
        for path, leaf in got.items():
            if not isinstance(leaf, Tensor):
                raise TypeError(
                    f"{where}: {name}{keystr(path)} is {type(leaf).__name__}, not a tensor "
                    "(torch.func.grad gives one per leaf, zeros where the loss ignores it)."
                )
            if tuple(leaf.shape) != tuple(want[path].shape):
                raise ValueError(
                    f"{where}: {name}{keystr(path)} has shape {tuple(leaf.shape)}; gparams' "
                    f"has {tuple(want[path].shape)}."
                )
