"""Shared test configuration.

Triton kernels run compiled on a GPU and through Triton's interpreter elsewhere;
`@triton.jit` reads TRITON_INTERPRET when a kernel is defined, so it is set here, before
anything imports the kernels.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

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


@pytest.fixture(autouse=True)
def _one_autotune_config(request, monkeypatch) -> None:
    """On a GPU, tests run the Triton kernels with one autotune config, not the sweep.

    Each new tile shape (hypothesis draws one per example) would compile and time every
    `(BLOCK_N, num_warps)` config of both kernels. The tests take the smallest (the
    interpreter's block size); the tests about the configs ask for `all_autotune_configs`.
    """
    if not torch.cuda.is_available() or "all_autotune_configs" in request.fixturenames:
        return
    for kernel in _tuned_kernels():
        smallest = min(kernel.configs, key=lambda c: (c.kwargs["BLOCK_N"], c.num_warps))
        monkeypatch.setattr(kernel, "configs", [smallest])


@pytest.fixture
def all_autotune_configs() -> tuple:
    """The autotuned kernels, forward and backward, with their full config lists."""
    return _tuned_kernels()


def _tuned_kernels() -> tuple:
    if importlib.util.find_spec("triton") is None:
        return ()
    from gbfunc.kernels.generate import kernel as forward
    from gbfunc.kernels.generate_backward import kernel as backward

    return forward._generate_kernel, backward._generate_backward_kernel


@pytest.fixture
def process_group(tmp_path, monkeypatch):
    """A 1-process gloo group on loopback, rendezvous through a FileStore."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.fixture
def fresh_loops(monkeypatch, tmp_path) -> Path:
    """The CPU loops' state of a new process, `auto` mode, building into a cache of the
    test's own (returned); the process's own state comes back after the test."""
    from gbfunc.cpu import _build, _cache, _mode

    monkeypatch.setattr(_build, "_libraries", {})
    monkeypatch.setattr(_build, "_functions", {})
    monkeypatch.setattr(_mode, "_failure", None)
    monkeypatch.setattr(_mode, "_forced", None)
    monkeypatch.delenv(_mode.MODE_VARIABLE, raising=False)
    monkeypatch.setenv(_cache.CACHE_VARIABLE, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def failing_loops(fresh_loops, monkeypatch, tmp_path) -> None:
    """`fresh_loops` in a process whose builds fail (`CXX` is a program that fails)."""
    failing = tmp_path / "failing-compiler"
    failing.write_text("#!/bin/sh\necho 'failing-compiler: cannot build' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))


@pytest.fixture
def loops_off(monkeypatch) -> pytest.MonkeyPatch:
    """The CPU loops switched off for the test, as `GBFUNC_CPU_LOOPS=off` does."""
    from gbfunc.cpu import _mode

    monkeypatch.setattr(_mode, "_forced", "off")
    return monkeypatch


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> Path:
    """The documentation site, built once per test process by `mkdocs build --strict`."""
    pytest.importorskip("mkdocs", reason="needs the docs extra (the README's test command)")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about 2.0
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-4000:]}"
    return out
