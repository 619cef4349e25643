"""The torchrun examples train: data parallel (replicated and rank-owned g-nets), tensor
parallel and pipeline parallel, each on 2 gloo ranks for a few steps; and the docs' torchrun
scripts (tests/test_readme.py's `<!-- run: torchrun ... -->` blocks) run as their pages say."""

import re
from pathlib import Path

import pytest
import torch
from test_readme import ROOT, TORCHRUN, torchrun_blocks
from torch.func import functional_call
from torchrun import torchrun

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig


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


# ---------------------------------------------------------------- the docs' torchrun scripts


def attempt(log: str, n: int) -> list[str]:
    """What rank 0 printed in torchrun's attempt `n` (the tutorial's `[attempt n]` lines)."""
    prefix = f"[attempt {n}] "
    return [line.removeprefix(prefix) for line in log.splitlines() if line.startswith(prefix)]


def losses(lines: list[str]) -> dict[int, str]:
    """`{step: loss as printed}` from lines `step  N  loss X`."""
    found = (re.fullmatch(r"step +(\d+)  loss (\d+\.\d+)", line) for line in lines)
    return {int(m[1]): m[2] for m in found if m}


def counts_up(path: Path) -> float:
    """How often the GPT of the sharded checkpoint at `path`, read whole by one process,
    predicts the next token of sequences counting up modulo 8 (an untrained one: 1/8)."""
    model = GPT(GPTConfig(vocab=64, dim=64, layers=2, heads=4, seq=32))  # the page's CONFIG
    checkpoint = gbd.load_sharded(path, model)
    x = (torch.arange(8)[:, None] + torch.arange(32)) % 8
    with torch.no_grad():
        logits = functional_call(model, gb.apply(checkpoint.gparams, checkpoint.plan), (x,))
    return (logits.argmax(-1) == (x + 1) % 8).float().mean().item()


def check_torchrun_tutorial(log: str, cwd: Path) -> None:
    """docs/tutorials/torchrun.md: rank 1 lost at step 25 of 40, checkpoints every 10."""
    first, second = attempt(log, 0), attempt(log, 1)
    assert first[:2] == ["2 ranks on gloo", "rank 0 holds 48 of the 96 g-nets"], log
    assert "step 20  saved ckpt/" in first, log
    assert not any(line.startswith("resumed") for line in first), log
    assert re.search(r"exitcode: 1\) local_rank: 1 ", log), log  # rank 1 was lost
    assert "resumed from ckpt/ at step 20" in second, log
    before, after = losses(first), losses(second)
    assert (max(before), min(after), max(after)) == (25, 25, 40), log
    assert after[25] == before[25], log  # steps 21-25 again, from the checkpoint: the same
    assert float(after[40]) < float(before[5]) - 1.5, log  # it trained
    assert "step 40  saved ckpt/" in second, log
    assert counts_up(cwd / "ckpt") > 0.5


CHECKS = {"docs/tutorials/torchrun.md": check_torchrun_tutorial}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP read in one process
@pytest.mark.parametrize("block", torchrun_blocks(), ids=str)
def test_docs_torchrun_script_runs_as_its_page_says(tmp_path, block):
    """The block is written to the file its `<!-- run: torchrun ... -->` line names and
    launched by that command, restarts included, in an empty folder; then its page's checks."""
    nproc, restarts, name = TORCHRUN.fullmatch(block.above.strip()).groups()
    (tmp_path / name).write_text(block.body)
    log = torchrun(tmp_path, name, max_restarts=int(restarts or 0), nproc=int(nproc), cwd=tmp_path)
    CHECKS[block.path.relative_to(ROOT).as_posix()](log, tmp_path)
