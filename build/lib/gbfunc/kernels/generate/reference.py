"""The specification of the fused forward: gbfunc's own g-net evaluation, then `assemble`.

Nothing here is new math: `gbfunc._tilemlp.reference` evaluates every tile's g-net and
`gbfunc._apply.assemble` lays the tiles out, cuts and scales them. The kernel must agree.
"""

import functools

import torch
from torch import Tensor

from gbfunc import Generated, Stack
from gbfunc._apply import assemble
from gbfunc._tilemlp import reference


def generate(
    a: Tensor,
    b: Tensor,
    c: Tensor,
    w_hidden: Tensor | None,
    b_hidden: Tensor | None,
    w_out: Tensor,
    b_out: Tensor,
    stack: Stack,
    params: tuple[Generated, ...],
) -> Tensor:
    """Every parameter of `params`, flat and one after the other, from a stack's g-net terms.

    Args:
        a: Row terms of the first layer, `(*batch, T, TH, H)`.
        b: Column terms, `(*batch, T, Q, H)`.
        c: First-layer bias per tile, `(*batch, T, H)`.
        w_hidden: `(*batch, T, D-1, H, H)`, or `None` for one hidden layer.
        b_hidden: `(*batch, T, D-1, H)`, or `None`.
        w_out: `(*batch, T, H, P)`.
        b_out: `(*batch, T, P)`.
        stack: The stack, from `plan.stacks`.
        params: The stack's `Generated` parameters, in plan order.

    Returns:
        `(*batch, numel)`: `out[..., offset:offset + p.numel].view(p.shape)` is parameter `p`.

    Example:
        >>> flat = generate(*stack_inputs(stack, gparams["stacks"][stack.key]), stack, params)
    """
    fn = functools.partial(_one_genome, stack=stack, params=params)
    for _ in range(a.dim() - 3):  # leading batch dims: one vmap each
        fn = torch.func.vmap(fn)
    return fn(a, b, c, w_hidden, b_hidden, w_out, b_out)


def _one_genome(
    a, b, c, w_hidden, b_hidden, w_out, b_out, *, stack: Stack, params: tuple[Generated, ...]
) -> Tensor:
    y = reference(
        a, b, c, w_hidden, b_hidden, w_out, b_out, stack.genome.activation
    )  # (T, TH, Q, P)
    tiles = y.reshape(y.shape[0], y.shape[1], -1)  # (T, TH, TW * K)
    return torch.cat([assemble(p, stack, tiles).reshape(-1) for p in params])
