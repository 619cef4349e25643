"""The specification of the fused forward: gbfunc's own g-net evaluation, then `assemble`.

Nothing here is new math: `gbfunc._spec.reference` evaluates every tile's g-net and
`gbfunc._tiling.assemble` lays the tiles out, cuts and scales them. The kernel must agree.
"""

import functools

import torch
from torch import Tensor

from gbfunc._plan import Generated, Stack
from gbfunc._spec import Terms, reference
from gbfunc._tiling import assemble


def generate(terms: Terms, stack: Stack, params: tuple[Generated, ...]) -> Tensor:
    """Every parameter of `params`, flat and one after the other, from a stack's g-net terms.

    Args:
        terms: The stack's g-nets (`Terms`), with any leading batch dims (one per vmap).
        stack: The stack, from `plan.stacks`.
        params: The stack's `Generated` parameters, in plan order.

    Returns:
        `(*batch, numel)`: `out[..., offset:offset + p.numel].view(p.shape)` is parameter `p`.

    Examples:
        >>> from gbfunc.kernels import stack_terms
        >>> plan = gb.plan(nn.Linear(12, 10), tile=(4, 4))
        >>> stack, gparams = plan.stacks[0], gb.init(plan)
        >>> terms = stack_terms(stack, gparams["stacks"][stack.key])
        >>> generate(terms, stack, plan.generated).shape
        torch.Size([120])
    """
    fn = functools.partial(_one_genome, stack=stack, params=params)
    for _ in range(terms.a.dim() - 3):  # leading batch dims: one vmap each
        fn = torch.func.vmap(fn)
    return fn(terms)


def _one_genome(terms: Terms, *, stack: Stack, params: tuple[Generated, ...]) -> Tensor:
    y = reference(terms, stack.genome.activation)  # (T, TH, Q, P)
    tiles = y.reshape(y.shape[0], y.shape[1], -1)  # (T, TH, TW * K)
    return torch.cat([assemble(p, stack, tiles).reshape(-1) for p in params])
