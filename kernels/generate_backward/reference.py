"""The specification of the fused backward: the vector-Jacobian product of the forward's.

Autograd through `kernels/generate/reference.py` (gbfunc's g-net evaluation and `assemble`)
defines every gradient; the kernel must agree with it without storing the activations.
"""

import torch
from torch import Tensor

from gbfunc._plan import Generated, Stack
from gbfunc._spec import Terms

from ..generate import reference


def generate_backward(
    grad: Tensor, terms: Terms, stack: Stack, params: tuple[Generated, ...]
) -> Terms:
    """Gradients of `reference.generate` w.r.t. every term, given `grad` of its output.

    Args:
        grad: Gradient of the flat weights, `(*batch, numel)`.
        terms: As for `reference.generate`; `terms.b_out` is not read (it does not change
            the gradients) and may be `None`.
        stack: The stack, from `plan.stacks`.
        params: The stack's `Generated` parameters, in plan order.

    Returns:
        `Terms` of gradients, each shaped like its term (`None` for the hidden layers of a
        one-layer g-net).
    """
    a = terms.a
    terms = terms._replace(b_out=a.new_zeros(*a.shape[:-2], stack.outputs))  # (*batch, T, P)
    present = {name: x for name, x in terms._asdict().items() if x is not None}
    _, vjp = torch.func.vjp(
        lambda t: reference.generate(terms._replace(**t), stack, params), present
    )
    (grads,) = vjp(grad)
    return Terms(**{name: grads.get(name) for name in Terms._fields})
