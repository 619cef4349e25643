"""The kernels as `torch.library.triton_op` ops, `gbfunc::generate` and
`gbfunc::generate_backward`: the second of the two wrappers (`_runtime.WRAPPER`).

With the default wrapper, `function`, the ops' `autograd.Function`s launch the kernels
themselves and `torch.compile` traces the launches. With `triton_op` they call these ops
instead, which PyTorch documents as the way for user-written Triton kernels to meet
`torch.compile(fullgraph=True)`, inductor and CUDA graphs: each op declares its fake (output
shapes from input shapes) and launches through `wrap_triton`, so the compiler sees the
kernel. Gradients and `vmap` stay with the `autograd.Function`s: the ops themselves are
never differentiated (`torch.func.grad` cannot run `register_autograd`'s formulas:
pytorch/pytorch#170834), so their autograd kernel only passes the call below autograd.

Registered by importing this module, which `gbfunc.kernels` does only when
`GBFUNC_KERNEL_WRAPPER=triton_op` selects it.
"""

import warnings

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from gbfunc._plan import Generated, Stack
from gbfunc._spec import Terms

from . import _runtime
from ._checks import Launch
from .generate import kernel as forward_kernel
from .generate_backward import kernel as backward_kernel


def generate(terms: Terms, stack: Stack, params: tuple[Generated, ...]) -> Tensor:
    """`forward_kernel.generate`, launched by the op `gbfunc::generate`."""
    return forward_kernel.generate(terms, stack, params, run=_run_generate)


def generate_backward(
    grad: Tensor, terms: Terms, stack: Stack, params: tuple[Generated, ...]
) -> Terms:
    """`backward_kernel.generate_backward`, launched by the op `gbfunc::generate_backward`."""
    return backward_kernel.generate_backward(grad, terms, stack, params, run=_run_backward)


def _run_generate(terms: Terms, checked: Launch) -> Tensor:
    return _generate(list(terms), *checked)


def _run_backward(grad: Tensor, terms: Terms, checked: Launch) -> Terms:
    grads = _generate_backward(grad, list(terms[:-1]), *checked)
    absent = terms.w_hidden is None  # the op returns empty tensors for absent hidden layers
    return Terms(*(None if absent and i in (3, 4) else g for i, g in enumerate(grads)))


# Both ops take a stack's g-net terms as a list in `Terms` order (`b_out` left out of the
# backward's), `None` for absent hidden layers, then a `Launch`'s fields.


@triton_op("gbfunc::generate", mutates_args=())
def _generate(
    terms: list[Tensor | None],
    places: Tensor,
    scales: Tensor,
    numel: int,
    outputs: int,
    activation: str,
) -> Tensor:
    launch = forward_kernel.launch
    checked = Launch(places, scales, numel, outputs, activation)
    return launch(Terms(*terms), checked, wrap=wrap_triton)


@_generate.register_fake
def _(terms, places, scales, numel, outputs, activation):
    a = terms[0]
    return a.new_empty((*a.shape[:-3], numel))


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
    grads = backward_kernel.launch(
        grad, given, Launch(places, scales, numel, outputs, activation), wrap=wrap_triton
    )
    return tuple(given.a.new_empty(0) if g is None else g for g in grads)


@_generate_backward.register_fake
def _(grad, terms, places, scales, numel, outputs, activation):
    a = terms[0]
    like = [a.new_empty(0) if x is None else torch.empty_like(x) for x in terms]
    return (*like, a.new_empty((*a.shape[:-2], outputs)))


def _below_autograd(op: torch._ops.OpOverload):
    """An autograd kernel for `op` that runs it below autograd: its `autograd.Function`
    differentiates it, so the op needs no formula (and functorch no generated one)."""

    def kernel(keyset: torch._C.DispatchKeySet, *args):
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)

    return kernel


_LIBRARY = torch.library.Library("gbfunc", "IMPL")
for _op in (torch.ops.gbfunc.generate.default, torch.ops.gbfunc.generate_backward.default):
    with warnings.catch_warnings():  # replacing `triton_op`'s own autograd kernel is the point
        warnings.filterwarnings("ignore", "Warning only once for all operators")
        name = _op.__name__.split(".")[0]
        _LIBRARY.impl(name, _below_autograd(_op), "Autograd", with_keyset=True, allow_override=True)

_runtime.OP_LAUNCHERS.update(generate=generate, generate_backward=generate_backward)
