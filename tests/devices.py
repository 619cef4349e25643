"""The device kernel tests run on: compiled Triton on a CUDA host, the interpreter elsewhere.

`tests/conftest.py` turns the interpreter on only where there is no CUDA device, so a test
that feeds the kernels CPU tensors on a GPU host would run compiled kernels on CPU memory.
Kernel tests build their tensors on `KERNEL_DEVICE` instead; facts that hold only on CPU
(the interpreter's limits, `backend="auto"` picking torch) say so in their names.
"""

import torch

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
