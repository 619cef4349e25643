"""`generate`: a stack's g-nets evaluated and tiled into its weights by one fused kernel."""

import torch
from torch import Tensor

from gbfunc import Generated, Stack

from .._batching import batch_first
from .._checks import contiguous
from ..generate_backward import generate_backward
from . import kernel, reference


class _Generate(torch.autograd.Function):
    @staticmethod
    def forward(a, b, c, w_hidden, b_hidden, w_out, b_out, stack, params):
        tensors = (a, b, c, w_hidden, b_hidden, w_out, b_out)
        return kernel.generate(*(contiguous(x) for x in tensors), stack, params)

    @staticmethod
    def setup_context(ctx, inputs, output):
        a, b, c, w_hidden, b_hidden, w_out, _, stack, params = inputs
        ctx.save_for_backward(a, b, c, w_hidden, b_hidden, w_out)  # g-net sized: no activations
        ctx.stack, ctx.params = stack, params

    @staticmethod
    def backward(ctx, grad):
        # The backward is itself an op (kernel + vmap rule), so grad composes with vmap and
        # differentiates again.
        grads = generate_backward(grad, *ctx.saved_tensors, ctx.stack, ctx.params)
        return (*grads, None, None)

    @staticmethod
    def vmap(info, in_dims, a, b, c, w_hidden, b_hidden, w_out, b_out, stack, params):
        # The launcher takes leading batch dims: K genomes are K times the tiles, one launch.
        tensors = batch_first(
            info.batch_size, (a, b, c, w_hidden, b_hidden, w_out, b_out), in_dims[:7]
        )
        return _Generate.apply(*tensors, stack, params), 0


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
    """Every weight of a stack's parameters, flat, from its g-net terms; fused and differentiable.

    `reference.generate` is the specification (same arguments and result); this runs the
    Triton kernel forward and backward, with `torch.func.grad` and `vmap` (leading batch dims
    are genomes, launched as one grid). Inputs are made contiguous first.

    Example:
        >>> inputs = gb._apply.stack_inputs(stack, gparams["stacks"][stack.key])
        >>> params = tuple(p for p in plan.generated if p.stack == 0)
        >>> flat = generate(*inputs, stack, params)  # (sum of p.numel,)
    """
    return _Generate.apply(a, b, c, w_hidden, b_hidden, w_out, b_out, stack, params)


__all__ = ["generate", "kernel", "reference"]
