"""Tensor-parallel p-nets on real gloo ranks: each rank generates only its shards."""

import hashlib

import pytest
import torch
from torch.distributed.tensor.parallel import parallelize_module
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, loss_fn, sp_plan, tp_plan
from gbfunc.dist.testing import spawn

CFG = GPTConfig(vocab=64, dim=32, layers=2, heads=4, seq=16)
TILE = (8, 16)  # divides every local shard at tp=2: 32/2 rows or columns, 128/2
GLOBAL_BATCH, STEPS = 4, 2


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab, (GLOBAL_BATCH, CFG.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _diff(a: dict, b: dict) -> float:
    pairs = zip(gb.trainable_leaves(a), gb.trainable_leaves(b), strict=True)
    return max((x.detach() - y.detach()).abs().max().item() for x, y in pairs)


def tp_worker(
    rank: int, world: int, dp: int, tp: int, sequence: bool = False, path: str | None = None
) -> dict:
    mesh = gbd.init_mesh(dp=dp, tp=tp)
    with torch.device("meta"):
        dense, model = GPT(CFG), GPT(CFG)
    plan = gb.plan(dense, tile=TILE)
    parallelize_module(model, mesh["tp"], (sp_plan if sequence else tp_plan)(model))
    shards = gbd.TensorParallel(plan, model, mesh["tp"])
    out = {"misaligned": shards.misaligned, "tiles": shards.selection.num_tiles}
    norm = shards.apply(gb.init(plan, seed=0))["blocks.0.ln1.weight"]
    out["norm_replicated"] = [p.is_replicate() for p in getattr(norm, "placements", ())]

    ref = gb.init(plan, seed=0)
    gparams = gb.init(plan, seed=0)
    sync = gbd.GradSync(gb.trainable_leaves(gparams), mesh)
    opt = torch.optim.SGD(gb.trainable_leaves(gparams), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(gb.trainable_leaves(ref), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step)
        xl, yl = gbd.shard_batch((x, y), mesh)
        logits = functional_call(model, shards.apply(gparams), (xl,))
        if step == 0:
            with torch.no_grad():
                expected = functional_call(dense, gb.apply(gparams, plan), (xl,))
            out["forward_diff"] = (logits.detach() - expected).abs().max().item()
        loss_fn(logits, yl).backward()
        sync.wait()
        opt.step()
        opt.zero_grad()
        loss_fn(functional_call(dense, gb.apply(ref, plan), (x,)), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out["diff"] = _diff(gparams, ref)
    out["digest"] = _digest(gparams)
    if not sequence and path is None:
        out["planned_after"] = _planned_after_parallelizing(mesh)
    if path is not None:  # the replicated g-nets and SGD momenta, one copy of each entry
        gbd.save_sharded(path, gparams, plan=plan, optimizer=opt, step=STEPS)
        out["momenta"] = _digest({"stacks": {}, "free": dict(enumerate(_momenta(opt)))})
    return out


def _planned_after_parallelizing(mesh) -> float:
    """A plan made from a real model after `parallelize_module`: `gb.init` copies its free
    parameters whole (they are DTensors there; `TensorParallel.apply` refused them deep in
    `DTensor.from_local`), and the shards generate the unsharded model's outputs."""
    torch.manual_seed(0)
    dense, model = GPT(CFG), GPT(CFG)
    model.load_state_dict(dense.state_dict())
    parallelize_module(model, mesh["tp"], tp_plan(model))
    plan = gb.plan(model, tile=TILE)
    gparams = gb.init(plan, seed=0)
    assert all(type(t) is torch.Tensor for t in gparams["free"].values())
    reference = gb.init(gb.plan(dense, tile=TILE), seed=0)
    assert _digest(gparams) == _digest(reference)
    x, _ = _batch(0)
    with torch.no_grad():
        logits = functional_call(
            model, gbd.TensorParallel(plan, model, mesh["tp"]).apply(gparams), (x,)
        )
        expected = functional_call(dense, gb.apply(reference, plan), (x,))
    return (logits - expected).abs().max().item()


def _digest(gparams: dict) -> str:
    leaves = gb.trainable_leaves(gparams)
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in leaves)).hexdigest()


def _momenta(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [opt.state[p]["momentum_buffer"] for g in opt.param_groups for p in g["params"]]


def _check(results: list[dict], tp: int) -> None:
    with torch.device("meta"):
        plan = gb.plan(GPT(CFG), tile=TILE)
    total = sum(s.num_tiles for s in plan.stacks)
    for r in results:
        assert r["misaligned"] == ()
        assert r["tiles"] * tp == total  # every generated weight is sharded: 1/tp of its tiles
        assert r["forward_diff"] < 1e-5, r
        assert r["diff"] < 2e-5, r
    assert len({r["digest"] for r in results}) == 1  # bitwise-identical g-nets on every rank


@pytest.mark.slow
def test_tensor_parallel_matches_one_process():
    results = spawn(tp_worker, 2, 1, 2)
    _check(results, tp=2)
    assert all(r["planned_after"] < 1e-5 for r in results), results


@pytest.mark.slow
def test_sequence_parallel_matches_one_process_with_replicated_layernorms():
    """Megatron-style SP on top of TP: the same loss, gradients and updates as one process;
    the free LayerNorm weights are replicated DTensors whose gradients (partial sums over each
    rank's part of the sequence) are summed before the update."""
    results = spawn(tp_worker, 2, 1, 2, True)
    _check(results, tp=2)
    assert all(r["norm_replicated"] == [True] for r in results), results


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, below
def test_data_and_tensor_parallel_2x2_matches_one_process_and_its_checkpoint_loads(tmp_path):
    results = spawn(tp_worker, 4, 2, 2, False, str(tmp_path), timeout=120)
    _check(results, tp=2)
    # What the 4 ranks saved, read by one process: the same g-nets and momenta, bitwise.
    with torch.device("meta"):
        model = GPT(CFG)
    plan = gb.plan(model, tile=TILE)
    gparams = gb.init(plan, seed=1)
    opt = torch.optim.SGD(gb.trainable_leaves(gparams), lr=0.5, momentum=0.5)
    checkpoint = gbd.load_sharded(tmp_path, model, into=gparams, optimizer=opt)
    assert checkpoint.step == STEPS
    assert _digest(gparams) == results[0]["digest"]
    assert _digest({"stacks": {}, "free": dict(enumerate(_momenta(opt)))}) == results[0]["momenta"]
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (0.1, 0.9)
