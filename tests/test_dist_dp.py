"""Data parallel on real gloo ranks: replicated and rank-owned g-nets equal one big-batch
process, and a restart from a checkpoint continues the same trajectory."""

import hashlib
import os

import pytest
import torch
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from benchmarks.bench_comm import rank_owned_traffic, replicated_traffic
from examples.gpt import GPT, GPTConfig, loss_fn
from gbfunc.dist.testing import spawn

CFG = GPTConfig(vocab=64, dim=32, layers=2, heads=4, seq=16)
LOCAL_BATCH, STEPS, SAVE_AT = 2, 3, 2


def _setup() -> tuple[torch.nn.Module, gb.Plan]:
    with torch.device("meta"):
        model = GPT(CFG)
    # The first block's g-nets are shared and hashed: per-tile leaves are sharded by tile.
    return model, gb.plan(
        model, tile=(16, 16), overrides={"blocks.0.*": {"share": True, "hashed": 6}}
    )


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab, (rows, CFG.seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _train(gparams, generate, model, opt, steps, shard, after_backward=lambda: None) -> None:
    world = torch.distributed.get_world_size()
    for step in steps:
        x, y = shard(_batch(step, LOCAL_BATCH * world))
        loss_fn(functional_call(model, generate(gparams), (x,)), y).backward()
        after_backward()
        opt.step()
        opt.zero_grad()


def _sgd(gparams: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(gb.trainable_leaves(gparams), lr=0.1, momentum=0.9)


def _max_diff(a: dict, b: dict) -> float:
    pairs = zip(gb.trainable_leaves(a), gb.trainable_leaves(b), strict=True)
    return max((x.detach() - y.detach()).abs().max().item() for x, y in pairs)


def _digest(gparams: dict) -> str:
    leaves = gb.trainable_leaves(gparams)
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in leaves)).hexdigest()


def dp_worker(rank: int, world: int, tmp: str) -> dict:
    mesh = gbd.init_mesh()
    model, plan = _setup()
    gbd.check_plan(plan)
    shard = lambda batch: gbd.shard_batch(batch, mesh)
    generate = lambda g: gb.apply(g, plan)
    ref = gb.init(plan, seed=0)  # one process, global batch
    _train(ref, generate, model, _sgd(ref), range(STEPS), lambda batch: batch)
    out: dict = {}

    # Replicated g-nets: every rank generates everything; g-net gradients all-reduced.
    gparams = gb.init(plan, seed=0)
    sync, opt = gbd.GradSync(gb.trainable_leaves(gparams), mesh), _sgd(gparams)
    _train(gparams, generate, model, opt, range(SAVE_AT), shard, sync.wait)
    path = os.path.join(tmp, "ckpt.safetensors")
    gb.dist.save_replicated(path, gparams, plan, opt_state=opt.state_dict(), step=SAVE_AT)
    _train(gparams, generate, model, opt, range(SAVE_AT, STEPS), shard, sync.wait)
    out["replicated_diff"] = _max_diff(gparams, ref)
    out["replicated_digest"] = _digest(gparams)
    out["replicated_bytes"] = sync.comm_bytes

    # Restart: everything rebuilt from the checkpoint continues the same trajectory.
    resumed, _, opt_state, step, _ = gb.load(path, model)
    opt = _sgd(resumed)
    opt.load_state_dict(opt_state)
    sync = gbd.GradSync(gb.trainable_leaves(resumed), mesh)
    _train(resumed, generate, model, opt, range(step, STEPS), shard, sync.wait)
    out["resumed_digest"] = _digest(resumed)

    # Rank-owned g-nets: owners generate, tiles all-gathered, tile gradients reduce-scattered.
    owned = gbd.RankOwned(plan)
    local = owned.shard(gb.init(plan, seed=0))
    free_sync = gbd.GradSync(list(local["free"].values()), mesh)
    _train(local, owned.apply, model, _sgd(local), range(STEPS), shard, free_sync.wait)
    full = owned.gather(local)
    out["owned_diff"] = _max_diff(full, ref)
    out["owned_digest"] = _digest(full)
    out["owned_bytes"] = owned.comm_bytes + free_sync.comm_bytes
    out["owned_gnets"] = sum(len(leaves["w_in"]) for leaves in local["stacks"].values())

    # A conditioned plan (issue 56), rank-owned: each rank holds the part of the task
    # embedding's gradient its own g-nets give, summed over the ranks by `apply`.
    conditioned = gb.plan(model, tile=(16, 16), condition=3, tasks=2)
    generate = lambda g: gb.apply(g, conditioned, task=1)
    ref = _with_w_cond(gb.init(conditioned, seed=0))
    _train(ref, generate, model, _sgd(ref), range(STEPS), lambda batch: batch)
    owned = gbd.RankOwned(conditioned)
    local = owned.shard(_with_w_cond(gb.init(conditioned, seed=0)))
    free_sync = gbd.GradSync(list(local["free"].values()), mesh)
    generate = lambda g: owned.apply(g, task=1)
    _train(local, generate, model, _sgd(local), range(STEPS), shard, free_sync.wait)
    out["conditioned_diff"] = _max_diff(owned.gather(local), ref)
    out.update(_one_gnet_two_ranks(mesh))
    out.update(_grad_sync_cases(mesh))
    out.update(_owned_cases(mesh))
    return out


def _owned_cases(mesh) -> dict:
    """`RankOwned`: its group waits as long as the world's (it took torch's 30-minute default,
    so a dead peer hung the tile collectives); a stack that one rank's loss leaves out trains
    as replicated g-nets do (the ranks' reduce-scatters paired across stacks, or hung); tasks
    that differ between the ranks raise on every rank (each weight mixed tiles of both)."""
    from gbfunc.dist._sync import group_timeout

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 6))
    plan = gb.plan(model, tile="full")  # two stacks, one g-net each: one per rank
    owned = gbd.RankOwned(plan)
    world_timeout = group_timeout(torch.distributed.group.WORLD)
    out = {"timeouts": [group_timeout(owned.group), world_timeout]}

    def loss(weights: dict, x: torch.Tensor, step: int) -> torch.Tensor:
        h = x @ weights["0.weight"].T + weights["0.bias"]
        if rank == 0 and step == 0:  # this rank's first loss leaves the second layer out
            return h[:, :6].square().mean()
        return (h @ weights["1.weight"].T + weights["1.bias"]).square().mean()

    replicated, local = gb.init(plan, seed=0), owned.shard(gb.init(plan, seed=0))
    for gparams, generate, leaves in (
        (replicated, lambda g: gb.apply(g, plan), gb.trainable_leaves(replicated)),
        (local, owned.apply, list(local["free"].values())),
    ):
        sync, opt = gbd.GradSync(leaves, mesh), _sgd(gparams)
        for step in range(2):
            x = gbd.shard_batch(
                torch.randn(8, 4, generator=torch.Generator().manual_seed(step)), mesh
            )
            loss(generate(gparams), x, step).backward()
            sync.wait()
            opt.step()
            opt.zero_grad()
    out["skipped_stack_diff"] = _max_diff(owned.gather(local), replicated)

    conditioned = gb.plan(model, tile="full", condition=3, tasks=2)
    owned = gbd.RankOwned(conditioned)
    local = owned.shard(_with_w_cond(gb.init(conditioned, seed=0)))
    try:
        owned.apply(local, task=rank)
        out["task_per_rank"] = None
    except ValueError as e:
        out["task_per_rank"] = str(e)
    return out


def _grad_sync_cases(mesh) -> dict:
    """`GradSync` against gradients summed by hand, in one process's terms: a leaf no rank
    used keeps `.grad` None (it got zeros, which AdamW decays and moves); `overlap=False`
    reduces two backward passes once, with a pipeline mesh's divisor of 1 (the advice to
    wait after each pass summed the first pass's sum again); a `GradSync` rebuilt over the
    same leaves replaces the old one (whose hooks raised "accumulated twice")."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    inputs = [[torch.full((3,), 1.0 + rank + 10 * k) for k in range(2)] for rank in range(world)]
    used, unused = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    sync = gbd.GradSync([used, unused], mesh)
    (used * inputs[rank][0]).sum().backward()
    sync.wait()
    out = {
        "unused_grad": unused.grad,
        "used_grad_ok": bool(torch.allclose(used.grad, sum(x[0] for x in inputs) / world)),
    }
    pipeline = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    leaf = torch.ones(3, requires_grad=True)
    sync = gbd.GradSync([leaf], pipeline, overlap=False)
    for k in range(2):  # two stages' (or micro-batches') backward passes before one wait
        (leaf * inputs[rank][k]).sum().backward()
    sync.wait()
    want = sum(x for per_rank in inputs for x in per_rank)  # summed: pp's divisor is 1
    out["accumulated_ok"] = bool(torch.allclose(leaf.grad, want))
    leaf.grad = None
    rebuilt = []
    for _ in range(3):  # steps with a rebuilt sync over the same leaf (the old one's hooks
        sync = gbd.GradSync([leaf], mesh)  # raised from the third)
        (leaf * inputs[rank][0]).sum().backward()
        sync.wait()
        rebuilt.append(bool(torch.allclose(leaf.grad, sum(x[0] for x in inputs) / world)))
        leaf.grad = None
    out["rebuilt_ok"] = all(rebuilt)
    # leaves of two dtypes (free parameters keep their own): each reduced in its own, where
    # one float64 bucket for both failed to assign rank 1's float32 gradient
    single, double = torch.ones(3, requires_grad=True), torch.ones(2, dtype=torch.float64)
    double.requires_grad_()
    sync = gbd.GradSync([single, double], mesh, overlap=False)
    ((double * 3).sum() + ((single * 2).sum() if rank == 0 else 0)).backward()
    sync.wait()
    out["mixed_dtypes"] = (single.grad.dtype, single.grad.tolist(), double.grad.dtype)
    # leaves that differ between the ranks (a RankOwned shard's g-nets passed to GradSync):
    # every rank raises, naming the leaf, where the buckets' all-reduce added unrelated
    # gradients or aborted in gloo
    mismatched = [torch.ones(3, requires_grad=True), torch.ones(2 + rank, requires_grad=True)]
    try:
        gbd.GradSync(mismatched, mesh)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    frozen = torch.ones(3)
    try:
        gbd.GradSync([frozen], mesh)
        out["frozen"] = None
    except ValueError as e:
        out["frozen"] = str(e)
    return out


def _one_gnet_two_ranks(mesh) -> dict:
    """A plan of one g-net on two ranks, rank-owned: rank 1 owns none of it. It shards, and
    joins the backward collectives (the tiles' reduce-scatter, the condition's all-reduce)
    exactly where rank 0 does: with the g-nets and task embeddings training, and with only
    the free bias training. (Before, `shard` raised on rank 1, and both trainings hung.)"""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    plan = gb.plan(model, tile="full", condition=3, tasks=2)
    owned = gbd.RankOwned(plan)
    world = torch.distributed.get_world_size()
    out = {"owns": [len(owned.ownership.gnets(0, r)) for r in range(world)]}
    for frozen in (False, True):
        ref = _with_w_cond(gb.init(plan, seed=0))
        local = owned.shard(_with_w_cond(gb.init(plan, seed=0)))
        for gparams in (ref, local):
            for leaf in [*gparams["stacks"][plan.stacks[0].key].values(), gparams["tasks"]]:
                leaf.requires_grad_(not frozen)
        _fit_linear(ref, lambda g: gb.apply(g, plan, task=1), model, lambda x: x, lambda: None)
        sync = gbd.GradSync(list(local["free"].values()), mesh)
        shard = lambda x: gbd.shard_batch(x, mesh)
        _fit_linear(local, lambda g: owned.apply(g, task=1), model, shard, sync.wait)
        out[f"one_gnet_diff_frozen_{frozen}"] = _max_diff(owned.gather(local), ref)
    return out


def _fit_linear(gparams, generate, model, shard, after_backward) -> None:
    opt = _sgd(gparams)
    rows = 4 * torch.distributed.get_world_size()
    for step in range(STEPS):
        x = shard(torch.randn(rows, 16, generator=torch.Generator().manual_seed(step)))
        functional_call(model, generate(gparams), (x,)).square().mean().backward()
        after_backward()
        opt.step()
        opt.zero_grad()


def _with_w_cond(gparams: dict) -> dict:
    """`gparams` with every `w_cond` drawn (it starts at zero: no gradient into the tasks)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for leaves in gparams["stacks"].values():
            leaves["w_cond"].copy_(torch.randn(leaves["w_cond"].shape, generator=gen) / 4)
    return gparams


@pytest.mark.slow
def test_data_parallel_matches_one_process_on_the_global_batch(tmp_path):
    world = 2
    results = spawn(dp_worker, world, str(tmp_path))
    _, plan = _setup()
    for r in results:
        assert r["replicated_diff"] < 2e-5, r
        assert r["owned_diff"] < 2e-5, r
        assert r["conditioned_diff"] < 2e-5, r
        assert r["resumed_digest"] == r["replicated_digest"]  # bitwise the same trajectory
    assert len({r["replicated_digest"] for r in results}) == 1  # bitwise-identical g-nets
    assert len({r["owned_digest"] for r in results}) == 1
    assert results[0]["replicated_bytes"] == replicated_traffic(plan, world).payload
    assert results[0]["owned_bytes"] == rank_owned_traffic(plan, world).payload
    assert sum(r["owned_gnets"] for r in results) == sum(s.num_gnets for s in plan.stacks)
    for r in results:
        assert r["owns"] == [1, 0]
        assert r["one_gnet_diff_frozen_False"] < 2e-5, r
        assert r["one_gnet_diff_frozen_True"] < 2e-5, r
        assert r["unused_grad"] is None, r
        assert r["used_grad_ok"], r
        assert r["accumulated_ok"], r
        assert r["rebuilt_ok"], r
        assert r["mixed_dtypes"] == (torch.float32, [2 / world] * 3, torch.float64), r
        assert r["frozen"].startswith("gb.dist.GradSync: leaf 0 (shape (3,)) does not require")
    assert results[0]["mismatch"].startswith(
        "gb.dist.GradSync: the ranks passed different leaves: leaf 1 is shape (2,), "
        "torch.float32, requires_grad=True on rank 0 and shape (3,), torch.float32, "
        "requires_grad=True on rank 1 (2 and 2 leaves)."
    )
    assert "leaf 1 is shape (3,)" in results[1]["mismatch"]
    for r in results:
        assert r["timeouts"][0] == r["timeouts"][1] is not None, r
        assert r["skipped_stack_diff"] < 1e-6, r
        assert r["task_per_rank"].startswith("gb.dist.RankOwned.apply: the ranks passed differ")
