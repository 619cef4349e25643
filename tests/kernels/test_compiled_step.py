"""A whole training step through `gb.apply` compiled with `fullgraph=True`, by default and
with `mode="reduce-overhead"` (CUDA graphs on a GPU): the losses of several steps are the
eager ones. On a GPU the stacks run the Triton kernels (`gb.explain` says so); on CPU the
same step compiles through the pure-torch path."""

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad_and_value

import gbfunc as gb

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def training(compile_mode: str | None) -> list[float]:
    """Losses of four functional AdamW steps, compiled with `compile_mode` (None: eager)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 20), nn.ReLU(), nn.Linear(20, 5)).to(DEVICE)
    plan = gb.plan(model, tile=(8, 8), hidden=8, depth=2)  # ragged tiles, two hidden layers
    tree = gb.init(plan, device=DEVICE, requires_grad=False)
    state = gb.optim.adamw_init(tree)
    x = torch.randn(6, 24, device=DEVICE)
    y = torch.randint(0, 5, (6,), device=DEVICE)
    if DEVICE == "cuda":
        assert set(gb.explain(gb.init(plan, device=DEVICE), plan).route.stacks) == {"triton"}

    def loss(tree):
        return nn.functional.cross_entropy(functional_call(model, gb.apply(tree, plan), (x,)), y)

    def step(tree, state):
        grads, value = grad_and_value(loss)(tree)
        tree, state = gb.optim.adamw_update(tree, grads, state, lr=1e-2)
        return tree, state, value

    if compile_mode is not None:
        step = torch.compile(step, fullgraph=True, mode=compile_mode)
    losses = []
    for _ in range(4):
        tree, state, value = step(tree, state)
        losses.append(float(value))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_a_whole_training_step_compiles_fullgraph_and_trains_as_eager(mode):
    eager = training(None)
    assert eager[-1] < eager[0]
    torch.testing.assert_close(training(mode), eager, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "notice",
    [
        # inductor on an H200 (torch 2.11) while lowering the step's cross_entropy: the suite's
        # `error` filter made it a LoweringException that failed both steps above (2026-11-28,
        # benchmarks/results/gpu_rerun.log); the filter matches its leading newline
        "\nOnline softmax is disabled on the fly since Inductor decides to\n"
        "split the reduction. Cut an issue to PyTorch if this is an\n",
        # torch's CUDA-graph tree manager captures an empty graph to keep its memory pool alive
        # and drops this warning (`catch_warnings(record=True)`, which keeps the filters): the
        # `error` filter failed the reduce-overhead step on the H200 of 2026-11-29
        # (benchmarks/results/gpu_rerun_1129.log)
        "The CUDA Graph is empty. This usually means that the graph was attempted to be "
        "captured on wrong device or stream.",
    ],
    ids=["online-softmax", "empty-cuda-graph"],
)
def test_torchs_own_notices_on_a_gpu_are_not_errors(notice):
    """pyproject ignores them: under the suite's filters they are neither raised nor shown."""
    with warnings.catch_warnings(record=True) as shown:
        warnings.warn(notice, UserWarning, stacklevel=1)
    assert shown == []
