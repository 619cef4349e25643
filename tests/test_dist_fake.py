"""Plans at simulated world sizes: one process posing as rank 5 of 8 on a fake process group.

Collectives of the fake backend do nothing, so these tests check what each rank would
generate, hold and send, not the numbers that come back.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.func import functional_call
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.data import TensorDataset

import gbfunc as gb
import gbfunc.dist as gbd
from benchmarks.bench_comm import rank_owned_traffic, replicated_traffic
from examples.gpt import GPT, GPTConfig, loss_fn, tp_plan
from gbfunc.dist._tp import local_region

CFG = GPTConfig(vocab=64, dim=64, layers=2, heads=8, seq=16)
RANK, WORLD = 5, 8


@pytest.fixture
def mesh():
    """The ("pp", "dp", "tp") = (1, 2, 4) mesh as rank 5 sees it: dp rank 1, tp rank 1."""
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    yield gbd.init_mesh(tp=4, device_type="cpu")
    dist.destroy_process_group()


def _gpt_plan(**kwargs) -> tuple[GPT, gb.Plan]:
    with torch.device("meta"):
        model = GPT(CFG)
    return model, gb.plan(model, **kwargs)


def test_mesh_coordinates_and_a_world_that_does_not_fit(mesh):
    assert mesh.mesh_dim_names == ("pp", "dp", "tp")
    assert (mesh["dp"].size(), mesh["tp"].size()) == (2, 4)
    assert (mesh.get_local_rank("dp"), mesh.get_local_rank("tp")) == (1, 1)
    with pytest.raises(
        ValueError, match="dp x tp x pp = 3 x 2 x 1 = 6 does not equal the world size 8"
    ):
        gbd.init_mesh(dp=3, tp=2, device_type="cpu")


def test_batches_are_sharded_across_dp_ranks_only(mesh):
    x = torch.arange(16).reshape(8, 2)
    torch.testing.assert_close(gbd.shard_batch(x, mesh), x[4:])
    loader = gbd.data_loader(TensorDataset(torch.arange(40)), 8, mesh, shuffle=False)
    assert loader.batch_size == 4
    assert next(iter(loader))[0].tolist() == [1, 3, 5, 7]
    with pytest.raises(
        ValueError, match="global_batch_size 7 is not divisible by the 2 data-parallel ranks"
    ):
        gbd.data_loader(TensorDataset(torch.arange(40)), 7, mesh)
    with pytest.raises(ValueError, match="dim-0 sizes"):
        gbd.shard_batch((x, x[:3]), mesh)
    for batch in (torch.tensor(3.0), [[1, 2], [3, 4]]):  # IndexError, AttributeError
        with pytest.raises(TypeError, match=r"shard_batch: batch must be a tensor or a sequence"):
            gbd.shard_batch(batch, mesh)


@pytest.mark.parametrize(("tile", "aligned"), [((16, 16), True), ((12, 24), False)])
def test_tensor_parallel_rank_generates_exactly_its_shards(mesh, tile, aligned):
    model, plan = _gpt_plan(tile=tile)
    parallelize_module(model, mesh["tp"], tp_plan(model))
    shards = gbd.TensorParallel(plan, model, mesh["tp"])
    assert (shards.misaligned == ()) is aligned
    gparams = gb.init(plan, seed=0)
    full = gb.apply(gparams, plan)
    out = shards.apply(gparams)
    sharded = 0
    for p in plan.params:
        value = out[p.name]
        if isinstance(value, DTensor):
            assert value.shape == torch.Size(p.shape)
            region = local_region(p.shape, tuple(value.placements), mesh["tp"], p.name)
            sharded += region != tuple((0, n) for n in p.shape)
            value = value.to_local()
        else:
            region = tuple((0, n) for n in p.shape)
        torch.testing.assert_close(value, full[p.name][tuple(slice(a, b) for a, b in region)])
    assert (
        sharded == 2 * 6 * 2 - 2 * 2
    )  # weights and biases of 6 linears per block; row-parallel biases replicated
    if aligned:  # every sharded weight costs this rank a quarter of its tiles
        total = sum(s.num_tiles for s in plan.stacks)
        assert shards.selection.num_tiles == total // 4


def test_a_weight_too_small_for_every_tp_rank_is_refused_alike_on_every_rank(mesh):
    """5 or 6 rows over 4 ranks: DTensor's chunks of 2 leave the last rank none. Only that
    rank raised (a region it could not fit), and the others went on into collectives."""
    from torch.distributed.tensor import Shard

    for shape in ((5, 8), (6, 8), (4, 8), (7, 8)):
        message = None
        try:
            local_region(shape, (Shard(0),), mesh["tp"], "w")  # this process is tp rank 1
        except ValueError as error:
            message = str(error)
        if shape[0] in (5, 6):
            assert message.startswith(f"gb.dist.TensorParallel: w has {shape[0]} along dim 0")
            assert "the last rank would hold none of it" in message
        else:
            assert message is None, message  # 4 and 7 rows: the last rank holds 1 row either way


def test_replicated_parameters_pass_an_averaged_gradient(mesh):
    model, plan = _gpt_plan(tile=(16, 16))
    parallelize_module(model, mesh["tp"], tp_plan(model))
    gparams = gb.init(plan, seed=0)
    gbd.TensorParallel(plan, model, mesh["tp"]).apply(gparams)["ln_f.weight"].sum().backward()
    # Every tp rank holds ln_f whole, and the tp-sum of gradients must count it once.
    torch.testing.assert_close(gparams["free"]["ln_f.weight"].grad, torch.full((CFG.dim,), 0.25))


def test_a_mesh_without_gbfuncs_dimension_names_is_refused(mesh):
    """An unnamed mesh's data-parallel ranks were taken for one (each rank the whole batch,
    gradients summed, not averaged); a name gbfunc does not read, likewise."""
    from torch.distributed.device_mesh import init_device_mesh

    leaf = torch.ones(3, requires_grad=True)
    for names, found in ((None, "unnamed dimensions"), (("data",), r"\('data',\)")):
        other = init_device_mesh("cpu", (WORLD,), mesh_dim_names=names)
        for call, run in (
            ("GradSync", lambda m: gbd.GradSync([leaf], m)),
            ("shard_batch", lambda m: gbd.shard_batch(torch.arange(8), m)),
            ("data_loader", lambda m: gbd.data_loader(TensorDataset(torch.arange(8)), 8, m)),
        ):
            with pytest.raises(ValueError, match=rf"^gb\.dist\.{call}: the mesh has .*{found}"):
                run(other)
    dp = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    assert gbd.GradSync([leaf], dp).divisor == WORLD
    assert gbd.shard_batch(torch.arange(16), dp).tolist() == [10, 11]  # rank 5 of 8


def test_tensor_parallel_rejects_a_plan_of_another_model(mesh):
    model, _ = _gpt_plan(tile=(16, 16))
    other = gb.plan(torch.nn.Linear(4, 4))
    named = r"TensorParallel: parameter #0 is 'weight' \(4, 4\) in the plan but 'wte.weight'"
    with pytest.raises(ValueError, match=named):
        gbd.TensorParallel(other, model, mesh["tp"])


@pytest.mark.parametrize(
    ("fused", "error", "match"),
    [
        # a misspelt pattern left a fused parameter sharded as one matrix: wrong weights
        ({"*.attn.qq.weight": 3}, ValueError, r"fused pattern '\*\.attn\.qq\.weight' matches no"),
        ({"*.attn.q.weight": 0}, ValueError, r"fused\['\*\.attn\.q\.weight'\] must be an"),
        ({"*.attn.q.weight": "3"}, TypeError, r"fused\[.*\] must be an integer >= 1"),
        ([("*.attn.q.weight", 3)], TypeError, r"fused must be a dict"),
    ],
)
def test_tensor_parallel_refuses_fused_patterns_it_cannot_apply(mesh, fused, error, match):
    model, plan = _gpt_plan(tile=(16, 16))
    with pytest.raises(error, match=rf"^gb\.dist\.TensorParallel: {match}"):
        gbd.TensorParallel(plan, model, mesh["tp"], fused=fused)


def test_grad_sync_and_rank_owned_name_what_they_were_given(mesh):
    """A gparams dict for `leaves` (it iterates over its keys), a bucket size of 0 and a plan
    or gparams of another kind raised AttributeError deep inside, or were accepted."""
    model, plan = _gpt_plan(tile=(16, 16))
    gparams = gb.init(plan, seed=0)
    wanted = r"^gb\.dist\.GradSync: leaves must be an iterable of tensors .* got"
    with pytest.raises(TypeError, match=wanted + " dict"):
        gbd.GradSync(gparams, mesh)
    with pytest.raises(TypeError, match=wanted + " an iterable holding 'int'"):
        gbd.GradSync([1, 2], mesh)
    with pytest.raises(ValueError, match=r"bucket_bytes must be an integer >= 1, got 0"):
        gbd.GradSync(gb.trainable_leaves(gparams), mesh, bucket_bytes=0)
    with pytest.raises(TypeError, match=r"overlap must be a bool, got 'no'"):
        gbd.GradSync(gb.trainable_leaves(gparams), mesh, overlap="no")
    for made in (lambda: gbd.RankOwned(model), lambda: gbd.assign(model, 2)):
        with pytest.raises(TypeError, match=r"plan must be a gb\.Plan \(from gb\.plan\), got GPT"):
            made()
    with pytest.raises(TypeError, match=r"plan_difference: theirs must be a gb\.Plan"):
        gbd.plan_difference(plan, model)
    other = gb.init(_gpt_plan(tile=(32, 32))[1])
    with pytest.raises(ValueError, match=r"^gb\.dist\.RankOwned\.shard: gparams\['stacks'\]"):
        gbd.RankOwned(plan).shard(other)


def test_grad_sync_buckets_divides_by_dp_and_counts_bytes(mesh):
    model, plan = _gpt_plan(tile=(16, 16))
    gparams = gb.init(plan, seed=0)
    leaves = gb.trainable_leaves(gparams)
    sync = gbd.GradSync(leaves, mesh, bucket_bytes=4096)
    x = torch.randint(0, CFG.vocab, (2, CFG.seq))
    params = gb.apply(gparams, plan)
    params["wpe.weight"] = params["wpe.weight"].detach()  # one leaf left without a gradient
    loss_fn(functional_call(model, params, (x,)), x).backward()
    assert sync._works  # some buckets were all-reduced while backward was still running
    local = [None if t.grad is None else t.grad.clone() for t in leaves]
    sync.wait()  # the fake all-reduce leaves each bucket as it was: local / dp
    for t, g in zip(leaves, local, strict=True):  # no rank's gradient: None, as in one process
        torch.testing.assert_close(t.grad, None if g is None else g / 2)
    assert sync.comm_bytes == replicated_traffic(plan, WORLD).payload
    assert len(sync._buckets) > 3
    loss_fn(functional_call(model, gb.apply(gparams, plan), (x,)), x).backward()
    with pytest.raises(RuntimeError, match=r"accumulated twice before sync\.wait\(\) .*overlap"):
        loss_fn(functional_call(model, gb.apply(gparams, plan), (x,)), x).backward()


def test_rank_owned_generates_its_share_and_sends_what_the_model_says(mesh):
    model, plan = _gpt_plan(tile=(16, 16))
    owned = gbd.RankOwned(plan)
    local = owned.shard(gb.init(plan, seed=0))
    for s, stack in enumerate(plan.stacks):
        assert len(local["stacks"][stack.key]["w_in"]) == len(owned.ownership.gnets(s, RANK)) > 0
    assert owned.ownership.imbalance < 1.05
    x = torch.randint(0, CFG.vocab, (2, CFG.seq))
    loss_fn(functional_call(model, owned.apply(local), (x,)), x).backward()
    traffic = dict(rank_owned_traffic(plan, WORLD).collectives)
    assert owned.comm_bytes == traffic["all_gather"] + traffic["reduce_scatter"]
    assert all(t.grad is not None for t in gb.trainable_leaves(local))
    first = plan.stacks[0]
    with pytest.raises(  # the whole gparams, not this rank's shard: a negative dimension before
        ValueError,
        match=rf"^gb\.dist\.RankOwned\.apply: local\['stacks'\]\['{first.key}'\]\['w_in'\] "
        rf"holds {first.num_gnets} g-nets; rank 5 owns {len(owned.ownership.gnets(0, RANK))} ",
    ):
        owned.apply(gb.init(plan, seed=0))
