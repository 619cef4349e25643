"""Fused Triton kernels for gbfunc's g-net stacks, imported as `gbfunc.kernels`.

Each op is a folder: `reference.py` (pure torch, the specification, built from gbfunc's own
`reference` and `assemble`), `kernel.py` (the `@triton.jit` kernel and a launcher with the
reference's signature), `_op.py` (the launcher as a `torch.library.triton_op` op, which
`torch.compile` and inductor see through) and `__init__.py` (the `autograd.Function` that
calls the op and composes with `torch.func`: gradients and `vmap` rules).

Kernels are compiled for CUDA. On CPU tensors they run through Triton's interpreter, which
the process has to enable itself: `@triton.jit` reads `TRITON_INTERPRET` when a function is
defined, Triton's own library included, so it must be `1` before anything imports triton
(`TRITON_INTERPRET=1 python train.py`). Importing this package never changes the
environment; a launch that cannot run says why (`_runtime.check_runnable`).

A stack's g-nets reach the kernels as `Terms`, from `stack_terms(stack, leaves)`.
"""

from gbfunc._spec import Terms as Terms, stack_terms as stack_terms

from ._checks import refusal as refusal
from ._runtime import check_runnable as check_runnable
from .generate import generate as generate
from .generate_backward import generate_backward as generate_backward
