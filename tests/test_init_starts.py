"""gb.init starts no generated weight constant: tiles of one evaluation position, g-nets
whose units all start inactive, and the warning where drawing again cannot help."""

import warnings

import pytest
import torch
from test_apply import target_stds
from torch import nn
from torch.func import functional_call

import gbfunc as gb
from gbfunc import _stack_init


def _small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))


def test_gnets_whose_units_all_start_inactive_are_drawn_again():
    # 4 shared ReLU units over 2 tiles: on these seeds every unit started dead (or linear,
    # where the odd-tied units cancel) on both tiles of `2.weight`: all its weights equal.
    model = _small_mlp()
    plan = gb.plan(model, tile=(4, 4), share=True, hidden=4)
    for seed in (8, 10, 17):
        weight = gb.apply(gb.init(plan, seed), plan)["2.weight"].detach()
        assert weight.std() > 0.5 * target_stds(model, plan)["2.weight"], seed


def test_a_shared_gnets_inactive_tiles_are_drawn_again():
    # 4 shared ReLU units over 16 tiles of 16x16: 3.4% of tiles started constant (each a
    # block of 256 equal weights), unwarned, since their g-net as a whole was not.
    plan = gb.plan(nn.Linear(64, 64), tile=(16, 16), share=True, hidden=4)
    for seed in range(12):
        weight = gb.apply(gb.init(plan, seed), plan)["weight"].detach()
        tiles = weight.reshape(4, 16, 4, 16).transpose(1, 2).reshape(16, -1)
        assert bool((tiles.std(1) > 1e-4).all()), seed


def test_a_stack_mixing_one_position_gnets_with_wider_ones_starts_them_all():
    # Shared g-nets, where a bias of one value has one position and one tile: it started at
    # exactly 0 on every seed (the stack was not all of one position).
    plan = gb.plan(nn.Linear(5, 1), tile=(1, 1), share=True, biases=True)
    bias = torch.stack([gb.apply(gb.init(plan, seed), plan)["bias"] for seed in range(8)])
    assert bool((bias != 0).all())


def test_a_conditioned_relu_gnet_of_one_position_learns_to_depend_on_the_task():
    # Zero codes, biases and `w_cond` put every unit at exactly 0, where ReLU passes no
    # gradient: the weights of two tasks stayed equal through training.
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    plan = gb.plan(model, tile=(1, 1), condition=3, tasks=2)
    gparams = gb.init(plan, 0)
    x = torch.randn(8, 6)

    def loss() -> torch.Tensor:
        outs = [functional_call(model, gb.apply(gparams, plan, task=t), (x,)) for t in (0, 1)]
        return (outs[0] - 1).square().mean() + (outs[1] + 1).square().mean()

    loss().backward()
    (w_cond,) = (v.grad for d in gparams["stacks"].values() for k, v in d.items() if k == "w_cond")
    assert w_cond.abs().max() > 1e-3


@pytest.mark.parametrize(
    ("model", "kwargs"),
    [
        # `Generated.start` (embeddings start above a fan-in init) was ignored at one position.
        (nn.Embedding(40, 12), {"tile": (1, 1), "embeddings": True}),
        (nn.Embedding(40, 12), {"tile": (1, 12), "outputs": 12, "embeddings": True}),
        # Sample std over 2 outputs: 0.71 of the target.
        (nn.Linear(40, 30), {"tile": (1, 2), "outputs": 2}),
        # Fourier codes are not zero at one position: 1.2 times the target.
        (nn.Linear(40, 30), {"tile": (1, 1), "encoding": "fourier"}),
    ],
)
def test_one_position_gnets_start_at_the_pnet_init_std(model, kwargs):
    plan = gb.plan(model, **kwargs)
    for name, target in target_stds(model, plan).items():
        stds = [gb.apply(gb.init(plan, s), plan)[name].std().item() for s in range(4)]
        assert sum(stds) / 4 == pytest.approx(target, rel=0.1), (name, stds, target)


def test_tiles_still_constant_after_every_draw_are_named_in_a_warning(monkeypatch):
    monkeypatch.setattr("gbfunc._stack_init.DRAWS", 1)  # the first draw only, constant on seed 8
    plan = gb.plan(_small_mlp(), tile=(4, 4), share=True, hidden=4)
    with pytest.warns(UserWarning, match=r"2 of 10 tiles of 2.weight start constant at seed 8"):
        gb.init(plan, 8)


def test_the_warning_names_every_parameter_with_a_constant_tile_and_points_at_the_caller(
    monkeypatch,
):
    # One hidden ReLU unit a layer, two layers: about half the tiles start constant. The names
    # came from each parameter's first tile only (often none), and the warning pointed into
    # gbfunc.
    monkeypatch.setattr("gbfunc._stack_init.DRAWS", 1)
    plan = gb.plan(
        nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), tile=(4, 4), hidden=1, depth=2
    )
    with pytest.warns(UserWarning, match=r"of 128 tiles of 0.weight, 1.weight start") as caught:
        gb.init(plan, 0)
    assert caught[0].filename == __file__


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tile": "full", "activation": "tanh", "encoding": "gray", "hidden": 9},
        {"tile": (16, 16), "depth": 2},
        {"tile": "full", "hashed": 16},
    ],
)
def test_centred_weights_start_at_their_std_once_centred(kwargs):
    # Centring each row took a share of the variance that normalising tile by tile could not
    # see: the main job's MLP (tanh, whole-weight tiles) started at 0.49-0.79 of its std.
    plan = gb.plan(nn.Linear(64, 48), center=True, **kwargs)
    (p,) = (p for p in plan.generated if p.name == "weight")
    for seed in range(3):
        weight = gb.apply(gb.init(plan, seed), plan)["weight"].detach()
        assert weight.std().item() == pytest.approx(p.scale * p.start, rel=1e-3), seed
        assert weight.mean(1).abs().max() < 1e-6  # still centred


def test_tile_embeddings_drawn_again_are_halved_at_each_draw(monkeypatch):
    seen: list[float] = []
    redraw = _stack_init._redraw

    def spy(*args, shrink, **kwargs):
        seen.append(shrink)
        return redraw(*args, shrink=shrink, **kwargs)

    monkeypatch.setattr(_stack_init, "_redraw", spy)
    plan = gb.plan(nn.Linear(64, 64), tile=(16, 16), share=True, hidden=4)
    draws = []
    for seed in range(12):  # seed 8 draws a tile's embedding again
        seen.clear()
        gb.init(plan, seed)
        assert seen == [0.5 ** (k + 1) for k in range(len(seen))], seed
        draws += seen
    assert draws


def test_gnets_of_one_tile_and_one_position_start_without_a_warning():
    plan = gb.plan(nn.Linear(5, 3), tile=(1, 1), biases=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pyproject.toml ignores "start constant" warnings
        weights = gb.apply(gb.init(plan, 0), plan)
    assert weights["weight"].std() > 0.1


def test_task_embeddings_start_as_standard_normal_draws():
    plan = gb.plan(nn.Linear(16, 8), tile=(4, 4), hidden=4, condition=32, tasks=64)
    tasks = gb.init(plan, seed=0)["tasks"].detach()
    assert tasks.std().item() == pytest.approx(1.0, abs=0.05)
    assert abs(tasks.mean().item()) < 0.05
