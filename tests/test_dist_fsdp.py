"""FSDP2 of the free parameters (embeddings, norms) with replicated g-nets, on 2 gloo ranks:
the same training as one process on the concatenated batch."""

import pytest
import torch
from sharded_files import entries, rewrite
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


RESUME_AT = 2  # steps before the checkpoint; one more after it


def _fsdp_run(seed: int) -> tuple[gb.Plan, torch.nn.Module, dict, "gbd.ShardedFree", object]:
    """A 2-block GPT whose free parameters FSDP2 shards over all ranks, its AdamW and sync."""
    mesh = gbd.init_mesh()
    torch.manual_seed(seed)
    model = GPT(CFG)
    plan = gb.plan(model, tile=TILE)
    gparams = gb.init(plan, seed=seed)
    sharded = gbd.ShardedFree(plan, model, mesh["dp"], modules=list(model.blocks.values()))
    gnets = sharded.gnet_leaves(gparams)
    opt = torch.optim.AdamW([*gnets, *sharded.free], lr=0.01, weight_decay=0.1)
    return plan, model, gparams, sharded, (opt, gbd.GradSync(gnets, mesh), mesh)


def _train(model, gparams, sharded, training, steps: range) -> None:
    opt, sync, mesh = training
    for step in steps:
        x, y = gbd.shard_batch(_batch(step), mesh)
        loss_fn(functional_call(model, sharded.apply(gparams), (x,)), y).backward()
        sync.wait()
        opt.step()
        opt.zero_grad()


def _values(plan: gb.Plan, state: dict) -> dict[str, torch.Tensor]:
    """Every g-net leaf and free parameter, whole (a collective for the sharded ones)."""
    out = {f"{k}/{n}": t.detach().clone() for k, s in state["stacks"].items() for n, t in s.items()}
    for name, value in state["free"].items():
        out[name] = value.full_tensor().detach()
    return out


def save_then_train_worker(rank: int, world: int, path: str) -> dict:
    plan, model, gparams, sharded, training = _fsdp_run(seed=0)
    _train(model, gparams, sharded, training, range(RESUME_AT))
    state = sharded.state(gparams)
    gbd.save_sharded(path, state, plan=plan, optimizer=training[0], step=RESUME_AT)
    saved = _values(plan, state)
    dense = gb.export(state, plan)  # the shards gathered whole, on every rank
    _train(model, gparams, sharded, training, range(RESUME_AT, RESUME_AT + 1))
    return {"saved": saved, "dense": dense, "after": _values(plan, sharded.state(gparams))}


def resume_worker(rank: int, world: int, path: str) -> dict:
    plan, model, gparams, sharded, training = _fsdp_run(seed=7)  # other values, overwritten
    state = sharded.state(gparams)
    checkpoint = gbd.load_sharded(path, model, into=state, optimizer=training[0])
    loaded = _values(plan, state)
    _train(model, gparams, sharded, training, range(RESUME_AT, RESUME_AT + 1))
    return {"step": checkpoint.step, "loaded": loaded, "after": _values(plan, state)}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, below
def test_fsdp2_checkpoint_of_two_ranks_resumes_on_four_and_loads_in_one_process(tmp_path):
    """Free parameters and AdamW state sharded by FSDP2 over 2 ranks are written shard by shard
    and read back resharded over 4 ranks, where training goes on as it did on 2."""
    path = str(tmp_path / "ckpt")
    two = spawn(save_then_train_worker, 2, path)
    four = spawn(resume_worker, 4, path)
    saved, after = two[0]["saved"], two[0]["after"]
    for r in two:  # gb.export of the sharded state: the free parameters whole, not shards
        for name, value in r["dense"].items():
            assert type(value) is torch.Tensor, name
        for name in (n for n in saved if "/" not in n):  # the free parameters
            assert torch.equal(r["dense"][name], saved[name]), name
    for r in four:
        assert r["step"] == RESUME_AT
        differ = [k for k in saved if not torch.equal(r["loaded"][k], saved[k])]
        assert not differ, differ  # bitwise
        # One more AdamW step from the restored moments: as on 2 ranks, up to the order of
        # the gradient sums (4 ranks, not 2).
        assert max((r["after"][k] - after[k]).abs().max().item() for k in after) < 2e-6
    whole = gbd.load_sharded(path, GPT(CFG))  # one process: every shard, read whole
    stacks = whole.gparams["stacks"]
    ours = {f"{k}/{n}": t.detach() for k, s in stacks.items() for n, t in s.items()}
    ours |= {k: t.detach() for k, t in whole.gparams["free"].items()}
    assert ours.keys() == saved.keys()
    assert all(torch.equal(ours[k], saved[k]) for k in saved)

    # A free entry altered after the manifest was written: its layout-free checksum fails.
    state = entries(path)
    state["free/wte.weight"][3, 5] += 1.0
    altered = tmp_path / "altered"
    rewrite(path, altered, state)
    with pytest.raises(gb.CheckpointCorruptError, match=r"free/wte\.weight in .*does not match"):
        gbd.load_sharded(altered, GPT(CFG))
