"""Threads: module-level caches read while another thread clears them, and a `gb.Bottleneck`
called from two threads at once."""

import copy
import sys
import threading

import pytest
import torch
from torch import nn

import gbfunc as gb
from gbfunc import _spec


def test_a_cache_read_while_another_thread_clears_it_still_answers():
    # `if key in _MADE: return _MADE[key]` looked the key up twice; its `Genome` hashes in
    # Python, so a clear (every 256 new entries) could land between: KeyError, 108 in 200k.
    plan = gb.plan(nn.Linear(32, 24), tile=(8, 8), hidden=8)
    stack = plan.stacks[0]
    w_in = gb.init(plan)["stacks"][stack.key]["w_in"]
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                _spec.code_tables(stack, w_in)
            except BaseException as error:  # counted, then asserted on
                errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=read)
    try:
        reader.start()
        for n in range(60_000):  # new entries, cleared every 256
            _spec.cached(torch.tensor, n)
    finally:
        done.set()
        reader.join()
        sys.setswitchinterval(interval)
    assert errors == []


class _Gate(nn.Module):
    """Waits inside its forward until released, once: holds a call open."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.release.is_set():
            self.entered.set()
            assert self.release.wait(30)
        return x


def test_a_bottleneck_called_from_a_second_thread_during_a_call_raises():
    # Overlapping calls swapped each other's generated weights into the one p-net: wrong
    # outputs, and generated tensors left in it in place of its parameters.
    torch.manual_seed(0)
    gate = _Gate()
    b = gb.Bottleneck(nn.Sequential(nn.Linear(8, 8), gate), tile=(4, 4))
    x = torch.randn(3, 8)
    with torch.no_grad():
        gate.release.set()
        want = b(x)
        gate.release.clear()
        got: list[torch.Tensor] = []
        first = threading.Thread(target=lambda: got.append(b(x)))
        first.start()
        assert gate.entered.wait(30)
        with pytest.raises(RuntimeError, match="called from a second thread"):
            b(x)
        gate.release.set()
        first.join()
    assert torch.equal(got[0], want)
    assert type(b.pnet[0].weight) is nn.Parameter
    assert torch.equal(b(x), want)  # and the next call, from any thread, runs


def test_a_copy_made_during_another_threads_call_is_free_to_call():
    # The call in progress was marked on the module, so a deepcopy carried it: the copy
    # refused every call from another thread, for good.
    torch.manual_seed(0)
    gate = _Gate()
    b = gb.Bottleneck(nn.Sequential(nn.Linear(8, 8), gate), tile=(4, 4))
    x = torch.randn(3, 8)

    def call() -> None:
        with torch.no_grad():  # (grad mode is per thread)
            b(x)

    first = threading.Thread(target=call)
    first.start()
    assert gate.entered.wait(30)
    b.pnet[1] = nn.Identity()  # (the gate's events do not deepcopy; the call holds its own)
    twin = copy.deepcopy(b)
    gate.release.set()
    first.join()
    with torch.no_grad():
        assert torch.equal(twin(x), b(x))
