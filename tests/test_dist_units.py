"""Single-process logic of gbfunc.dist: mesh sizes, tile selection, ownership, traffic."""

import math
from dataclasses import dataclass

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given
from torch import nn
from torch.utils._pytree import tree_leaves
from torchrun import torchrun

import gbfunc as gb
import gbfunc.dist as gbd
from benchmarks.bench_comm import rank_owned_traffic, replicated_traffic, torchgb_traffic
from examples.gpt import GPT, GPTConfig
from gbfunc._tiling import cuts_tiles, full_region, piece_tiles, pieces
from gbfunc.generate import torch_ops

# ---------------------------------------------------------------- mesh sizes


def test_mesh_shape_fills_in_dp():
    assert gbd.mesh_shape(8, tp=2) == gbd.MeshShape(dp=4, tp=2, pp=1)
    assert gbd.mesh_shape(8, tp=2, pp=2).world_size == 8


def test_mesh_shape_rejects_a_world_not_divisible_by_tp_and_pp():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by tp x pp = 2 x 2 = 4"):
        gbd.mesh_shape(6, tp=2, pp=2)


def test_mesh_shape_rejects_sizes_whose_product_is_not_the_world():
    with pytest.raises(
        ValueError, match=r"dp x tp x pp = 3 x 2 x 1 = 6 does not equal the world size 8"
    ):
        gbd.mesh_shape(8, dp=3, tp=2)


@pytest.mark.parametrize(
    ("bad", "error"), [(0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)]
)
def test_mesh_shape_rejects_bad_sizes(bad, error):
    with pytest.raises(error, match="tp must be an integer >= 1"):
        gbd.mesh_shape(8, tp=bad)


# ---------------------------------------------------------------- tile selection


@dataclass(frozen=True)
class Case:
    rows: int
    cols: int
    tile: tuple[int, int]
    share: bool
    region: tuple[tuple[int, int], tuple[int, int]]


@st.composite
def cases(draw) -> Case:
    rows, cols = draw(st.integers(3, 40)), draw(st.integers(3, 40))
    tile = (draw(st.integers(1, 16)), draw(st.integers(1, 16)))
    r0 = draw(st.integers(0, rows - 1))
    c0 = draw(st.integers(0, cols - 1))
    region = ((r0, draw(st.integers(r0 + 1, rows))), (c0, draw(st.integers(c0 + 1, cols))))
    return Case(rows, cols, tile, draw(st.booleans()), region)


def _model(case: Case) -> nn.Module:
    # A plain weight, a Q/K/V weight split in 3 blocks along rows, and a bias.
    dim = 3 * max(1, case.rows // 3)
    return nn.Sequential(nn.Linear(case.cols, case.rows), nn.MultiheadAttention(dim, 1))


@given(cases())
def test_a_selected_region_is_the_same_slice_of_gb_apply(case):
    model = _model(case)
    plan = gb.plan(model, tile=case.tile, share=case.share)
    gparams = gb.init(plan, seed=0)
    full = gb.apply(gparams, plan)
    qkv = plan.params[2].shape
    regions = {
        "0.weight": case.region,
        "0.bias": (case.region[0],),
        "1.in_proj_weight": (
            (case.region[0][0] % qkv[0], qkv[0]),
            (0, min(case.region[1][1], qkv[1])),
        ),
    }
    out = gbd.Selection(plan, regions).apply(gparams)
    for name, region in regions.items():
        expected = full[name][tuple(slice(a, b) for a, b in region)]
        torch.testing.assert_close(out[name], expected, rtol=1e-6, atol=1e-6)


def test_whole_regions_reproduce_gb_apply_bitwise():
    with torch.device("meta"):
        model = GPT(GPTConfig())
    for share in (False, True):
        plan = gb.plan(model, tile=(16, 8), share=share, embeddings=True)
        gparams = gb.init(plan, seed=1)
        full = gb.apply(gparams, plan, compile=False)  # Selection's eager evaluation, bitwise
        out = gbd.Selection(plan, {p.name: full_region(p.shape) for p in plan.params}).apply(
            gparams
        )
        assert all(torch.equal(out[k], full[k]) for k in full)


def test_a_whole_plan_splits_each_stack_into_its_blocks_and_a_shard_slices(monkeypatch):
    """Eagerly, a stack's tiles are split into the blocks its parameters read (the backward is
    one concatenation); a tensor-parallel shard reads a few tiles and slices them. Both give the
    gradients of the sliced evaluation."""
    from gbfunc._tiling import block_spans
    from gbfunc.generate import torch_ops

    model = nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 24), nn.Linear(24, 5))
    plan = gb.plan(model, tile=(8, 8), hidden=4)
    blocks = {s: [] for s in range(len(plan.stacks))}
    for p in plan.generated:
        (block,) = p.blocks
        blocks[p.stack_index].append((block.first_tile, block.first_tile + block.num_tiles))
    for s, stack in enumerate(plan.stacks):
        params = [p for p in plan.generated if p.stack_index == s]
        assert block_spans(params, stack.num_tiles) == sorted(blocks[s])
        assert block_spans(params, stack.num_tiles + 1) is None  # a tile no block reads
    rows = gbd.Selection(plan, {"0.weight": ((0, 8), (0, 40)), "2.weight": ((8, 16), (0, 24))})
    assert rows._splits == {0: [(0, 5), (5, 8)]}  # the evaluated tiles: 0-4, then 18-20
    # Tiles 0 and 5, then 1 and 6: evaluated as 0, 1, 5, 6, each region's rows gathered.
    columns = gbd.Concat((((0, 16), (0, 8)), ((0, 16), (8, 16))), 1)
    gathered = gbd.Selection(plan, {"0.weight": columns})
    overlap = gbd.Concat((((0, 8), (0, 16)), ((0, 8), (8, 40))), 1)  # tiles 0-1 and 1-4
    assert gathered._splits == {0: None}
    assert gbd.Selection(plan, {"0.weight": overlap})._splits == {0: None}  # sliced

    def grads(split: bool) -> list[torch.Tensor]:
        if not split:
            monkeypatch.setattr(torch_ops, "block_spans", lambda params, n: None)
        gparams = gb.init(plan, seed=2)
        params = gb.apply(gparams, plan, compile=False)
        sum(v.square().sum() for v in params.values()).backward()
        monkeypatch.undo()
        return [leaf.grad for leaf in gb.trainable_leaves(gparams)]

    for a, b in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_selection_hands_out_views_of_free_parameters_and_gb_apply_the_leaves():
    # A tensor-parallel rank hooks its copies' gradients; a hook on the leaf itself would
    # pile up, one more every step.
    plan = gb.plan(nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8)), tile=(4, 4))
    gparams = gb.init(plan)
    leaf = gparams["free"]["1.weight"]
    assert gb.apply(gparams, plan)["1.weight"] is leaf
    selection = gbd.Selection(plan, {"1.weight": ((0, 8),)})
    assert selection.regions == {"1.weight": ((0, 8),)}
    view = selection.apply(gparams)["1.weight"]
    assert view is not leaf
    assert view._base is leaf


@pytest.mark.parametrize(
    "options", [{}, {"share": True}, {"hashed": 5}, {"share": True, "hashed": 5}]
)
def test_the_torch_path_picks_rows_of_the_whole_stack(options):
    plan = gb.plan(nn.Linear(40, 24), tile=(8, 8), **options)
    stack = plan.stacks[0]
    leaves = gb.init(plan, seed=0)["stacks"][stack.key]
    if "tile_hash" in leaves:  # the g-nets start at zero output beside a table: wake them
        leaves["w_out"] = torch.randn(leaves["w_out"].shape)
    picked = [1, 4, 5, 14]
    (everything,) = torch_ops.tiles(stack, leaves, range(stack.num_tiles), None)
    (some,) = torch_ops.tiles(stack, leaves, picked, None)
    torch.testing.assert_close(some, everything[picked])


def region_tiles(p, stack, region) -> list[int]:
    """Ascending indices of the stack's tiles that cover `region` of `p`."""
    return sorted({t for piece in pieces(p, stack, region) for t in piece_tiles(p, piece)})


def test_region_tiles_and_alignment():
    plan = gb.plan(nn.Linear(32, 64), tile=(16, 8))
    p, stack = plan.generated[0], plan.stacks[0]  # grid 4 x 4
    assert region_tiles(p, stack, ((16, 32), (0, 32))) == list(range(4, 8))
    assert not cuts_tiles(p, stack, ((16, 32), (0, 32)))
    assert region_tiles(p, stack, ((10, 20), (4, 12))) == [0, 1, 4, 5]
    assert cuts_tiles(p, stack, ((10, 20), (4, 12)))
    # A region ending at the weight's edge inside a partial last tile does not cut a tile.
    ragged = gb.plan(nn.Linear(30, 20), tile=(16, 16))
    assert not cuts_tiles(ragged.generated[0], ragged.stacks[0], ((16, 20), (0, 30)))


def test_selection_rejects_unknown_names_and_bad_regions():
    plan = gb.plan(nn.Linear(8, 8), tile=(4, 4))
    with pytest.raises(ValueError, match="'nope' is not a parameter of the plan"):
        gbd.Selection(plan, {"nope": ((0, 1),)})
    with pytest.raises(
        ValueError, match=r"region \(\(0, 9\), \(0, 8\)\) does not fit weight of shape \(8, 8\)"
    ):
        gbd.Selection(plan, {"weight": ((0, 9), (0, 8))})
    # A conditioned plan's errors name the call (they named "the selection's apply").
    conditioned = gb.plan(nn.Linear(8, 8), tile=(4, 4), condition=3, tasks=2)
    gparams = gb.init(conditioned)
    with pytest.raises(ValueError, match=r"^gb\.dist\.Selection\.apply: task must be an int"):
        gbd.Selection(conditioned, {"weight": ((0, 8), (0, 8))}).apply(gparams, task=5)
    stage = gbd.StageGenerator(conditioned, nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"^gb\.dist\.StageGenerator\.load: the plan's g-nets"):
        stage.load(gparams)


# ---------------------------------------------------------------- ownership


def _gpt_plan(share: bool = False) -> gb.Plan:
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=64, dim=48, layers=3, heads=4, seq=16))
    return gb.plan(model, tile=(16, 16), share=share, overrides={"blocks.2.*": {"tile": (8, 24)}})


@pytest.mark.parametrize("world", [1, 3, 8])
@pytest.mark.parametrize("share", [False, True])
def test_ownership_covers_every_gnet_once_and_balances(world, share):
    plan = _gpt_plan(share)
    own = gbd.assign(plan, world)
    for s, stack in enumerate(plan.stacks):
        tiles = [t for r in range(world) for t in own.tiles(plan, s, r)]
        assert sorted(tiles) == list(range(stack.num_tiles))
    costs = [n * s.tile_flops for s in plan.stacks for n in s.tiles_per_gnet]
    # LPT: the busiest rank exceeds the mean by at most one g-net.
    assert max(own.loads) <= sum(costs) / world + max(costs) + 1e-6
    assert own == gbd.assign(plan, world)  # deterministic on every rank


def test_ownership_is_balanced_on_gpt2_small_at_8_ranks():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=50304, dim=768, layers=12, heads=12, seq=1024))
    own = gbd.assign(gb.plan(model, tile=(100, 100)), 8)
    assert own.imbalance < 1.01


def test_ownership_rejects_a_bad_world_size():
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        gbd.assign(_gpt_plan(), 0)


# ---------------------------------------------------------------- traffic


def test_traffic_of_a_small_plan_by_hand():
    plan = gb.plan(nn.Linear(32, 32), tile=(16, 16))  # 4 tiles of 256 weights; bias of 32 free
    gnet = plan.stacks[0].num_params
    assert replicated_traffic(plan, 2).payload == 4 * (gnet + 32)
    owned = dict(rank_owned_traffic(plan, 2).collectives)
    assert owned == {"all_gather": 4 * 4 * 256, "reduce_scatter": 4 * 4 * 256, "all_reduce": 4 * 32}
    torchgb = torchgb_traffic(plan, 2)
    assert dict(torchgb.collectives) == {"broadcast": 4 * 1024, "all_reduce": 4 * (1024 + 32)}
    assert torchgb.per_rank == pytest.approx(0.5 * 4 * 1024 + 2 * 0.5 * 4 * 1056)


def test_torchgb_broadcast_of_gpt2_small_is_324_mib():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=50304, dim=768, layers=12, heads=12, seq=1024))
    broadcast = dict(torchgb_traffic(gb.plan(model, tile=(100, 100)), 8).collectives)["broadcast"]
    assert broadcast == 4 * 12 * 12 * 768 * 768
    assert math.isclose(broadcast / 2**20, 324, rel_tol=0.01)


def test_cost_model_at_one_shard_is_the_measured_estimators():
    """With no TP or PP the cost model's bytes are those of the estimators the spawned and
    fake-group tests check against gloo; rank-owned agrees up to the estimators' padding."""
    from benchmarks.bench_comm import Mesh, Sizes, per_rank_bytes

    plan = gb.plan(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32)), tile=(16, 16))
    sizes = Sizes.of(plan)
    for world in (2, 4):
        mesh = Mesh(world)
        assert per_rank_bytes("replicated g-nets", sizes, mesh) == pytest.approx(
            replicated_traffic(plan, world).per_rank
        )
        assert per_rank_bytes("torchGB", sizes, mesh) == pytest.approx(
            torchgb_traffic(plan, world).per_rank
        )
        assert per_rank_bytes("rank-owned g-nets", sizes, mesh) == pytest.approx(
            rank_owned_traffic(plan, world).per_rank, rel=0.05
        )


def test_cost_model_splits_shards_over_tp_and_pp_and_sums_gnets_over_the_world():
    from benchmarks.bench_comm import Mesh, Sizes, generation_share, per_rank_bytes

    sizes = Sizes(params=1000, generated=900, gnet=50, free=100, generation_flops=9000.0)
    mesh = Mesh(dp=4, tp=2, pp=5)  # 40 ranks; each replica split over 10
    assert per_rank_bytes("dense DDP", sizes, mesh) == pytest.approx(4 * 2 * 3 / 4 * 100)
    assert per_rank_bytes("dense FSDP", sizes, mesh) == pytest.approx(4 * 3 * 3 / 4 * 100)
    assert per_rank_bytes("replicated g-nets", sizes, mesh) == pytest.approx(
        4 * (2 * 39 / 40 * 50 + 2 * 3 / 4 * 10)
    )
    assert per_rank_bytes("rank-owned g-nets", sizes, mesh) == pytest.approx(
        4 * (2 * 3 / 4 * 90 + 2 * 3 / 4 * 10)
    )
    assert per_rank_bytes("torchGB", sizes, mesh) == pytest.approx(4 * (3 / 4 * 90 + 1.5 * 100))
    with pytest.raises(ValueError, match="strategy must be one of"):
        per_rank_bytes("ZeRO-4", sizes, mesh)
    share = generation_share("replicated g-nets", sizes, mesh, tokens_per_rank=10)
    assert share == pytest.approx(3 * 9000 / 10 / (6 * 100 * 10))
    owned = generation_share("rank-owned g-nets", sizes, mesh, tokens_per_rank=10)
    assert owned == pytest.approx(share / 4)
    assert generation_share("dense DDP", sizes, mesh, tokens_per_rank=10) == 0.0


# ---------------------------------------------------------------- plan check


def test_plan_difference_names_the_first_differing_parameter():
    with torch.device("meta"):
        model = GPT(GPTConfig())
    base = gb.plan(model, tile=(16, 16))
    assert gbd.plan_difference(base, gb.plan(model, tile=(16, 16))) is None
    other = gb.plan(model, tile=(16, 16), overrides={"blocks.1.attn.v.weight": {"tile": (8, 8)}})
    assert gbd.plan_difference(base, other).startswith(
        "parameter 'blocks.1.attn.v.weight', field 'stack_index'"
    )
    fewer = gb.plan(model, tile=(16, 16), free=["blocks.1.*"])
    assert (
        gbd.plan_difference(base, fewer)
        == "parameter 'blocks.1.attn.q.weight', field 'kind': Generated vs Free"
    )
    assert "stack 's0_16x16'" in gbd.plan_difference(base, gb.plan(model, tile=(16, 16), hidden=8))
    # Plans that differ only in their task embeddings were "equal" (None): check_plan then
    # said "differs from rank 0's at None".
    tasks = [gb.plan(model, tile=(16, 16), condition=3, tasks=n) for n in (2, 3)]
    assert gbd.plan_difference(*tasks) == "the plan, field 'tasks': 2 vs 3"


# ---------------------------------------------------------------- pipeline stage, one process


def test_stage_generator_fills_the_stage_and_backpropagates_its_grads():
    cfg = GPTConfig(vocab=32, dim=32, layers=2, heads=2, seq=8)
    with torch.device("meta"):
        plan = gb.plan(GPT(cfg), tile=(16, 16))
    stage = GPT(cfg, stage=(1, 2))  # block 1, ln_f and the tied head
    generator = gbd.StageGenerator(plan, stage)
    gparams = gb.init(plan, seed=0)
    generator.load(gparams)
    full = gb.apply(gparams, plan)
    for name, param in stage.named_parameters():
        assert torch.equal(param.detach(), full[name])
    hidden = torch.randn(2, 8, cfg.dim)
    stage(hidden).square().mean().backward()
    generator.backward(gparams)
    via_stage = [t.grad.clone() for t in gb.trainable_leaves(gparams) if t.grad is not None]
    for t in gb.trainable_leaves(gparams):
        t.grad = None
    # The same gradient, straight through gb.apply.
    names = dict(stage.named_parameters())
    torch.func.functional_call(
        stage, {n: full[n] for n in names}, (hidden,)
    ).square().mean().backward()
    direct = [t.grad for t in gb.trainable_leaves(gparams) if t.grad is not None]
    assert len(via_stage) == len(direct)
    for a, b in zip(via_stage, direct, strict=True):
        torch.testing.assert_close(a, b)


def test_stage_generator_takes_the_task_of_a_conditioned_plan():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    plan = gb.plan(model, tile=(8, 8), condition=3, tasks=2)
    gparams = gb.init(plan, seed=0)
    with torch.no_grad():  # w_cond starts at zero, where tasks do not matter
        for leaves in gparams["stacks"].values():
            leaves["w_cond"].normal_()
    generator = gbd.StageGenerator(plan, model)
    generator.load(gparams, task=1)
    full = gb.apply(gparams, plan, task=1)
    assert not torch.equal(full["0.weight"], gb.apply(gparams, plan, task=0)["0.weight"])
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), full[name])
    x = torch.randn(5, 16)
    model(x).square().mean().backward()
    generator.backward(gparams)  # for load's task
    via_stage = gparams["tasks"].grad.clone()
    gparams["tasks"].grad = None
    torch.func.functional_call(model, full, (x,)).square().mean().backward()
    assert via_stage[1].abs().max() > 0
    torch.testing.assert_close(via_stage, gparams["tasks"].grad)


def test_stage_generator_rejects_misnamed_or_meta_parameters():
    with torch.device("meta"):
        plan = gb.plan(GPT(GPTConfig()), tile=(16, 16))
    with pytest.raises(ValueError, match=r"stage parameter '0\.weight' is not in the plan"):
        gbd.StageGenerator(plan, nn.Sequential(nn.Linear(4, 4)))
    with torch.device("meta"):
        stage = GPT(GPTConfig(), stage=(0, 2))
    with pytest.raises(ValueError, match="expected a real tensor"):
        gbd.StageGenerator(plan, stage)


def test_a_concat_selection_joins_its_regions_of_generated_and_free_parameters():
    from gbfunc._tiling import Concat

    plan = gb.plan(nn.Linear(24, 48), tile=(8, 8))  # the bias stays free
    gparams = gb.init(plan, seed=3)
    full = gb.apply(gparams, plan)
    weight = Concat((((0, 8), (0, 24)), ((40, 52), (0, 24))), dim=0)
    with pytest.raises(ValueError, match="does not fit"):  # each region is checked
        gbd.Selection(plan, {"weight": weight})
    weight = Concat((((0, 8), (0, 24)), ((24, 32), (0, 24)), ((40, 44), (0, 24))), dim=0)
    bias = Concat((((0, 8),), ((24, 32),), ((40, 44),)), dim=0)
    out = gbd.Selection(plan, {"weight": weight, "bias": bias}).apply(gparams)
    rows = [*range(0, 8), *range(24, 32), *range(40, 44)]
    torch.testing.assert_close(out["weight"], full["weight"][rows], rtol=0, atol=0)
    torch.testing.assert_close(out["bias"], full["bias"][rows], rtol=0, atol=0)


def test_a_region_in_the_third_of_three_blocks_matches_gb_apply():
    plan = gb.plan(nn.MultiheadAttention(12, 3), tile=(4, 4))  # Q, K, V: blocks along rows
    gparams = gb.init(plan, seed=2)
    full = gb.apply(gparams, plan)["in_proj_weight"]
    for region in (((26, 35), (0, 12)), ((14, 30), (3, 9))):
        out = gbd.Selection(plan, {"in_proj_weight": region}).apply(gparams)["in_proj_weight"]
        (r0, r1), (c0, c1) = region
        torch.testing.assert_close(out, full[r0:r1, c0:c1], rtol=0, atol=0)


def test_a_region_across_column_blocks_matches_gb_apply():
    transformers = pytest.importorskip("transformers")
    attn = nn.ModuleDict({"c_attn": transformers.pytorch_utils.Conv1D(3 * 8, 8)})
    plan = gb.plan(attn, tile=(4, 4))  # Q, K, V side by side: blocks along columns
    gparams = gb.init(plan, seed=2)
    full = gb.apply(gparams, plan)["c_attn.weight"]  # (in 8, out 24)
    out = gbd.Selection(plan, {"c_attn.weight": ((0, 8), (10, 21))}).apply(gparams)
    torch.testing.assert_close(out["c_attn.weight"], full[:, 10:21], rtol=0, atol=0)


def test_a_region_that_starts_inside_a_tile_cuts_it():
    plan = gb.plan(nn.Linear(32, 32), tile=(8, 8))
    p, stack = plan.generated[0], plan.stacks[0]
    assert cuts_tiles(p, stack, ((4, 16), (0, 32)))  # the end is aligned, the start is not
    assert cuts_tiles(p, stack, ((0, 32), (0, 12)))
    assert not cuts_tiles(p, stack, ((8, 24), (16, 32)))


@pytest.mark.parametrize(
    ("region", "match"),
    [
        (((3, 3), (0, 8)), "does not fit"),  # empty
        (((-1, 4), (0, 8)), "does not fit"),
        (((0, 4), (0, 9)), "does not fit"),
        (((0, 4),), "does not fit"),  # too few dims
    ],
)
def test_bad_regions_are_named(region, match):
    plan = gb.plan(nn.Linear(8, 8), tile=(4, 4))
    with pytest.raises(ValueError, match=match):
        gbd.Selection(plan, {"weight": region})


def test_regions_given_as_lists_or_numbers_of_any_kind_select_the_same():
    """A region of lists never equalled the tuples compared with it: a whole convolution
    kernel was refused as split, a whole row as cutting a centred weight's columns; a float
    bound passed the checks and raised in apply."""
    conv = gb.plan(nn.Conv2d(4, 8, 3), tile=(4, 2))
    gparams = gb.init(conv, seed=0)
    whole = [[0, 8], [0, 4], [0, 3], [0, 3]]
    torch.testing.assert_close(
        gbd.Selection(conv, {"weight": whole}).apply(gparams)["weight"],
        gb.apply(gparams, conv)["weight"],
    )
    linear = gb.plan(nn.Linear(32, 16), tile=(8, 8), center=True)
    rows = {"weight": [[np.int64(0), 8], [0, torch.tensor(32)]]}
    assert gbd.Selection(linear, rows).regions == {"weight": ((0, 8), (0, 32))}
    with pytest.raises(TypeError, match=r"region of weight must be one \(start, stop\) pair"):
        gbd.Selection(linear, {"weight": ((0, 8.5), (0, 32))})
    with pytest.raises(TypeError, match=r"region of weight must be one \(start, stop\) pair"):
        gbd.Selection(linear, {"weight": (0, 8)})
    with pytest.raises(TypeError, match=r"regions must be a dict"):
        gbd.Selection(linear, [("weight", ((0, 8), (0, 32)))])
    apart = gbd.Concat((((0, 8), (0, 32)), ((0, 4), (0, 32))), dim=1)  # torch.cat's error
    with pytest.raises(ValueError, match=r"cannot be joined along dim 1"):
        gbd.Selection(linear, {"weight": apart})
    with pytest.raises(ValueError, match=r"Concat dim must be in \[0, 2\), got 5"):
        gbd.Selection(linear, {"weight": gbd.Concat((((0, 8), (0, 32)),), dim=5)})


def test_a_convolution_can_only_be_split_along_its_first_two_dims():
    plan = gb.plan(nn.Conv2d(4, 8, 3), tile=(4, 2))
    with pytest.raises(
        ValueError, match=r"conv can only|weight can only be split along dims 0 and 1"
    ):
        gbd.Selection(plan, {"weight": ((0, 8), (0, 4), (0, 2), (0, 3))})


def test_free_parameters_split_by_columns_are_not_taken_for_centred_ones():
    plan = gb.plan(nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 4)), tile=(2, 2))
    assert isinstance(plan.params[0], gb.Free)  # the embedding table stays free
    gparams = gb.init(plan)
    out = gbd.Selection(plan, {"0.weight": ((0, 10), (2, 5))}).apply(gparams)["0.weight"]
    torch.testing.assert_close(out, gparams["free"]["0.weight"][:, 2:5], rtol=0, atol=0)


def test_gb_apply_lays_out_whole_blocks_from_slices_not_gathers():
    """A performance property: whole parameters read consecutive tiles, so no index_select;
    a selection that picks tiles apart gathers them."""
    from autograd_graph import node_names

    from gbfunc._select import Selection
    from gbfunc._tiling import Concat

    plan = gb.plan(nn.Sequential(nn.MultiheadAttention(12, 3), nn.Linear(12, 20)), tile=(4, 4))
    whole = gb.apply(gb.init(plan), plan, compile=False)
    names = set().union(*(node_names(w) for w in whole.values() if w.grad_fn is not None))
    assert "SplitWithSizesBackward0" in names  # the stack, split into its blocks
    assert not {n for n in names if "Index" in n or "Gather" in n}
    # Tiles 0 and 3 for the first region, tile 1 for the second: the first gathers.
    regions = Concat((((0, 8), (0, 4)), ((0, 4), (4, 8))), dim=0)
    picked = Selection(plan, {"0.in_proj_weight": regions})
    assert any(not isinstance(r, slice) for pieces in picked._rows.values() for r in pieces)
    out = picked.apply(gb.init(plan))["0.in_proj_weight"]
    assert "IndexSelectBackward0" in node_names(out)
    full = whole["0.in_proj_weight"]
    torch.testing.assert_close(out, torch.cat([full[:8, :4], full[:4, 4:8]]), rtol=0, atol=0)


def test_sharded_free_refuses_a_plan_of_another_model_before_sharding():
    plan = gb.plan(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), tile=(4, 4))
    other = nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6))
    with pytest.raises(ValueError, match=r"gb.dist.ShardedFree: parameter '0.weight' has shape"):
        gbd.ShardedFree(plan, other, mesh=None)
    assert not isinstance(other[0].weight, torch.distributed.tensor.DTensor)  # untouched
    assert other[0].weight.device.type == "cpu"  # not released to meta


def test_sharded_free_releases_a_generated_weight_under_every_name_it_has():
    """A head whose weight is the embedding's (tied by parameter, not in `forward`) stays
    tied to the released one: left real, FSDP2 sharded it as a free parameter that nothing
    trained, and `functional_call` used it instead of the generated weight."""
    from gbfunc.dist._fsdp import _release

    model = nn.ModuleDict({"emb": nn.Embedding(16, 8), "head": nn.Linear(8, 16, bias=False)})
    model["head"].weight = model["emb"].weight
    released = _release(model, "emb.weight")
    assert released.is_meta
    assert model["emb"].weight is released
    assert model["head"].weight is released


def test_init_mesh_follows_a_started_gloo_group_even_where_cuda_is_available(
    process_group, monkeypatch
):
    # gb.dist.testing.spawn starts gloo; on a GPU host the mesh must stay on the CPU.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert gbd.init_mesh().device_type == "cpu"


def test_init_mesh_names_a_machine_with_fewer_gpus_than_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1, but this machine has 1 CUDA device"):
        gbd.init_mesh()


MESH_TIMEOUTS = """
import datetime, pathlib, torch, torch.distributed as dist, gbfunc.dist as gbd
mesh = gbd.init_mesh(pp=2, timeout=datetime.timedelta(seconds=7))  # starts the group
cpu = torch.device("cpu")
# One file per rank: two ranks printing to the one pipe interleave their lines.
pathlib.Path(f"timeouts{dist.get_rank()}.txt").write_text("".join(
    f"{dim} {mesh[dim].get_group()._get_backend(cpu).options._timeout.total_seconds()}\\n"
    for dim in ("pp", "dp", "tp")
))
"""


@pytest.mark.slow
def test_init_mesh_gives_its_timeout_to_every_dimensions_groups(tmp_path):
    # torch made the groups of dimensions narrower than the world (here dp and tp, one rank
    # each beside pp's two) with its 30-minute default: a hung peer there waited that long.
    (tmp_path / "mesh_timeouts.py").write_text(MESH_TIMEOUTS)
    torchrun(tmp_path, "mesh_timeouts.py", cwd=tmp_path)
    for rank in (0, 1):
        lines = (tmp_path / f"timeouts{rank}.txt").read_text().splitlines()
        assert lines == ["pp 7.0", "dp 7.0", "tp 7.0"], (rank, lines)


@pytest.mark.parametrize("tasks", [0, 3])
def test_every_dist_generator_makes_the_gnets_weights_under_autocast(process_group, tasks):
    """`gb.apply` turned autocast off, the dist wrappers did not: their weights came in
    bfloat16 precision (3.6e-3 off), and a `Selection` of part of a stack handed the C loops
    bfloat16 tensors they read as float32 (NaN, or 1e21). A task's condition was folded in
    before autocast was off (2.5e-3 off)."""
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    options = {"condition": 8, "tasks": tasks} if tasks else {}
    plan = gb.plan(model, tile=(16, 16), **options)
    gparams = gb.init(plan, seed=0)
    task = {"task": 1} if tasks else {}
    if tasks:  # the task embeddings and their weights into the g-nets start at zero
        gparams = torch.utils._pytree.tree_map(lambda t: t + 0.1 * torch.randn_like(t), gparams)
    want = gb.apply(gparams, plan, compile=False, **task)
    owned = gbd.RankOwned(plan)
    local = owned.shard(gparams)
    part = gbd.Selection(plan, {"0.weight": ((0, 32), (0, 64))})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = {
            "owned": owned.apply(local, **task)["0.weight"],
            "part": part.apply(gparams, compile=True, **task)["0.weight"],
            "whole": gbd.Selection.whole(plan).apply(gparams, **task)["0.weight"],
        }
        if not tasks:
            stage = gbd.StageGenerator(plan, model)
            stage.load(gparams)
            got["stage"] = model[0].weight.detach()
    for how, weight in got.items():
        expected = want["0.weight"][:32] if how == "part" else want["0.weight"]
        torch.testing.assert_close(weight, expected, rtol=1e-5, atol=1e-6, msg=how)


def test_the_dist_generators_under_compiled_second_order_transforms(process_group):
    """Under `torch.compile`, forward mode and a grad inside a vmap met `Selection`'s
    `realised` (an autograd.Function dynamo cannot trace there: torch's internal errors);
    `RankOwned`, whose gathers have autograd rules, refuses such transforms by name."""
    from torch.func import grad, jvp, vmap

    model = nn.Linear(16, 8)
    plan = gb.plan(model, tile=(4, 4), hidden=4, activation="tanh")
    gparams = gb.init(plan, seed=0, requires_grad=False)
    part = gbd.Selection(plan, {"weight": ((0, 4), (0, 16))})

    def loss(g, select=part.apply):
        return select(g)["weight"].square().sum()

    def hvp(g, loss=loss):
        return jvp(grad(loss), (g,), (g,))[1]

    stacked = torch.utils._pytree.tree_map(lambda t: torch.stack([t, 1.1 * t]), gparams)
    for f, x in ((hvp, gparams), (vmap(grad(loss)), stacked)):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="eager")(x)
        pairs = zip(tree_leaves(compiled), tree_leaves(f(x)), strict=True)
        for a, b in pairs:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    owned = gbd.RankOwned(plan)
    local = owned.shard(gparams)

    def owned_loss(g):
        return owned.apply(g)["weight"].square().sum()

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"RankOwned\.apply: torch\.compile of a gradient of a"):
        torch.compile(lambda g: hvp(g, owned_loss), fullgraph=True, backend="eager")(local)


def test_the_dist_generators_check_gparams_as_gb_apply_does(process_group):
    """Neither `Selection` nor `RankOwned` checked them: the C loops, which take the tile
    count from the g-nets and the placement from the plan, returned 1e37 weights for another
    plan's gparams, or crashed; a leaf of another dtype gave float64 or mixed weights."""
    model = nn.Linear(64, 64)
    plan = gb.plan(model, tile=(16, 16))
    other = gb.init(gb.plan(nn.Linear(64, 32), tile=(16, 16)), seed=0)  # the same stack key
    with pytest.raises(ValueError, match=r"gb\.dist\.Selection\.apply: .*expected \(16, "):
        gbd.Selection.whole(plan).apply(other, compile=True)
    gparams = gb.init(plan, seed=0)
    key = plan.stacks[0].key
    owned = gbd.RankOwned(plan)
    local = owned.shard(gparams)
    local["stacks"][key]["b_in"] = local["stacks"][key]["b_in"].double()
    with pytest.raises(ValueError, match=r"gb\.dist\.RankOwned\.apply: .*float64"):
        owned.apply(local)
    gparams["stacks"][key]["b_in"] = gparams["stacks"][key]["b_in"].double()
    with pytest.raises(ValueError, match=r"gb\.dist\.RankOwned\.shard: .*float64"):
        owned.shard(gparams)


def test_selections_and_ranks_built_or_evaluated_in_odd_modes_still_train(process_group):
    """A `Selection`'s index tensors made under `inference_mode` (an evaluation first) could
    not be saved for a later training call's backward; a `RankOwned` built under
    `torch.device("meta")` kept its tile positions on meta."""
    model = nn.Linear(64, 64)
    plan = gb.plan(model, tile=(16, 16))
    gparams = gb.init(plan, seed=0)
    strips = gbd.Concat((((0, 64), (0, 16)), ((0, 64), (32, 48))), dim=1)  # rows apart
    selection = gbd.Selection(plan, {"weight": strips})
    with torch.inference_mode():
        evaluated = selection.apply(gparams)["weight"]
    trained = selection.apply(gparams)["weight"]
    trained.square().sum().backward()
    torch.testing.assert_close(trained.detach(), evaluated.clone())
    with torch.device("meta"):
        owned = gbd.RankOwned(plan)
    weights = owned.apply(owned.shard(gparams))
    torch.testing.assert_close(weights["weight"], gb.apply(gparams, plan)["weight"])
