"""`gb.fit` and `gb.train_alternating`: g-nets regressed onto given weights.

Fitting is how a trained model is compressed without its data, and the half-step of
Shuvaev et al.'s (PNAS 2024) training, which alternates training a p-net's weights directly
with fitting the g-nets to them.
"""

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from ._apply import apply
from ._check_gparams import TASKS, check_gparams
from ._condition import condition_of
from ._numbers import integer, real
from ._plan import Plan
from ._tree import GParams, stack_leaves
from .optim import _leaves_by_rate


class Fitted(NamedTuple):
    """What `gb.fit` returns.

    Attributes:
        gparams: The fitted g-nets; free parameters copied from the target.
        errors: Per generated parameter, `||generated - target||^2 / ||target||^2` (over
            the weight's starting variance instead where the target is all but zero).
    """

    gparams: GParams
    errors: dict[str, float]


def fit(
    gparams: GParams,
    plan: Plan,
    target: Mapping[str, Tensor],
    *,
    steps: int = 500,
    lr: float | None = 1e-2,
    compile: bool = False,
    condition: Tensor | None = None,
    task: int | Tensor | None = None,
) -> Fitted:
    """Regress the g-nets of `gparams` onto `target`'s weights (Adam, cosine schedule).

    Each generated parameter's squared error is divided by the target's mean square, so
    every weight counts equally whatever its scale; a target all but zero (a mean square
    below `1e-12` of the weight's starting variance, such as a zero-initialised layer) is
    measured against that variance instead, since dividing by its own would overflow the
    gradients. Free and frozen parameters are copied from `target` where it has them, and
    must be finite and of their parameters' shapes. `gparams` is not modified.

    Args:
        gparams: The starting point, from `gb.init(plan)` or a previous fit.
        plan: The plan that made `gparams`.
        target: `{name: tensor}` with every generated parameter, e.g. `model.state_dict()`.
        steps: Adam steps.
        lr: Peak learning rate of every g-net leaf, decayed to zero along a cosine; `None`:
            each leaf at its default for training (`gb.optim.gnet_lr`). 1e-2 is the default:
            at its training rate the paper's tanh genome, fitted to a trained MLP, kept far
            less of the dense accuracy (`benchmarks/results/fit_trained.md`).
        compile: `torch.compile` the loss and its backward (worth it from a few hundred
            steps; the first call compiles).
        condition: For a conditioned plan, the condition whose weights are fitted to
            `target` (as in `gb.apply`): the g-nets, their condition weights included, are
            fitted; the task embeddings are kept as they are.
        task: Instead of `condition`, a task's index.

    Returns:
        `Fitted(gparams, errors)`, leaves with the `requires_grad` flags of `gparams`.

    Examples:
        >>> trained = nn.Linear(64, 32)
        >>> plan = gb.plan(trained, tile=(16, 16))
        >>> fitted = gb.fit(gb.init(plan), plan, trained.state_dict(), steps=50)
        >>> sorted(fitted.errors)  # relative squared error per generated weight
        ['weight']
        >>> trained.load_state_dict(gb.export(fitted.gparams, plan, model=trained))
        <All keys matched successfully>
    """
    check_gparams(gparams, plan, "gb.fit")
    condition_of(gparams, plan, condition, task, "gb.fit")
    steps, lr = _check_options(plan, target, steps, lr)
    stacks = {
        key: {name: leaf.detach().clone().requires_grad_() for name, leaf in leaves.items()}
        for key, leaves in gparams["stacks"].items()
    }
    rest = {
        group: {
            name: _copied(target.get(name, value), value) for name, value in gparams[group].items()
        }
        for group in ("free", "frozen")
    } | ({TASKS: _copied(gparams[TASKS], gparams[TASKS])} if TASKS in gparams else {})
    weights = {
        p.name: target[p.name]
        .detach()
        .to(gparams["stacks"][plan.stacks[p.stack_index].key]["w_in"])
        for p in plan.generated
    }
    norms = {p.name: _reference(weights[p.name], p.init_std**2) for p in plan.generated}

    def errors(stacks: dict) -> dict[str, Tensor]:
        params = apply({"stacks": stacks, **rest}, plan, condition=condition, task=task)
        return {n: (params[n] - w).square().mean() / norms[n] for n, w in weights.items()}

    def loss(stacks: dict) -> Tensor:
        return sum(errors(stacks).values()) / len(weights)

    step_loss = torch.compile(loss, dynamic=False) if compile else loss
    by_rate = _leaves_by_rate(stacks, plan) if lr is None else {lr: stack_leaves(stacks)}
    optimizer = torch.optim.Adam([{"params": p, "lr": rate} for rate, p in by_rate.items()])
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda t: 0.5 * (1 + math.cos(math.pi * t / steps))
    )
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        step_loss(stacks).backward()
        optimizer.step()
        schedule.step()
    with torch.no_grad():
        final = {name: float(e) for name, e in errors(stacks).items()}
    # The fitted leaves, marked trainable as their counterparts in `gparams` are.
    out = tree_map(
        lambda new, old: new.detach().requires_grad_(old.requires_grad),
        {"stacks": stacks, **rest},
        gparams,
    )
    return Fitted(out, final)


def train_alternating(
    gparams: GParams,
    plan: Plan,
    train_dense: Callable[[dict[str, Tensor], int], Mapping[str, Tensor]],
    *,
    generations: int,
    anneal: float = 20.0,
    fit_steps: int = 300,
    fit_lr: float | None = 1e-2,
    start: Mapping[str, Tensor] | None = None,
    compile: bool = False,
    on_generation: Callable[[int, GParams, dict[str, float]], None] | None = None,
) -> GParams:
    """Shuvaev et al.'s training: alternate direct training of the p-net and g-net fitting.

    Generation `n` starts the p-net from `eps * trained + (1 - eps) * generated`, with
    `eps = exp(-n / anneal)` and `trained` the previous generation's trained weights (at
    `n = 0`, `start`, by default the weights the g-nets generate), trains it with
    `train_dense` (any model, loss and optimizer), fits the g-nets to the result with
    `gb.fit` and regenerates. Blending matters early: deep p-nets generated by untrained
    g-nets barely train.

    Args:
        gparams: The starting g-nets, from `gb.init(plan)`.
        plan: The plan that made `gparams`.
        train_dense: `train_dense(params, generation) -> trained params`: trains the p-net
            from the dense `{name: tensor}` it is given (e.g. by `load_state_dict` and a few
            optimizer steps) and returns its parameters.
        generations: Number of train-then-fit rounds.
        anneal: Generations over which the blend decays by `e`.
        fit_steps: `steps` of `gb.fit`, each generation.
        fit_lr: `lr` of `gb.fit`, each generation.
        compile: `compile` of `gb.fit`, each generation.
        start: The dense weights of generation 0, e.g. the model's own.
        on_generation: `on_generation(n, gparams, fit_errors)` after each generation.

    Returns:
        The g-nets after the last fit.

    Examples:
        >>> x = torch.randn(256, 64)
        >>> y = nn.Linear(64, 32)(x).detach()  # a teacher's outputs to learn
        >>> model = nn.Linear(64, 32)
        >>> plan = gb.plan(model, tile=(16, 16))
        >>> def train_dense(params, generation):  # a few SGD steps on the p-net
        ...     model.load_state_dict(params)
        ...     opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ...     for _ in range(10):
        ...         opt.zero_grad()
        ...         nn.functional.mse_loss(model(x), y).backward()
        ...         opt.step()
        ...     return model.state_dict()
        >>> def loss(gparams):  # of the p-net the g-nets generate
        ...     params = gb.apply(gparams, plan)
        ...     out = torch.func.functional_call(model, params, (x,))
        ...     return nn.functional.mse_loss(out, y).item()
        >>> start = gb.init(plan)
        >>> gparams = gb.train_alternating(
        ...     start, plan, train_dense, generations=2, fit_steps=30
        ... )
        >>> loss(gparams) < loss(start)
        True
    """
    check_gparams(gparams, plan, "gb.train_alternating")
    if plan.condition:
        raise ValueError(
            "gb.train_alternating: the plan's g-nets read a condition, and alternating training "
            "fits one weight set; fit a conditioned genome with gb.fit(..., condition= or task=)."
        )
    if start is not None:
        check_weights(plan, start, "gb.train_alternating: start")
    if not callable(train_dense):
        raise TypeError(
            f"gb.train_alternating: train_dense must be callable, got {type(train_dense).__name__}."
        )
    generations = integer("gb.train_alternating", "generations", generations, minimum=1)
    anneal = real("gb.train_alternating", "anneal", anneal, above=0)
    fit_steps = integer("gb.train_alternating", "fit_steps", fit_steps, minimum=1)
    fit_lr = real("gb.train_alternating", "fit_lr", fit_lr, above=0, optional=True)
    names = {p.name for p in plan.generated}
    trained: Mapping[str, Tensor] | None = start
    for n in range(generations):
        with torch.no_grad():
            # One evaluation per generation: not worth compiling the plan's graph for.
            generated = apply(gparams, plan, compile=False)
            generated = {k: v.detach().clone() for k, v in generated.items()}
        eps = math.exp(-n / anneal)
        begin = dict(generated)
        if trained is not None:
            for name in names:
                begin[name] = (
                    eps * trained[name].detach().to(generated[name]) + (1 - eps) * generated[name]
                )
            for name in generated.keys() - names:
                begin[name] = trained[name].detach().clone() if name in trained else generated[name]
        trained = train_dense(begin, n)
        check_weights(plan, trained, f"gb.train_alternating: train_dense(params, {n})'s result")
        gparams, errors = fit(gparams, plan, trained, steps=fit_steps, lr=fit_lr, compile=compile)
        if on_generation is not None:
            on_generation(n, gparams, errors)
    return gparams


def _reference(target: Tensor, start_variance: float) -> Tensor:
    """What a target's squared error is divided by: its mean square, or the weight's starting
    variance where the target is all but zero (its gradients would overflow Adam's moments:
    a zero target left the weight unfitted, its error reported as 4e28)."""
    square = target.square().mean()
    return square if float(square) >= 1e-12 * start_variance else square.new_tensor(start_variance)


def _copied(value: Tensor, like: Tensor) -> Tensor:
    return value.detach().to(device=like.device, dtype=like.dtype, copy=True)


def _check_options(
    plan: Plan, target: Mapping[str, Tensor], steps: object, lr: object
) -> tuple[int, float | None]:
    """`steps` as an int >= 1 and `lr` as a float > 0 or None; raises unless they are, and
    unless `target` holds every generated weight (`check_weights`)."""
    check_weights(plan, target, "gb.fit: target")
    return (
        integer("gb.fit", "steps", steps, minimum=1),
        real("gb.fit", "lr", lr, above=0, optional=True),
    )


def check_weights(plan: Plan, weights: object, what: str) -> None:
    """Raise unless `weights` (named `what` in the message) maps every generated parameter of
    `plan`, and any other it has, to a finite tensor of its shape."""
    if not isinstance(weights, Mapping):
        raise TypeError(f"{what} must map names to tensors, got {type(weights).__name__}.")
    for p in plan.generated:
        if p.name not in weights:
            raise KeyError(f"{what} has no {p.name!r}, a generated parameter of the plan.")
    for p in plan.params:
        if p.name not in weights:
            continue  # a free or frozen parameter keeps gparams' value
        value = weights[p.name]
        if not isinstance(value, Tensor):
            raise TypeError(f"{what}[{p.name!r}] must be a Tensor, got {type(value).__name__}.")
        if tuple(value.shape) != p.shape:
            raise ValueError(
                f"{what}[{p.name!r}] has shape {tuple(value.shape)}; the plan's parameter has "
                f"{p.shape}."
            )
        if value.is_meta:
            raise ValueError(f"{what}[{p.name!r}] is on the meta device: it has no values.")
        if value.is_complex():
            raise TypeError(f"{what}[{p.name!r}] is {value.dtype}; weights are real.")
        if value.is_floating_point() and not bool(value.isfinite().all()):
            raise ValueError(f"{what}[{p.name!r}] contains NaN or inf.")
