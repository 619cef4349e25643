"""Faults on real gloo ranks: a rank with another plan, a rank that dies, a child that raises."""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.func import functional_call
from torch.multiprocessing import ProcessRaisedException
from torchrun import torchrun

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, loss_fn
from gbfunc.dist.testing import spawn

CFG = GPTConfig(vocab=64, dim=32, layers=2, heads=4, seq=16)
PG_TIMEOUT = 5.0


def faults_worker(rank: int, world: int) -> dict:
    mesh = gbd.init_mesh()
    with torch.device("meta"):
        model = GPT(CFG)
    out: dict = {}

    # A rank whose plan differs: every rank fails at start-up, naming the parameter.
    overrides = {"blocks.1.mlp.fc2.weight": {"hidden": 16}} if rank == 1 else None
    try:
        gbd.check_plan(gb.plan(model, tile=(16, 16), overrides=overrides))
    except ValueError as error:
        out["plan_error"] = str(error)

    # A rank that dies mid-step: the survivor's gradient all-reduce fails instead of hanging.
    plan = gb.plan(model, tile=(16, 16))
    gparams = gb.init(plan, seed=0)
    sync = gbd.GradSync(gb.trainable_leaves(gparams), mesh)
    x = torch.randint(0, CFG.vocab, (2, CFG.seq))
    loss = loss_fn(functional_call(model, gb.apply(gparams, plan), (x,)), x)
    if rank == 1:
        os._exit(0)  # dies after its forward pass, before any gradient is exchanged
    start = time.monotonic()
    try:
        loss.backward()
        sync.wait()
    except gbd.CollectiveError as error:
        out["dead_error"] = str(error)
    out["dead_seconds"] = time.monotonic() - start
    return out


def raising_worker(rank: int, world: int) -> None:
    # Both process groups up first: rank 1 raising while rank 0 still connected made rank 0's
    # init fail ("Gloo connectFullMesh failed"), and that error was the one re-raised.
    dist.barrier()
    if rank == 1:
        raise KeyError("rank 1 is broken")
    threading.Event().wait()  # never set: rank 0 returns only by being terminated


def hanging_worker(rank: int, world: int) -> None:
    threading.Event().wait()  # never set


@pytest.mark.slow
def test_mismatched_plan_and_dead_rank_fail_with_clear_errors():
    survivor, dead = spawn(faults_worker, 2, pg_timeout=PG_TIMEOUT)
    assert dead is None  # exited without a result
    assert (
        "rank 1's plan differs from rank 0's at parameter 'blocks.1.mlp.fc2.weight'"
        in survivor["plan_error"]
    )
    assert "a peer rank probably died" in survivor["dead_error"]
    assert survivor["dead_seconds"] < PG_TIMEOUT + 5


@pytest.mark.slow
def test_child_exception_is_reraised_with_its_traceback_and_peers_stopped():
    start = time.monotonic()
    with pytest.raises(ProcessRaisedException, match="rank 1 is broken") as info:
        spawn(raising_worker, 2)
    assert "raising_worker" in str(info.value)  # the child's traceback
    assert time.monotonic() - start < 30  # rank 0 was terminated, not waited for


@pytest.mark.slow
def test_spawn_kills_ranks_past_the_global_timeout():
    with pytest.raises(TimeoutError, match=r"ran over 3\.0 s"):
        spawn(hanging_worker, 1, timeout=3.0)


def _resume(tmp_path, name: str, *args: str) -> str:
    """`examples.train_resume` on 2 ranks, allowed one restart, saving under `tmp_path/name`."""
    args = ("--dir", str(tmp_path / name), *args)
    return torchrun(tmp_path, "examples.train_resume", *args, max_restarts=1)


@pytest.mark.slow
def test_a_rank_killed_mid_run_is_restarted_by_torchrun_and_ends_bitwise_where_no_kill_does(
    tmp_path,
):
    """Rank 1 SIGKILLs itself at step 15 (checkpoints every 10 steps); torchrun restarts both
    ranks as new processes, they resume from step 10 and end at the uninterrupted run's
    parameters, bit for bit (gloo on CPU sums two ranks in a fixed order)."""
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=64, dim=64, layers=2, heads=4, seq=32))
    steps = ("--steps", "20", "--every", "10")
    _resume(tmp_path, "whole", *steps)
    log = _resume(tmp_path, "killed", *steps, "--die-at", "15")
    assert "starting at step 0" in log
    assert "starting at step 10" in log  # the restarted attempt resumed
    assert "exitcode: -9" in log  # rank 1 died of SIGKILL
    whole = gb.load(tmp_path / "whole" / "final.safetensors", model)
    killed = gb.load(tmp_path / "killed" / "final.safetensors", model)
    for a, b in zip(
        gb.trainable_leaves(whole.gparams), gb.trainable_leaves(killed.gparams), strict=True
    ):
        assert torch.equal(a, b)
