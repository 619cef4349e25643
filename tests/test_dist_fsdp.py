"""FSDP2 of the free parameters (embeddings, norms) with replicated g-nets, on 2 gloo ranks:
the same training as one process on the concatenated batch."""

import pytest
import torch
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, loss_fn
from gbfunc.dist.testing import spawn

CFG = GPTConfig(vocab=64, dim=32, layers=2, heads=4, seq=16)
TILE = (16, 16)
GLOBAL_BATCH, STEPS = 4, 3


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab, (GLOBAL_BATCH, CFG.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same model, hence the same free values, on every rank
    return GPT(CFG)


def _reference() -> dict[str, torch.Tensor]:
    """One process on every step's whole batch; its g-nets and free parameters after."""
    model = _model()
    plan = gb.plan(model, tile=TILE)
    gparams = gb.init(plan, seed=0)
    opt = torch.optim.SGD(gb.trainable_leaves(gparams), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step)
        loss_fn(functional_call(model, gb.apply(gparams, plan), (x,)), y).backward()
        opt.step()
        opt.zero_grad()
    stacks = {f"{k}/{n}": t.detach() for k, s in gparams["stacks"].items() for n, t in s.items()}
    return {**stacks, **{k: t.detach() for k, t in gparams["free"].items()}}


def fsdp_worker(rank: int, world: int) -> dict:
    mesh = gbd.init_mesh()
    model = _model()
    plan = gb.plan(model, tile=TILE)
    gparams = gb.init(plan, seed=0)  # free values from the model, before it is sharded
    sharded = gbd.ShardedFree(plan, model, mesh["dp"], modules=list(model.blocks.values()))
    gnets = sharded.gnet_leaves(gparams)
    sync = gbd.GradSync(gnets, mesh)
    opt = torch.optim.SGD([*gnets, *sharded.free], lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = gbd.shard_batch(_batch(step), mesh)
        loss_fn(functional_call(model, sharded.apply(gparams), (x,)), y).backward()
        sync.wait()
        opt.step()
        opt.zero_grad()
    ours = {f"{k}/{n}": t.detach() for k, s in gparams["stacks"].items() for n, t in s.items()}
    for p in plan.free:
        ours[p.name] = model.get_parameter(p.name).full_tensor().detach()
    ref = _reference()
    assert ours.keys() == ref.keys()
    return {
        "diff": max((ours[k] - ref[k]).abs().max().item() for k in ref),
        "sharded": sorted(p.name for p in plan.free if p.trainable),
        "free_local": sum(p.to_local().numel() for p in sharded.free),
        "free_total": sum(p.numel() for p in sharded.free),
    }


@pytest.mark.slow
def test_fsdp2_of_free_parameters_equals_one_process():
    results = spawn(fsdp_worker, 2)
    for r in results:
        assert r["diff"] < 2e-5, r
        assert any("ln" in n for n in r["sharded"])  # the norms are among the sharded
        assert r["free_local"] * 2 <= r["free_total"] + 2 * len(r["sharded"])  # ~half each
