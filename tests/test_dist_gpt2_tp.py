"""transformers' GPT-2 under tensor parallelism on 2 gloo ranks: the fused Q/K/V sharded by
heads, each rank generating only its own heads' tiles, equal to one process."""

import pytest
import torch
from tiny_gpt2 import tiny_gpt2_config
from torch.distributed.tensor.parallel import parallelize_module
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from gbfunc.dist.testing import spawn

TILE = (8, 8)  # divides every local shard at tp=2: 32 / 2 and 128 / 2
STEPS = 2


def _config():
    transformers = pytest.importorskip("transformers")
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    config = tiny_gpt2_config(transformers, attn_implementation="eager", **no_dropout)
    return transformers, config


def _model():
    transformers, config = _config()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _loss(model, params, tokens):
    logits = functional_call(model, params, (tokens[:, :-1],)).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(step))


def gpt2_tp_worker(rank: int, world: int) -> dict:
    from examples.gpt2_tp import FUSED, shard_heads, tp_plan

    mesh = gbd.init_mesh(tp=world)
    dense, model = _model(), _model()
    plan = gb.plan(dense, tile=TILE)
    parallelize_module(model, mesh["tp"], tp_plan(model))
    shard_heads(model, world)
    shards = gbd.TensorParallel(plan, model, mesh["tp"], fused=FUSED)
    out = {"tiles": shards.selection.num_tiles, "misaligned": shards.misaligned}
    gparams, ref = gb.init(plan, seed=0), gb.init(plan, seed=0)
    sync = gbd.GradSync(gb.trainable_leaves(gparams), mesh)
    opt = torch.optim.SGD(gb.trainable_leaves(gparams), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(gb.trainable_leaves(ref), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        tokens = _tokens(step)  # the same batch on both ranks: tp only
        loss = _loss(model, shards.apply(gparams), tokens)
        ref_loss = _loss(dense, gb.apply(ref, plan), tokens)
        if step == 0:
            out["loss_diff"] = abs(loss.item() - ref_loss.item())
        loss.backward()
        sync.wait()
        opt.step()
        opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    pairs = zip(gb.trainable_leaves(gparams), gb.trainable_leaves(ref), strict=True)
    out["diff"] = max((a.detach() - b.detach()).abs().max().item() for a, b in pairs)
    return out


@pytest.mark.slow
def test_gpt2_with_heads_sharded_matches_one_process():
    _config()
    results = spawn(gpt2_tp_worker, 2)
    plan = gb.plan(_model(), tile=TILE)
    total = sum(s.num_tiles for s in plan.stacks)
    for r in results:
        assert r["misaligned"] == ()
        assert r["tiles"] * 2 == total  # each rank generates half of every weight's tiles
        assert r["loss_diff"] < 1e-5, r
        assert r["diff"] < 2e-5, r
