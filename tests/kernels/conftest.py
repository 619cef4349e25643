"""Kernel tests on a GPU tune nothing: every new shape would compile and time each config.

Hypothesis draws a new tile shape per example; with the full autotune sweep each one
compiles and benchmarks every `(BLOCK_N, num_warps)` config of both kernels. The tests run
with one config instead (the interpreter's block size), and the `gpu` tests that are about
the configs restore them (`all_autotune_configs`).
"""

import pytest

from gbfunc.kernels import _runtime
from gbfunc.kernels.generate import kernel as forward_kernel
from gbfunc.kernels.generate_backward import kernel as backward_kernel

TUNED = (forward_kernel._generate_kernel, backward_kernel._generate_backward_kernel)


@pytest.fixture(autouse=True)
def _one_autotune_config(request, monkeypatch) -> None:
    if _runtime.INTERPRETED or "all_autotune_configs" in request.fixturenames:
        return
    for kernel in TUNED:
        smallest = min(kernel.configs, key=lambda c: (c.kwargs["BLOCK_N"], c.num_warps))
        monkeypatch.setattr(kernel, "configs", [smallest])


@pytest.fixture
def all_autotune_configs() -> tuple:
    """The kernels with their full autotune config lists (the autouse fixture leaves them)."""
    return TUNED
