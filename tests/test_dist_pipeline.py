"""Pipeline-parallel p-nets on real gloo ranks: each stage generates only its own layers."""

import hashlib

import pytest
import torch
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, loss_fn
from gbfunc.dist.testing import spawn

CFG = GPTConfig(vocab=64, dim=32, layers=2, heads=4, seq=16)
GLOBAL_BATCH, MICROBATCHES, STEPS = 8, 4, 2


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab, (GLOBAL_BATCH, CFG.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def pipeline_worker(rank: int, world: int) -> dict:
    mesh = gbd.init_mesh(pp=world)
    with torch.device("meta"):
        dense = GPT(CFG)
    plan = gb.plan(dense, tile=(16, 16))
    index = mesh.get_local_rank("pp")
    module = GPT(CFG, stage=(index, world))
    generator = gbd.StageGenerator(plan, module)
    stage = PipelineStage(module, index, world, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)

    gparams, ref = gb.init(plan, seed=0), gb.init(plan, seed=0)
    sync = gbd.GradSync(gb.trainable_leaves(gparams), mesh)
    opt = torch.optim.SGD(gb.trainable_leaves(gparams), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(gb.trainable_leaves(ref), lr=0.1, momentum=0.9)
    out: dict = {"tiles": generator.selection.num_tiles, "losses": [], "ref_losses": []}
    for step in range(STEPS):
        x, y = _batch(step)
        generator.load(gparams)
        if index == 0:
            schedule.step(x)
        else:
            losses: list[torch.Tensor] = []
            schedule.step(target=y, losses=losses)
            out["losses"].append(torch.stack(losses).mean().item())
        generator.backward(gparams)
        sync.wait()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(functional_call(dense, gb.apply(ref, plan), (x,)), y)
        ref_loss.backward()
        out["ref_losses"].append(ref_loss.item())
        ref_opt.step()
        ref_opt.zero_grad()
    pairs = zip(gb.trainable_leaves(gparams), gb.trainable_leaves(ref), strict=True)
    out["diff"] = max((a.detach() - b.detach()).abs().max().item() for a, b in pairs)
    leaves = gb.trainable_leaves(gparams)
    out["digest"] = hashlib.sha256(
        b"".join(t.detach().numpy().tobytes() for t in leaves)
    ).hexdigest()
    return out


@pytest.mark.slow
def test_two_stage_gpipe_matches_one_process():
    first, last = spawn(pipeline_worker, 2)
    with torch.device("meta"):
        plan = gb.plan(GPT(CFG), tile=(16, 16))
    assert first["tiles"] + last["tiles"] == sum(s.num_tiles for s in plan.stacks)  # each its own
    assert last["losses"] == pytest.approx(last["ref_losses"], rel=1e-5)
    for r in (first, last):
        assert r["diff"] < 2e-5, r  # a scale_grads slip would be off by 4x (4 micro-batches)
    assert first["digest"] == last["digest"]
