"""Fused Triton kernels for gbfunc's g-net stacks, imported as `gbfunc.kernels`.

Each op is a folder: `reference.py` (pure torch, the specification, built from gbfunc's own
`reference` and `assemble`), `kernel.py` (the `@triton.jit` kernel and a launcher with the
reference's signature) and `__init__.py` (the `autograd.Function` that composes with
`torch.func`).

Kernels are compiled for CUDA. Without CUDA they run through Triton's interpreter: since
`@triton.jit` reads `TRITON_INTERPRET` when a function is defined, Triton's own library
included, this module sets it (if unset) and must be imported before anything else imports
triton; it says so if not. The variable stays set, as Triton reads it again when launching.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from ._runtime import DTYPES as DTYPES
from .generate import generate as generate
from .generate_backward import generate_backward as generate_backward
