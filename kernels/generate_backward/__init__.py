"""`generate_backward`: the gradients of `generate`, recomputed by one fused kernel."""

import torch
from torch import Tensor

from gbfunc._function import signature_once
from gbfunc._plan import Generated, Stack
from gbfunc._spec import Terms

from .._batching import batch_first
from .._checks import contiguous
from . import _op, kernel, reference


@signature_once
class _GenerateGrad(torch.autograd.Function):
    """`generate_backward` as an op; its arguments are the output gradient, the six terms
    that matter (all but `b_out`), then the stack and its params."""

    @staticmethod
    def forward(grad, a, b, c, w_hidden, b_hidden, w_out, stack, params):
        # Named, not `*inputs`: dynamo, inlining a Function none of whose inputs requires grad
        # (the backward's, under `torch.func.grad`), passes `ctx` first unless the arity
        # matches: "Terms.__new__() takes 8 positional arguments but 9 were given" on torch
        # 2.11 and an H200 (benchmarks/results/gpu_tests_triton_op.log as c418d6b committed it).
        flat = (a, b, c, w_hidden, b_hidden, w_out)
        terms = Terms(*(contiguous(x) for x in flat), None)
        return tuple(_op.generate_backward(contiguous(grad), terms, stack, params))

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, stack, params = inputs
        ctx.save_for_backward(*tensors)
        ctx.stack, ctx.params = stack, params

    @staticmethod
    def backward(ctx, *cotangents):
        # Second order is rare (Hessian-vector products): differentiate the reference.
        grad, *flat = ctx.saved_tensors
        terms = Terms(*flat, None)
        present = {name: x for name, x in terms._asdict().items() if x is not None}

        def gradients(grad: Tensor, present: dict[str, Tensor]) -> dict[str, Tensor]:
            given = terms._replace(**present)
            grads = reference.generate_backward(grad, given, ctx.stack, ctx.params)
            return {name: g for name, g in grads._asdict().items() if g is not None}

        out, vjp = torch.func.vjp(gradients, grad, present)
        given = dict(zip(Terms._fields, cotangents, strict=True))
        cot = {n: torch.zeros_like(g) if given[n] is None else given[n] for n, g in out.items()}
        grad_grad, grad_present = vjp(cot)
        grad_terms = (grad_present.get(name) for name in Terms._fields[:-1])
        return (grad_grad, *grad_terms, None, None)

    @staticmethod
    def vmap(info, in_dims, *inputs):
        *tensors, stack, params = inputs
        tensors = batch_first(info.batch_size, tensors, in_dims[: len(tensors)])
        grads = _GenerateGrad.apply(*tensors, stack, params)
        return grads, tuple(None if x is None else 0 for x in grads)


def generate_backward(
    grad: Tensor, terms: Terms, stack: Stack, params: tuple[Generated, ...]
) -> Terms:
    """Gradients of `generate` w.r.t. every term (`Terms`), given `grad` of its output; fused.

    `reference.generate_backward` is the specification. The kernel recomputes the hidden
    activations block by block instead of reading saved ones; it composes with `vmap`, and
    differentiates again through the reference. `terms.b_out` is not read.
    """
    return Terms(*_GenerateGrad.apply(grad, *terms[:-1], stack, params))


__all__ = ["generate_backward", "kernel", "reference"]
