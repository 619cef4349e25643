"""`generate`: a stack's g-nets evaluated and tiled into its weights by one fused kernel."""

import torch
from torch import Tensor

from gbfunc._function import signature_once
from gbfunc._plan import Generated, Stack
from gbfunc._spec import Terms

from .._batching import batch_first
from .._checks import contiguous
from ..generate_backward import generate_backward
from . import _op, kernel, reference


@signature_once
class _Generate(torch.autograd.Function):
    """`generate` as an op; its arguments are a flat `Terms`, then the stack and its params."""

    @staticmethod
    def forward(a, b, c, w_hidden, b_hidden, w_out, b_out, stack, params):
        # Named, not `*inputs`: dynamo, inlining a Function none of whose inputs requires grad,
        # passes `ctx` first unless the arity matches (as `gbfunc.generate.torch_ops._TileMLP`).
        flat = (a, b, c, w_hidden, b_hidden, w_out, b_out)
        return _op.generate(Terms(*(contiguous(x) for x in flat)), stack, params)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *flat, stack, params = inputs
        ctx.save_for_backward(*flat[:-1])  # g-net sized, no activations; b_out is not needed
        ctx.stack, ctx.params = stack, params

    @staticmethod
    def backward(ctx, grad):
        # The backward is itself an op (kernel + vmap rule), so grad composes with vmap and
        # differentiates again.
        terms = Terms(*ctx.saved_tensors, None)
        return (*generate_backward(grad, terms, ctx.stack, ctx.params), None, None)

    @staticmethod
    def vmap(info, in_dims, *inputs):
        # The launcher takes leading batch dims: K genomes are K times the tiles, one launch.
        *flat, stack, params = inputs
        tensors = batch_first(info.batch_size, flat, in_dims[: len(flat)])
        return _Generate.apply(*tensors, stack, params), 0


def generate(terms: Terms, stack: Stack, params: tuple[Generated, ...]) -> Tensor:
    """Every weight of a stack's parameters, flat, from its g-net terms; fused and differentiable.

    `reference.generate` is the specification (same arguments and result; neither centres a
    parameter, which the `triton` path does after, `gbfunc.generate.triton`); this runs the
    Triton kernel forward and backward, with `torch.func.grad` and `vmap` (leading batch dims
    are genomes, launched as one grid). Inputs are made contiguous first.

    Examples:
        >>> from gbfunc.kernels import stack_terms
        >>> plan = gb.plan(nn.Linear(12, 10), tile=(4, 4))
        >>> stack, gparams = plan.stacks[0], gb.init(plan)
        >>> terms = stack_terms(stack, gparams["stacks"][stack.key])
        >>> params = plan.generated_by(0)
        >>> generate(terms, stack, params).shape  # the 120 weights, flat
        torch.Size([120])
    """
    return _Generate.apply(*terms, stack, params)


__all__ = ["generate", "kernel", "reference"]
