"""The specification of the fused backward: the vector-Jacobian product of the forward's.

Autograd through `kernels/generate/reference.py` (gbfunc's g-net evaluation and `assemble`)
defines every gradient; the kernel must agree with it without storing the activations.
"""

import torch
from torch import Tensor

from gbfunc import Generated, Stack

from ..generate import reference

Grads = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor, Tensor]


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
) -> Grads:
    """Gradients of `reference.generate` w.r.t. its seven tensor inputs, given `grad` of its output.

    Args:
        grad: Gradient of the flat weights, `(*batch, numel)`.
        a, b, c, w_hidden, b_hidden, w_out: As for `reference.generate` (`b_out` does not
            change the gradients, so it is not an input).
        stack: The stack, from `plan.stacks`.
        params: The stack's `Generated` parameters, in plan order.

    Returns:
        `(grad_a, grad_b, grad_c, grad_w_hidden, grad_b_hidden, grad_w_out, grad_b_out)`, each
        shaped like its input (`None` for the hidden layers of a one-layer g-net).
    """
    b_out = a.new_zeros(*a.shape[:-2], stack.outputs)  # (*batch, T, P)
    inputs = (a, b, c, w_hidden, b_hidden, w_out, b_out)
    present = [x for x in inputs if x is not None]

    def forward(*xs: Tensor) -> Tensor:
        it = iter(xs)
        return reference.generate(*(None if x is None else next(it) for x in inputs), stack, params)

    _, vjp = torch.func.vjp(forward, *present)
    grads = iter(vjp(grad))
    return tuple(None if x is None else next(grads) for x in inputs)  # type: ignore[return-value]
