"""`gbfunc::generate_backward`: the backward kernel as a `torch.library.triton_op` op (why
an op: `generate/_op.py`)."""

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from gbfunc._plan import Generated, Stack
from gbfunc._spec import Terms

from .._checks import Launch
from .._library import run_below_autograd
from . import kernel


def generate_backward(
    grad: Tensor, terms: Terms, stack: Stack, params: tuple[Generated, ...]
) -> Terms:
    """`kernel.generate_backward`, launched by the op `gbfunc::generate_backward`."""
    return kernel.generate_backward(grad, terms, stack, params, run=_run)


def _run(grad: Tensor, terms: Terms, checked: Launch) -> Terms:
    grads = _generate_backward(grad, list(terms[:-1]), *checked)
    absent = terms.w_hidden is None  # the op returns empty tensors for absent hidden layers
    return Terms(*(None if absent and i in (3, 4) else g for i, g in enumerate(grads)))


# The terms but `b_out` as a list in `Terms` order, `None` for absent hidden layers, then a
# `Launch`'s fields.
@triton_op("gbfunc::generate_backward", mutates_args=())
def _generate_backward(
    grad: Tensor,
    terms: list[Tensor | None],
    places: Tensor,
    scales: Tensor,
    numel: int,
    outputs: int,
    activation: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    given = Terms(*terms, None)
    grads = kernel.launch(
        grad, given, Launch(places, scales, numel, outputs, activation), wrap=wrap_triton
    )
    return tuple(given.a.new_empty(0) if g is None else g for g in grads)


@_generate_backward.register_fake
def _(grad, terms, places, scales, numel, outputs, activation):
    a = terms[0]
    like = [a.new_empty(0) if x is None else torch.empty_like(x) for x in terms]
    return (*like, a.new_empty((*a.shape[:-2], outputs)))


run_below_autograd(torch.ops.gbfunc.generate_backward.default)
