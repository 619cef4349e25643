"""A functional AdamW over gparams pytrees, for training steps compiled whole.

`torch.optim` works on gparams' leaves as on any parameters; this pure version exists so a
step (generate, forward, loss, grad, update) can run under `torch.compile(fullgraph=True)`.
The `"frozen"` group is carried through unchanged.

Example:
    >>> model = nn.Linear(8, 2)
    >>> plan = gb.plan(model, tile=(4, 4))
    >>> gparams = gb.init(plan)
    >>> def loss_fn(gparams, x):
    ...     return functional_call(model, gb.apply(gparams, plan), (x,)).square().mean()
    >>> state = gb.optim.adamw_init(gparams)
    >>> grads = torch.func.grad(loss_fn)(gparams, torch.randn(16, 8))
    >>> gparams, state = gb.optim.adamw_update(gparams, grads, state, lr=1e-3)
"""

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

AdamState = dict[str, Any]


def _trainable(tree: dict) -> dict:
    return {k: v for k, v in tree.items() if k != "frozen"}


def adamw_init(gparams: dict) -> AdamState:
    """Zero moments for every trainable leaf and a step counter.

    The counter is float64, so the bias corrections `1 - beta ** step` keep full precision
    (in float32, `1 - 0.999 ** 1` is off by 1e-4 relative) without leaving the graph.
    """
    zeros = tree_map(lambda p: torch.zeros_like(p, requires_grad=False), _trainable(gparams))
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
    """One AdamW step (decoupled weight decay, bias-corrected), returning new trees."""
    b1, b2 = betas
    step = state["step"] + 1
    m = tree_map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], _trainable(grads))
    v = tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], _trainable(grads))
    c1, c2 = 1 - b1**step, 1 - b2**step

    def update(p: Tensor, m: Tensor, v: Tensor) -> Tensor:
        return p * (1 - lr * weight_decay) - lr * (m / c1) / ((v / c2).sqrt() + eps)

    new = tree_map(update, _trainable(gparams), m, v)
    new["frozen"] = gparams["frozen"]
    return new, {"step": step, "m": m, "v": v}
