"""Fused Triton kernels for gbfunc's g-net stacks, imported as `gbfunc.kernels`.

Each op is a folder: `reference.py` (pure torch, the specification, built from gbfunc's own
`reference` and `assemble`), `kernel.py` (the `@triton.jit` kernel and a launcher with the
reference's signature) and `__init__.py` (the `autograd.Function` that composes with
`torch.func`). The Functions launch the kernels through the `torch.library.triton_op` ops of
`_ops.py`, or, with `GBFUNC_KERNEL_WRAPPER=function` in the environment, themselves (which
cannot compile `grad` on a GPU: `_runtime.WRAPPER`); a GPU run's compile tests decide whether
`function` goes.

Kernels are compiled for CUDA. On CPU tensors they run through Triton's interpreter, which
the process has to enable itself: `@triton.jit` reads `TRITON_INTERPRET` when a function is
defined, Triton's own library included, so it must be `1` before anything imports triton
(`TRITON_INTERPRET=1 python train.py`). Importing this package never changes the
environment; a launch that cannot run says why (`_runtime.check_runnable`).

A stack's g-nets reach the kernels as `Terms`, from `stack_terms(stack, leaves)`.
"""

from gbfunc._spec import Terms as Terms, stack_terms as stack_terms

from . import _runtime
from ._checks import refusal as refusal
from ._runtime import DTYPES as DTYPES, WRAPPER as WRAPPER, check_runnable as check_runnable
from .generate import generate as generate
from .generate_backward import generate_backward as generate_backward

if _runtime.WRAPPER == "triton_op":
    from . import _ops  # noqa: F401  (registers the ops gbfunc::generate and ::generate_backward)
