"""Shared test configuration.

Triton kernels run compiled on a GPU and through Triton's interpreter elsewhere;
`@triton.jit` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before
anything imports the kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hypothesis
import pytest

hypothesis.settings.register_profile("dev", max_examples=15, deadline=None)
hypothesis.settings.register_profile("ci", max_examples=25, deadline=None, print_blob=True)
hypothesis.settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
)

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
