"""A stand-in for transformers' `Conv1D` (weight `(in, out)`, `nf` outputs), named as
transformers names it, so gbfunc's rule for it applies without importing transformers."""

import torch
from torch import nn


class Conv1D(nn.Module):
    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))


Conv1D.__module__, Conv1D.__qualname__ = "transformers.pytorch_utils", "Conv1D"
