"""`generate_backward`: the gradients of `generate`, recomputed by one fused kernel."""

import torch
from torch import Tensor

from gbfunc import Generated, Stack

from .._batching import batch_first
from .._checks import contiguous
from . import kernel, reference


class _GenerateGrad(torch.autograd.Function):
    @staticmethod
    def forward(grad, a, b, c, w_hidden, b_hidden, w_out, stack, params):
        tensors = (grad, a, b, c, w_hidden, b_hidden, w_out)
        return kernel.generate_backward(*(contiguous(x) for x in tensors), stack, params)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, stack, params = inputs
        ctx.save_for_backward(*tensors)
        ctx.stack, ctx.params = stack, params

    @staticmethod
    def backward(ctx, *cotangents):
        # Second order is rare (Hessian-vector products): differentiate the reference.
        inputs = ctx.saved_tensors
        present = [x for x in inputs if x is not None]

        def gradients(*xs: Tensor) -> reference.Grads:
            it = iter(xs)
            return reference.generate_backward(
                *(None if x is None else next(it) for x in inputs), ctx.stack, ctx.params
            )

        _, vjp = torch.func.vjp(gradients, *present)
        grads = iter(vjp(cotangents))
        return (*(None if x is None else next(grads) for x in inputs), None, None)

    @staticmethod
    def vmap(info, in_dims, grad, a, b, c, w_hidden, b_hidden, w_out, stack, params):
        tensors = batch_first(
            info.batch_size, (grad, a, b, c, w_hidden, b_hidden, w_out), in_dims[:7]
        )
        grads = _GenerateGrad.apply(*tensors, stack, params)
        return grads, tuple(None if x is None else 0 for x in grads)


def generate_backward(
    grad: Tensor,
    a: Tensor,
    b: Tensor,
    c: Tensor,
    w_hidden: Tensor | None,
    b_hidden: Tensor | None,
    w_out: Tensor,
    stack: Stack,
    params: tuple[Generated, ...],
) -> reference.Grads:
    """Gradients of `generate` w.r.t. `(a, b, c, w_hidden, b_hidden, w_out, b_out)`; fused.

    `reference.generate_backward` is the specification. The kernel recomputes the hidden
    activations block by block instead of reading saved ones; it composes with `vmap`, and
    differentiates again through the reference.
    """
    return _GenerateGrad.apply(grad, a, b, c, w_hidden, b_hidden, w_out, stack, params)


__all__ = ["generate_backward", "kernel", "reference"]
