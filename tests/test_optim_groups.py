"""`gb.optim.param_groups`: the default learning rates by genome, every trainable leaf once."""

import itertools

import pytest
import torch
from conv1d import Conv1D
from torch import nn

import gbfunc as gb
from examples.models import CharTransformer
from examples.tasks import CharLMConfig


def model() -> nn.Sequential:
    """Weights of fan-in 128: at `GNET_LR` itself (`fan_in_factor` 1)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), nn.LayerNorm(128), nn.Linear(128, 4))


def rates(groups: list[dict]) -> dict[int, float]:
    """`{id(tensor): lr}`, checking that no tensor is in two groups."""
    out: dict[int, float] = {}
    for group in groups:
        for t in group["params"]:
            assert id(t) not in out, "a tensor in two groups"
            out[id(t)] = group["lr"]
    return out


@pytest.mark.parametrize(("activation", "gnet_rate"), [("tanh", 0.3), ("relu", 0.03)])
def test_gnets_tables_and_free_parameters_get_their_rates(activation, gnet_rate):
    plan = gb.plan(model(), tile="full", hidden=4, hashed=8, activation=activation)
    gparams = gb.init(plan)
    by_id = rates(gb.optim.param_groups(gparams, plan, free_lr=1e-3, scale=2.0))
    assert set(by_id) == {id(t) for t in gb.trainable_leaves(gparams)}
    for stack in plan.stacks:
        for leaf, t in gparams["stacks"][stack.key].items():
            want = 0.03 if leaf == "tile_hash" else gnet_rate
            assert by_id[id(t)] == pytest.approx(2.0 * want), leaf
    assert all(by_id[id(t)] == 1e-3 for t in gparams["free"].values())


def test_the_groups_train_with_torch_optim():
    net = model()
    plan = gb.plan(net, tile=(8, 8), hidden=4)
    gparams = gb.init(plan)
    opt = torch.optim.AdamW(gb.optim.param_groups(gparams, plan, free_lr=1e-2))
    x, y = torch.randn(64, 128), torch.randn(64, 4)
    losses = []
    for _ in range(30):
        out = torch.func.functional_call(net, gb.apply(gparams, plan), (x,))
        loss = nn.functional.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"free_lr": 0}, ValueError, r"gb\.optim\.param_groups: free_lr must be a number > 0"),
        ({"free_lr": 1e-3, "scale": -1}, ValueError, r"scale must be a number > 0, got -1"),
    ],
)
def test_bad_rates_are_named(kwargs, error, match):
    plan = gb.plan(model(), tile=(8, 8))
    with pytest.raises(error, match=match):
        gb.optim.param_groups(gb.init(plan), plan, **kwargs)


def test_gparams_of_another_plan_are_refused():
    plan = gb.plan(model(), tile=(8, 8))
    other = gb.plan(model(), tile=(4, 4))
    with pytest.raises(ValueError, match=r"gb\.optim\.param_groups: "):
        gb.optim.param_groups(gb.init(other), plan, free_lr=1e-3)


def test_a_ranks_shard_gets_its_leaves_rates():
    """`gb.dist.RankOwned.shard` keeps every stack and leaf with fewer g-nets: accepted; a
    missing leaf or another hidden size is not."""
    plan = gb.plan(model(), tile=(8, 8), hidden=4, activation="tanh")
    gparams = gb.init(plan)
    shard = {
        "stacks": {
            key: {leaf: v[:1].detach().requires_grad_() for leaf, v in leaves.items()}
            for key, leaves in gparams["stacks"].items()
        },
        "free": gparams["free"],
        "frozen": gparams["frozen"],
    }
    by_id = rates(gb.optim.param_groups(shard, plan, free_lr=1e-3))
    assert set(by_id) == {id(t) for t in gb.trainable_leaves(shard)}
    stack_leaves = [t for leaves in shard["stacks"].values() for t in leaves.values()]
    assert {by_id[id(t)] for t in stack_leaves} == {0.3}
    wider = gb.plan(model(), tile=(8, 8), hidden=6, activation="tanh")
    with pytest.raises(
        ValueError, match=r"has shape \(256, 6, 6\); expected \(256, 6, 4\) \(a shard"
    ):
        gb.optim.param_groups(gb.init(wider), plan, free_lr=1e-3)
    del shard["stacks"][plan.stacks[0].key]["w_out"]
    with pytest.raises(ValueError, match=r"\['w_out'\] is missing"):
        gb.optim.param_groups(shard, plan, free_lr=1e-3)


def test_a_bottlenecks_groups_hold_its_parameters_at_the_default_rates():
    net = gb.Bottleneck(model(), tile=(8, 8), hidden=4, hashed=8, activation="tanh")
    by_id = rates(net.param_groups(free_lr=1e-3, scale=0.5))
    assert set(by_id) == {id(p) for p in net.parameters()}
    assert by_id == rates(gb.optim.param_groups(net.gparams, net.plan, free_lr=1e-3, scale=0.5))
    assert sorted(set(by_id.values())) == [1e-3, 0.015, 0.15]


def test_the_schedule_warms_up_over_a_quarter_then_decays_to_its_final_fraction():
    plan = gb.plan(nn.Linear(8, 2), tile=(4, 4))
    opt = torch.optim.SGD(gb.optim.param_groups(gb.init(plan), plan, free_lr=1.0), lr=1.0)
    peaks = [g["lr"] for g in opt.param_groups]
    sched = gb.optim.schedule(opt, steps=800)
    seen = []
    for _ in range(800):
        seen.append(opt.param_groups[0]["lr"] / peaks[0])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(1 / 200)
    assert seen[199] == pytest.approx(1.0)
    assert seen[200] == pytest.approx(1.0)
    assert seen[-1] == pytest.approx(0.1, abs=1e-4)
    assert all(a >= b for a, b in itertools.pairwise(seen[200:]))
    assert opt.param_groups[-1]["lr"] / peaks[-1] == pytest.approx(0.1)  # every group alike
    short = gb.optim.schedule(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), 10, warmup=2
    )
    assert short.get_last_lr() == [0.5]
    for steps, warmup in ((1, None), (4, 4)):  # warm-up to the last step: no decay to divide
        one = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        whole = gb.optim.schedule(one, steps, warmup=warmup)
        for _ in range(steps):
            one.step()
            whole.step()
        assert whole.get_last_lr() == [1.0]
    with pytest.raises(ValueError, match="steps"):
        gb.optim.schedule(opt, steps=0)
    with pytest.raises(ValueError, match=r"final must be a fraction of the peak rate in \[0, 1\]"):
        gb.optim.schedule(opt, steps=10, final=2.0)
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer, got str"):
        gb.optim.schedule("opt", steps=10)


@pytest.mark.parametrize(
    ("override", "rate"),
    [
        ({"activation": "tanh"}, gb.optim.GNET_LR["tanh"]),  # the larger of the two fed
        ({"activation": "tanh", "condition": 0}, gb.optim.GNET_LR["relu"]),  # tanh not fed
    ],
)
def test_task_embeddings_take_the_largest_rate_of_the_gnets_they_feed(override, rate):
    mlp = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))  # factor 1
    plan = gb.plan(
        mlp, tile=(16, 16), hidden=5, condition=3, tasks=2, overrides={"2.weight": override}
    )
    gparams = gb.init(plan)
    groups = gb.optim.param_groups(gparams, plan, free_lr=1e-3)
    assert rates(groups)[id(gparams["tasks"])] == rate


@pytest.mark.parametrize(("inputs", "factor"), [(16, 3.0), (64, 2.0), (100, 1.28), (128, 1.0)])
def test_gnets_of_weights_with_few_inputs_step_up_to_three_times(inputs, factor):
    """`fan_in_factor`: 128 / fan-in, clipped to [1, 3]; the hashed table keeps its rate."""
    plan = gb.plan(nn.Linear(inputs, 8), tile="full", hidden=4, hashed=8, activation="tanh")
    gparams = gb.init(plan)
    (stack,) = plan.stacks
    assert gb.optim.fan_in_factor(plan, stack) == pytest.approx(factor)
    by_id = rates(gb.optim.param_groups(gparams, plan, free_lr=1e-3))
    for leaf, t in gparams["stacks"][stack.key].items():
        want = 0.03 if leaf == "tile_hash" else 0.3 * factor
        assert by_id[id(t)] == pytest.approx(want), leaf
        assert gb.optim.gnet_lr(plan, stack, leaf) == pytest.approx(want), leaf


def test_a_stack_takes_the_largest_fan_in_of_its_weights_and_ignores_vectors():
    """One stack of 8x8 tiles over weights of fan-in 64 and 8: 128 / 64. A stack of
    biases alone, and a stack whose largest fan-in is 128, step at `GNET_LR`."""
    mixed = gb.plan(nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 8)), tile=(8, 8), hidden=4)
    (stack,) = mixed.stacks
    assert [p.fan_in for p in mixed.generated] == [64, 8]
    assert gb.optim.fan_in_factor(mixed, stack) == 2.0
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(128, 8))
    plan = gb.plan(net, tile=(8, 8), hidden=4, biases=True)  # biases: a stack of their own
    names = {tuple(p.name for p in plan.generated_by(i)) for i in range(len(plan.stacks))}
    assert names == {("0.weight", "1.weight"), ("0.bias", "1.bias")}
    assert {gb.optim.fan_in_factor(plan, s) for s in plan.stacks} == {1.0}
    small = gb.plan(nn.Linear(8, 8), tile=(8, 8), hidden=4, biases=True)  # fan-in 8: 3x
    assert [gb.optim.fan_in_factor(small, s) for s in small.stacks] == [3.0, 1.0]


def test_a_stack_of_another_plan_is_named():
    plan = gb.plan(nn.Linear(64, 8), tile="full", hidden=4)
    other = gb.plan(nn.Linear(32, 8), tile="full", hidden=4)
    with pytest.raises(ValueError, match=r"stack 's0_8x32' is not one of the plan's stacks"):
        gb.optim.gnet_lr(plan, other.stacks[0], "w_out")


def test_a_weight_stored_inputs_first_counts_its_first_dimension():
    """transformers' `Conv1D` keeps its weight `(inputs, outputs)`: 32 inputs, factor 3, where
    torch's reading of `(32, 256)` would give 256 inputs and factor 1."""
    net = nn.Sequential(Conv1D(256, 32))
    plan = gb.plan(net, tile="full", hidden=4)
    assert [p.fan_in for p in plan.generated] == [32]
    assert gb.optim.fan_in_factor(plan, plan.stacks[0]) == 3.0


def test_the_main_jobs_transformer_keeps_its_rates():
    """Every weight the character transformer's genome generates has fan-in 128 or more, so
    the fan-in rule leaves its text results as they were measured."""
    cfg = CharLMConfig()
    net = CharTransformer(96, cfg.context, cfg.width, cfg.depth, cfg.heads)
    plan = gb.plan(net, **cfg.plan)
    assert min(p.fan_in for p in plan.generated if len(p.shape) >= 2) == 128
    gparams = gb.init(plan)
    by_id = rates(gb.optim.param_groups(gparams, plan, free_lr=1e-3))
    for stack in plan.stacks:
        for leaf, t in gparams["stacks"][stack.key].items():
            base = gb.optim.TABLE_LR if leaf == "tile_hash" else gb.optim.GNET_LR["relu"]
            assert by_id[id(t)] == base, (stack.key, leaf)
