"""Shared test configuration.

Triton kernels run compiled on a GPU and through Triton's interpreter elsewhere;
`@triton.jit` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before
anything imports the kernels.
"""

import os

import torch
import torch.distributed as dist

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

if "MUTANT_UNDER_TEST" in os.environ:
    # Under mutmut every mutated function goes through a trampoline that reads a ContextVar,
    # which dynamo cannot trace: switched off, torch.compile runs functions eagerly, and so
    # does what gb.apply(compile=None) would compile (its graph, the tile MLP's bodies).
    torch._dynamo.config.disable = True


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def process_group(tmp_path, monkeypatch):
    """A 1-process gloo group on loopback, rendezvous through a FileStore."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()
