"""Generated weights learn in units of a fan-in init (`Generated.scale`, `step_scale`): a
weight drawn larger (`nn.Embedding`'s N(0, 1)) starts at its own std through `start`, and an
optimizer step moves it as much as a fan-in-initialised layer (issue 54, item 1)."""

import math

import pytest
import torch
from torch import nn

import gbfunc as gb
from gbfunc import _rules
from gbfunc._check_plan import check_plan
from gbfunc._plan import Generated
from gbfunc._serial import plan_from_json, plan_to_json
from gbfunc._spec import HASH_GAIN


def lm(vocab: int = 24, dim: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Linear(dim, vocab))


GENOMES = {
    "hashed": {"tile": (8, 8), "hidden": 4, "outputs": 8, "share": True, "hashed": 12},
    "tiled": {"tile": (8, 8), "hidden": 8, "outputs": 8},
    "full": {"tile": "full", "hidden": 6},
}


def by_name(plan: gb.Plan) -> dict[str, Generated]:
    return {p.name: p for p in plan.generated}


@pytest.mark.parametrize("genome", GENOMES)
def test_embeddings_learn_in_fan_in_units_and_start_at_their_own_std(genome):
    model = lm()
    plan = gb.plan(model, **GENOMES[genome], embeddings=True)
    p = by_name(plan)
    assert p["0.weight"].scale == pytest.approx(1 / math.sqrt(32))
    assert p["0.weight"].start == pytest.approx(math.sqrt(32))  # N(0, 1): its std is 1
    assert p["0.weight"].init_std == pytest.approx(1.0)
    weights = gb.apply(gb.init(plan, seed=1), plan)
    assert weights["0.weight"].std().item() == pytest.approx(1.0, rel=0.1)
    for name in ("1.weight", "2.weight"):  # below the cap: as before, raw at unit std
        assert p[name].start == 1.0
        assert p[name].scale == pytest.approx(1 / math.sqrt(3 * 32), rel=1e-3)
        assert weights[name].std().item() == pytest.approx(p[name].scale, rel=0.15)


def test_linear_conv_and_attention_weights_are_unchanged():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 16),
        nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
    )
    plan = gb.plan(model, tile="full", hidden=3, biases=True)
    assert all(p.start == 1.0 for p in plan.generated)
    assert '"start"' not in plan_to_json(plan)  # plans without a cap keep their JSON


def test_an_adam_step_moves_a_generated_embedding_like_a_fan_in_layer():
    """Adam's first step moves every leaf by its rate; through a table of gain `HASH_GAIN`
    the weights move by `rate * HASH_GAIN * scale`: for the embedding, `1 / sqrt(dim)` in
    place of its std 1 (32 times smaller here), as for a fan-in-initialised Linear."""
    model = lm(dim=64)
    plan = gb.plan(model, **GENOMES["hashed"], embeddings=True)
    gparams = gb.init(plan, seed=0)
    table = gparams["stacks"][plan.stacks[0].key][gb.optim.TABLE_LEAF]
    before = gb.apply(gparams, plan)
    loss = sum((w * torch.randn_like(w)).sum() for w in before.values())
    loss.backward()
    opt = torch.optim.Adam([table], lr=1e-3)
    opt.step()
    after = gb.apply(gparams, plan)
    moved = (after["0.weight"] - before["0.weight"]).abs().max().item()
    assert moved == pytest.approx(1e-3 * HASH_GAIN / math.sqrt(64), rel=1e-2)
    linear = (after["1.weight"] - before["1.weight"]).abs().max().item()
    assert linear == pytest.approx(1e-3 * HASH_GAIN * by_name(plan)["1.weight"].scale, rel=1e-2)


def test_a_plan_with_a_start_round_trips_and_a_bad_one_is_refused(tmp_path):
    model = lm()
    plan = gb.plan(model, **GENOMES["tiled"], embeddings=True)
    assert plan_from_json(plan_to_json(plan)) == plan
    gparams = gb.init(plan, seed=0)
    gb.save(tmp_path / "c.safetensors", gparams, plan)
    loaded = gb.load(tmp_path / "c.safetensors", lm())
    assert loaded.plan == plan
    text = plan_to_json(plan).replace(f'"start":{by_name(plan)["0.weight"].start}', '"start":-1')
    assert '"start":-1' in text
    with pytest.raises(ValueError, match=r"\.start"):
        check_plan(plan_from_json(text), lm(), "test", corrupt=ValueError, mismatch=TypeError)


class InputsFirst(nn.Module):
    """A weight stored `(inputs, outputs)`, as transformers' `Conv1D` stores it."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(inputs, outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_a_weight_stored_inputs_first_is_capped_by_its_inputs():
    """The cap is `1 / sqrt(fan_in)` with the fan-in on dim 0 of an inputs-first weight: 8
    inputs cap it at 0.354, where the outputs (64) would give 0.125."""
    gb.register_rule(InputsFirst, lambda m: {"weight": gb.Layout(1.0, inputs_first=True)})
    try:
        plan = gb.plan(nn.Sequential(InputsFirst(8, 64), InputsFirst(64, 8)), tile="full")
    finally:
        del _rules._RULES[InputsFirst]
    p = by_name(plan)
    assert p["0.weight"].scale == pytest.approx(1 / math.sqrt(8))
    assert p["1.weight"].scale == pytest.approx(1 / math.sqrt(64))
    # With a kernel window, the fan-in counts its taps too: 8 inputs x 9 taps.
    assert _rules.step_scale(1.0, (8, 64, 3, 3), inputs_first=True) == pytest.approx(1 / 72**0.5)


def test_equally_built_small_models_get_equal_plans_whatever_their_seed():
    """A tensor's measured std snaps to its rule's within `4 / sqrt(n)` when that is wider
    than 20%: at 20% alone, a generated bias of 4 values got a scale of its own on most
    seeds, and so a plan (and a `state_dict` fingerprint) of its own."""
    fingerprints = set()
    for seed in range(40):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
        fingerprints.add(gb.plan(model, tile="full", biases=True).fingerprint())
    assert len(fingerprints) == 1


@pytest.mark.parametrize(
    ("values", "factor", "own"),
    [(32, 3.0, True), (32, 1.5, False), (4096, 1.5, True), (4096, 1.1, False)],
)
def test_a_weight_drawn_apart_from_its_rule_keeps_its_own_scale(values, factor, own):
    """Beyond the snap (20%, or `4 / sqrt(n)` for n < 400 values) pretrained or custom
    weights keep their own std, rounded to two digits."""
    layer = nn.Linear(values // 4, 4, bias=False)
    rule = 1 / math.sqrt(3 * values // 4)  # nn.Linear's default init
    with torch.no_grad():
        layer.weight.normal_(0, factor * rule, generator=torch.Generator().manual_seed(0))
    scale = gb.plan(layer, tile="full").generated[0].init_std
    assert (scale != pytest.approx(rule)) == own
