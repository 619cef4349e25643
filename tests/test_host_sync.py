"""A training step through `gb.apply` never waits on the device: no op of its forward or
backward reads a tensor's value on the host (`aten._local_scalar_dense`, what `.item()`,
`.tolist()`, `bool(t)` and data-dependent shapes dispatch), on every path CPU tests reach.
On a GPU such a read is a synchronisation per call, and it keeps a step out of a CUDA graph
(`torch.compile(mode="reduce-overhead")`)."""

import pytest
import torch
from torch import nn
from torch.func import functional_call

import gbfunc as gb
from benchmarks.bench_overhead import OpCounter  # counts every aten op dispatched

GENOMES = {
    "default": {"tile": (8, 8)},
    "deep, several outputs": {"tile": (8, 8), "hidden": 8, "depth": 2, "outputs": 4},
    "row g-nets": {"tile": (8, 8), "hidden": 8, "outputs": 8},
    "hashed": {"tile": (8, 8), "hidden": 4, "hashed": 7},
    "shared, embeddings": {"tile": (8, 8), "hidden": 8, "share": True, "embed_dim": 4},
}


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("genome", GENOMES)
def test_a_step_reads_no_value_on_the_host(genome, compile):
    """Under the counting mode `compile=True` takes the C loops where they apply and torch
    elsewhere: compiled code cannot run inside a dispatch mode, and the dispatcher knows it
    (it had raised "found no compiled frames")."""
    model = nn.Sequential(nn.Linear(20, 12), nn.ReLU(), nn.Linear(12, 5))  # ragged tiles
    plan = gb.plan(model, **GENOMES[genome])
    gparams = gb.init(plan, seed=0)
    x, y = torch.randn(3, 20), torch.randint(0, 5, (3,))
    gb.apply(gparams, plan, compile=compile)  # builds and compiles outside the count
    with OpCounter() as counter:
        out = functional_call(model, gb.apply(gparams, plan, compile=compile), (x,))
        nn.functional.cross_entropy(out, y).backward()
    assert counter.ops["_local_scalar_dense"] == 0, counter.ops
    assert counter.ops  # the mode saw the step
