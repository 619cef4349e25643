"""The torchrun examples train: data parallel (replicated and rank-owned g-nets), tensor
parallel and pipeline parallel, each on 2 gloo ranks for a few steps."""

import re

import pytest
from torchrun import torchrun


@pytest.mark.slow
@pytest.mark.parametrize(
    "example",
    [
        ("examples.train_ddp",),
        ("examples.train_ddp", "--strategy", "owned"),
        ("examples.train_tp",),
        ("examples.train_pipeline",),
    ],
    ids=["ddp", "ddp-owned", "tp", "pipeline"],
)
def test_example_trains_on_two_ranks(tmp_path, example):
    log = torchrun(tmp_path, *example, "--steps", "11", "--global-batch", "8")
    losses = [float(x) for x in re.findall(r"^step +\d+  loss (\d+\.\d+)", log, re.M)]
    assert len(losses) == 2, log  # steps 0 and 10, printed once
    assert losses[1] < losses[0] - 0.5, log
