"""`gb.init` starts from the model's own values: free and frozen tensors copied, generated
weights at the scale of the model's own (issue 15, part 1)."""

import pickle

import pytest
import torch
from torch import nn
from torch.func import functional_call

import gbfunc as gb


def frozen_embedding_model() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
    model[0].weight.requires_grad_(False)
    model[0].weight.data.fill_(1.0)
    model.register_parameter("steps", nn.Parameter(torch.arange(3), requires_grad=False))
    return model


def test_frozen_and_integer_parameters_round_trip_bitwise(tmp_path):
    model = frozen_embedding_model()
    plan = gb.plan(model, tile=(4, 4))
    gparams = gb.init(plan)
    assert gparams["frozen"]["steps"].dtype == torch.int64
    params = gb.apply(gparams, plan)
    assert torch.equal(params["0.weight"], model[0].weight)
    assert torch.equal(params["steps"], model.steps)
    dense = gb.export(gparams, plan, model=model)
    assert torch.equal(dense["0.weight"], torch.ones(10, 8))
    assert dense["steps"].dtype == torch.int64
    assert torch.equal(dense["steps"], model.steps)
    gb.save(tmp_path / "c.safetensors", gparams, plan)
    loaded = gb.load(tmp_path / "c.safetensors", model).gparams
    for group in ("free", "frozen"):
        for name, value in gparams[group].items():
            assert loaded[group][name].dtype == value.dtype
            assert torch.equal(loaded[group][name], value), name


def test_free_parameters_copy_the_model_and_do_not_alias_it():
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)  # "pretrained" values, not the module's init
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan)
    for name in ("0.bias", "1.weight", "1.bias", "2.bias"):
        assert torch.equal(gparams["free"][name], dict(model.named_parameters())[name])
    gparams["free"]["1.weight"].data.zero_()
    assert model[1].weight.min() >= 0.5  # a copy: training gparams leaves the model alone


def test_values_come_from_the_model_given_or_are_drawn_on_request():
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    plan = gb.plan(model, tile=(8, 8))
    other = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    assert torch.equal(gb.init(plan, model=other)["free"]["0.bias"], other[0].bias)
    drawn = gb.init(plan, values="draw")["free"]["0.bias"]
    assert not torch.equal(drawn, model[0].bias)
    assert drawn.abs().max() <= 1 / 4  # the module's own rule: U(-1/sqrt(fan_in), ...)
    with pytest.raises(ValueError, match=r"gb\.init: values must be one of"):
        gb.init(plan, values="pretrained")
    with pytest.raises(ValueError, match=r"gb\.init"):
        gb.init(plan, model=nn.Sequential(nn.Linear(16, 8), nn.LayerNorm(8)))


def test_meta_models_and_unpickled_plans_draw():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    plan = gb.plan(model, tile=(8, 8))
    assert torch.equal(gb.init(plan)["free"]["1.weight"], torch.ones(16))
    alive = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    real = gb.plan(alive, tile=(8, 8))
    copy = pickle.loads(pickle.dumps(real))
    assert copy == real
    assert copy.model() is None
    assert real.model() is not None
    assert copy.fingerprint() == real.fingerprint() == plan.fingerprint()


def test_generated_weights_start_at_the_models_own_scale():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    with torch.no_grad():
        model[1].weight.normal_(0.0, 0.01)  # custom init: kept
        model[2].weight.zero_()  # constant: the layer's default std instead
    plan = gb.plan(model, tile=(16, 16))
    scales = {p.name: p.scale for p in plan.generated}
    assert scales["0.weight"] == pytest.approx(1 / (3 * 64) ** 0.5)  # the default, exactly
    assert scales["1.weight"] == pytest.approx(0.01, rel=0.05)
    assert scales["2.weight"] == pytest.approx(1 / (3 * 64) ** 0.5)
    generated = gb.apply(gb.init(plan), plan)["1.weight"]
    assert generated.std().item() == pytest.approx(0.01, rel=0.1)


@pytest.mark.parametrize("legacy", [False, True])
def test_weight_norm_layers_start_at_their_own_values(legacy):
    torch.manual_seed(0)
    layer = nn.Linear(32, 32)
    if legacy:
        layer = torch.nn.utils.weight_norm(layer)
    else:
        layer = nn.utils.parametrizations.weight_norm(layer)
    model = nn.Sequential(layer, nn.Linear(32, 8))
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan)
    assert not any(p.name.startswith("0.") for p in plan.generated)  # no rule: free
    x = torch.randn(16, 32)
    out = functional_call(model[0], _prefixed(gb.apply(gparams, plan), "0."), (x,))
    torch.testing.assert_close(out, model[0](x))  # the weight-normed layer exactly


def _prefixed(params: dict, prefix: str) -> dict:
    return {k.removeprefix(prefix): v for k, v in params.items() if k.startswith(prefix)}


def _step0_losses(model: nn.Module, batch: dict, **plan_options) -> tuple[float, float]:
    model.eval()
    plan = gb.plan(model, **plan_options)
    params = gb.apply(gb.init(plan), plan)
    with torch.no_grad():
        dense = model(**batch).loss.item()
        ours = functional_call(model, params, (), batch).loss.item()
    return dense, ours


@pytest.mark.slow
@pytest.mark.parametrize("embeddings", [False, True])
def test_gpt2_from_a_config_starts_at_the_dense_loss(embeddings):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (4, 32))
    dense, ours = _step0_losses(
        model, {"input_ids": ids, "labels": ids}, tile=(32, 32), embeddings=embeddings
    )
    assert ours == pytest.approx(dense, rel=0.05)


@pytest.mark.slow
def test_bert_from_a_config_starts_at_the_dense_loss():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    model = transformers.BertForMaskedLM(config)
    ids = torch.randint(0, 512, (4, 32))
    dense, ours = _step0_losses(model, {"input_ids": ids, "labels": ids}, tile=(32, 32))
    assert ours == pytest.approx(dense, rel=0.05)
    plan = gb.plan(model, tile=(32, 32))
    query = next(p for p in plan.generated if p.name.endswith("attention.self.query.weight"))
    assert query.scale == pytest.approx(0.02, rel=0.05)  # BERT's N(0, 0.02), not Kaiming


def test_drawn_free_parameters_depend_on_the_seed_only():
    """A free table drawn from N(0, 1) (an embedding on the meta device) comes from `seed`'s
    generator, whatever the global RNG did before."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 8))
    plan = gb.plan(model, tile=(4, 4))
    torch.manual_seed(1)
    first = gb.init(plan, seed=5)["free"]["0.weight"]
    torch.manual_seed(2)
    again = gb.init(plan, seed=5)["free"]["0.weight"]
    other = gb.init(plan, seed=6)["free"]["0.weight"]
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert 0.8 < first.std().item() < 1.2  # nn.Embedding draws N(0, 1)
    assert torch.equal(gb.init(plan)["free"]["0.weight"], gb.init(plan, seed=0)["free"]["0.weight"])


def test_drawn_integer_parameters_keep_their_dtype():
    """Drawn (no model values), an integer frozen parameter is zeros of its own dtype, whatever
    floating dtype the g-nets get."""
    plan = gb.plan(frozen_embedding_model(), tile=(4, 4))
    steps = gb.init(plan, values="draw", dtype=torch.float64)["frozen"]["steps"]
    assert steps.dtype == torch.int64
    assert torch.equal(steps, torch.zeros_like(steps))


@pytest.mark.parametrize("hidden", [8, 10])
def test_init_ties_hidden_units_in_fours_so_each_gnet_starts_odd(hidden):
    """Units 4k..4k+3 share first-layer weights up to the signs (+a+b, +a-b, -a+b, -a-b), and
    their bias and tile embedding, and enter the output with signs (+, -, -, +); units left
    over from the fours start silent."""
    plan = gb.plan(nn.Linear(16, 16), tile=(8, 8), hidden=hidden, share=True)
    stack = plan.stacks[0]
    leaves = gb.init(plan, seed=0)["stacks"][stack.key]
    assert {"w_embed", "b_in"} <= leaves.keys()
    assert torch.equal(leaves["w_out"].detach()[:, 8:], torch.zeros_like(leaves["w_out"][:, 8:]))
    rows, cols = slice(0, stack.row_width), slice(stack.row_width, None)
    first = slice(0, 8, 4)
    for s, (row, col) in enumerate(((1, 1), (1, -1), (-1, 1), (-1, -1))):
        unit = slice(s, 8, 4)
        w_in = leaves["w_in"].detach()
        assert torch.equal(w_in[:, rows, unit], row * w_in[:, rows, first])
        assert torch.equal(w_in[:, cols, unit], col * w_in[:, cols, first])
        w_out = leaves["w_out"].detach()
        assert torch.equal(w_out[:, unit], row * col * w_out[:, first])
        for name in ("b_in", "w_embed"):
            tied = leaves[name].detach()
            assert torch.equal(tied[..., unit], tied[..., first]), name
    assert leaves["w_embed"].detach()[..., first].abs().sum() > 0  # not trivially equal


def test_a_gnet_with_two_positions_starts_standardised():
    """Two positions per g-net standardise to exactly -1 and +1."""
    from gbfunc._evaluate import evaluate_stack

    plan = gb.plan(nn.Linear(4, 6), tile=(1, 2), biases=False)
    (stack,) = plan.stacks
    leaves = gb.init(plan, dtype=torch.float64)["stacks"][stack.key]
    with torch.no_grad():
        pairs = evaluate_stack(stack, leaves).reshape(stack.num_tiles, -1)
    torch.testing.assert_close(pairs.abs(), torch.ones_like(pairs))
    torch.testing.assert_close(pairs.sum(1), torch.zeros(pairs.shape[0], dtype=torch.float64))


@pytest.mark.parametrize("buckets", [1, 2, 5])
def test_hashed_tables_start_standardised_per_tile_from_the_seed_alone(buckets):
    """Each tile's table (stored divided by `HASH_GAIN`) has exactly mean 0 and sample std 1
    when it has two buckets or more, is finite with one, and comes from `seed`'s generator,
    not the global one."""
    from gbfunc._evaluate import HASH_GAIN

    with torch.device("meta"):
        model = nn.Linear(12, 8)
    plan = gb.plan(model, tile=(4, 4), hashed=buckets)
    (stack,) = plan.stacks
    torch.manual_seed(1)
    table = gb.init(plan, seed=3, dtype=torch.float64)["stacks"][stack.key]["tile_hash"]
    torch.manual_seed(2)
    again = gb.init(plan, seed=3, dtype=torch.float64)["stacks"][stack.key]["tile_hash"]
    assert stack.num_tiles > 1
    assert table.shape == (stack.num_tiles, buckets)
    assert torch.equal(table, again)
    assert torch.isfinite(table).all()
    if buckets > 1:
        zeros = torch.zeros(stack.num_tiles, dtype=torch.float64)
        torch.testing.assert_close(table.detach().mean(1), zeros)
        torch.testing.assert_close(table.detach().std(1) * HASH_GAIN, torch.ones_like(zeros))


def test_a_model_that_does_not_match_the_plan_is_named_before_anything_is_drawn():
    plan = gb.plan(nn.Linear(8, 4), tile=(4, 4))
    with pytest.raises(
        ValueError,
        match=r"^gb\.init: parameter 'weight' has shape \(4, 8\) in the plan but \(4, 6\)",
    ):
        gb.init(plan, model=nn.Linear(6, 4))
