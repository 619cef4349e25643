"""`gbfunc::generate`: the forward kernel as a `torch.library.triton_op` op.

PyTorch documents `triton_op` with `wrap_triton` as the way for user-written Triton kernels
to meet `torch.compile(fullgraph=True)`, inductor and CUDA graphs: the op declares its fake
(output shape from input shapes) and launches through `wrap_triton`, so the compiler sees the
kernel. On an H200 (torch 2.11, 2026-11-28) `torch.compile(grad(...), fullgraph=True)` passed
through it, where an `autograd.Function` launching the kernel itself failed: dynamo turns such
a launch into `triton_kernel_wrapper_mutation`, which has no rule for `grad`'s transform
(benchmarks/results/gpu_tests_function.log).
"""

import torch
from torch import Tensor
from torch.library import triton_op, wrap_triton

from gbfunc._plan import Generated, Stack
from gbfunc._spec import Terms

from .._checks import Launch
from .._library import run_below_autograd
from . import kernel


def generate(terms: Terms, stack: Stack, params: tuple[Generated, ...]) -> Tensor:
    """`kernel.generate`, launched by the op `gbfunc::generate`."""
    return kernel.generate(terms, stack, params, run=_run)


def _run(terms: Terms, checked: Launch) -> Tensor:
    return _generate(list(terms), *checked)


# The terms as a list in `Terms` order, `None` for absent hidden layers, then a `Launch`'s fields.
@triton_op("gbfunc::generate", mutates_args=())
def _generate(
    terms: list[Tensor | None],
    places: Tensor,
    scales: Tensor,
    numel: int,
    outputs: int,
    activation: str,
) -> Tensor:
    checked = Launch(places, scales, numel, outputs, activation)
    return kernel.launch(Terms(*terms), checked, wrap=wrap_triton)


@_generate.register_fake
def _(terms, places, scales, numel, outputs, activation):
    a = terms[0]
    return a.new_empty((*a.shape[:-3], numel))


run_below_autograd(torch.ops.gbfunc.generate.default)
