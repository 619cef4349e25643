"""`gb.init` starts from the model's own values: free and frozen tensors copied, generated
weights at the scale of the model's own (issue 15, part 1)."""

import pickle

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

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


def test_a_model_changed_after_its_plan_is_named_by_init_not_copied():
    """The plan remembers its model; a layer swapped or removed since was copied unchecked
    (a free tensor of another shape) or raised a bare KeyError. Another dtype is cast."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    plan = gb.plan(model, tile=(4, 4))
    model.double()
    assert gb.init(plan)["free"]["1.bias"].dtype == torch.float32
    model[1] = nn.Linear(8, 6)
    with pytest.raises(
        ValueError,
        match=r"'1\.weight' has shape \(4, 8\) in the plan but "
        r"\(6, 8\) in the model\. The model was changed after gb\.plan",
    ):
        gb.init(plan)
    del model[1]
    with pytest.raises(ValueError, match=r"'1\.weight' \(4, 8\) is in the plan but not in"):
        gb.init(plan)
    assert gb.init(plan, values="draw")["free"]["1.bias"].shape == (4,)


def test_attention_bias_k_and_bias_v_are_drawn_as_torch_draws_them():
    """xavier_normal_ of (1, 1, E): std 1 / sqrt(E); they were drawn as zeros."""
    plan = gb.plan(nn.MultiheadAttention(64, 4, add_bias_kv=True), tile=(16, 16))
    drawn = gb.init(plan, values="draw", requires_grad=False)["free"]
    for name in ("bias_k", "bias_v"):
        assert drawn[name].std().item() == pytest.approx(1 / 8, rel=0.25)


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
        model[2].weight.zero_()  # constant: the layer's default std instead, and said so
    with pytest.warns(UserWarning, match=r"2\.weight is constant in the model"):
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


def test_a_legacy_spectral_norm_layer_stays_free_and_the_rest_is_planned():
    """`torch.nn.utils.spectral_norm` keeps `weight_orig` and computes `weight` in a hook:
    the Linear rule's `weight` was taken for a parameter, and planning raised."""
    torch.manual_seed(0)
    model = nn.Sequential(torch.nn.utils.spectral_norm(nn.Linear(32, 32)), nn.Linear(32, 8))
    model.eval()  # no power iteration: the layer's weight is fixed
    plan = gb.plan(model, tile=(8, 8))
    assert [p.name for p in plan.generated] == ["1.weight"]
    assert "0.weight_orig" in {p.name for p in plan.free}
    x = torch.randn(16, 32)
    out = functional_call(model[0], _prefixed(gb.apply(gb.init(plan), plan), "0."), (x,))
    torch.testing.assert_close(out, model[0](x))


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


class _HalfPrecision(nn.Module):
    """bfloat16 layers around a float32 LayerNorm, as mixed-precision models keep them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(24, 16, dtype=torch.bfloat16)
        self.norm = nn.LayerNorm(16)
        self.b = nn.Linear(16, 4, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(torch.relu(self.a(x)).float()).to(torch.bfloat16))


def test_the_default_dtype_is_the_models_so_a_bfloat16_model_runs():
    # gb.init drew float32 leaves whatever the model, so a bfloat16 p-net failed at forward
    # with torch's dtype error.
    model = _HalfPrecision()
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan)
    for stack in gparams["stacks"].values():
        assert {t.dtype for t in stack.values()} == {torch.bfloat16}
    assert gparams["free"]["a.bias"].dtype == torch.bfloat16
    assert gparams["free"]["norm.weight"].dtype == torch.float32
    meta = gb.init(plan, device="meta")
    pairs = zip(pytree.tree_leaves(meta), pytree.tree_leaves(gparams), strict=True)
    assert all(m.dtype == r.dtype for m, r in pairs)
    params = gb.apply(gparams, plan)
    assert {n: t.dtype for n, t in params.items()} == {
        n: t.dtype for n, t in model.named_parameters()
    }
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    assert functional_call(model, params, (x,)).dtype == torch.bfloat16
    assert gb.Bottleneck(model, tile=(8, 8))(x).dtype == torch.bfloat16
    widened = gb.init(plan, dtype=torch.float64)  # an explicit dtype is every leaf's
    assert {t.dtype for t in pytree.tree_leaves(widened)} == {torch.float64}
    gb.apply(widened, plan)
    mixed = dict(gparams, free=dict(gparams["free"], **{"a.bias": widened["free"]["a.bias"]}))
    with pytest.raises(TypeError, match=r"\['a\.bias'\] has dtype torch\.float64 but .*bfloat16"):
        gb.apply(mixed, plan)


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
    from gbfunc.generate.torch_ops import evaluate_stack

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
    from gbfunc._spec import HASH_GAIN

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


class _OffMeta(TorchDispatchMode):
    """Fails the first operation that makes a tensor anywhere but on `meta`."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in pytree.tree_leaves(out):
            assert not (isinstance(x, torch.Tensor) and not x.is_meta), f"{func} made {x.device}"
        return out


def test_a_meta_init_draws_and_evaluates_nothing():
    """Issue 53, row 6: `device="meta"` for eight 4096 x 4096 layers in 16 x 16 tiles held
    17.7 GiB, every tile evaluated in float64 on the CPU; now no tensor is made off `meta`."""
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(8)))
    plan = gb.plan(model, tile=(16, 16), hidden=8)
    with _OffMeta():
        gparams = gb.init(plan, device="meta")
    (stack,) = plan.stacks
    assert stack.num_tiles == 8 * 256 * 256
    leaves = gparams["stacks"][stack.key]
    assert {k: tuple(v.shape) for k, v in leaves.items()} == stack.leaf_shapes()
    assert all(v.is_meta and v.requires_grad for v in leaves.values())


def test_init_follows_torchs_default_device_and_draws_on_the_cpu_under_any():
    # Under `with torch.device("meta")` (how FSDP2 users build a model) gb.init and
    # gb.Bottleneck raised "Tensor.item() cannot be called on meta tensors".
    plan = gb.plan(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), tile=(4, 4), hashed=8)
    real = gb.init(plan, seed=3)
    with torch.device("meta"):
        on_meta = gb.init(plan, seed=3)
        module = gb.Bottleneck(nn.Linear(8, 8), tile=(4, 4))
        drawn_anyway = gb.init(plan, seed=3, device="cpu")
    assert {t.device.type for t in pytree.tree_leaves(on_meta)} == {"meta"}
    assert {p.device.type for p in module.parameters()} == {"meta"}
    for got, want in zip(pytree.tree_leaves(drawn_anyway), pytree.tree_leaves(real), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("options", [{}, {"share": True}, {"hashed": 3}])
def test_a_meta_init_is_shaped_like_a_real_one_and_traces(options):
    """Same leaves, shapes, dtypes and `requires_grad` as a real init (integer frozen parameters
    keep their dtype), and `gb.apply` and `functional_call` run on them."""
    model = frozen_embedding_model()
    plan = gb.plan(model, tile=(4, 4), **options)
    real = gb.init(plan, dtype=torch.float64)
    meta = gb.init(plan, dtype=torch.float64, device=torch.device("meta"))
    assert {g: list(meta[g]) for g in meta} == {g: list(real[g]) for g in real}
    for (path, m), (_, r) in zip(
        pytree.tree_flatten_with_path(meta)[0], pytree.tree_flatten_with_path(real)[0], strict=True
    ):
        assert m.is_meta, path
        assert (m.shape, m.dtype, m.requires_grad) == (r.shape, r.dtype, r.requires_grad), path
    params = gb.apply(meta, plan, compile=False)
    assert params["1.weight"].is_meta
    assert params["1.weight"].shape == (4, 8)
    out = functional_call(model, params, (torch.zeros(3, dtype=torch.long, device="meta"),))
    assert out.is_meta
    assert out.shape == (3, 4)


def test_a_real_init_evaluates_its_tiles_in_chunks_of_bounded_memory():
    """Issue 53, row 6: a 1024 x 1024 layer in 16 x 16 tiles at 8 hidden units peaked at
    138 MiB, 35x its 4 MiB of generated weights, holding every tile's hidden activations in
    float64; in chunks it stays within 3x (`benchmarks/bench_memory.py --init` measures it)."""
    from benchmarks._meta import peak_bytes

    with torch.device("meta"):
        model = nn.Linear(1024, 1024)
    plan = gb.plan(model, tile=(16, 16), hidden=8)
    assert peak_bytes(lambda: gb.init(plan)) <= 3 * 1024 * 1024 * 4


@pytest.mark.parametrize("pieces", ["tiles", "rows"])
@pytest.mark.parametrize(
    "options",
    [
        {"hidden": 8},
        {"hidden": 12, "outputs": 4, "depth": 2, "activation": "tanh"},
        {"hidden": 16, "share": True},  # 2 g-nets of 64 and 32 tiles, cut by the chunks
        {"tile": "full", "hidden": 6, "activation": "tanh"},  # one tile a weight, not odd
    ],
)
def test_evaluating_in_pieces_gives_the_values_of_all_tiles_at_once(monkeypatch, options, pieces):
    """In chunks of 7 tiles, or 3 rows of a tile at a time, or all at once: the same g-nets,
    to float64 rounding."""
    import gbfunc._stack_init as init_module

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    plan = gb.plan(model, **{"tile": (8, 8), **options})
    monkeypatch.setattr(init_module, "_budget", lambda stack: 2**40)
    at_once = gb.init(plan, seed=2, dtype=torch.float64, requires_grad=False)
    per_row = {s.key: s.columns * s.genome.hidden for s in plan.stacks}
    rows = {"tiles": 7 * 8, "rows": 3}[pieces]
    monkeypatch.setattr(init_module, "_budget", lambda stack: rows * per_row[stack.key])
    in_pieces = gb.init(plan, seed=2, dtype=torch.float64, requires_grad=False)
    torch.testing.assert_close(in_pieces, at_once, rtol=1e-12, atol=1e-15)


def test_free_parameters_of_more_layers_are_drawn_as_their_modules_draw_them():
    """Transposed convolutions, embedding bags and bilinear layers were drawn N(0, 0.02) (or
    zeros for their biases): 50x too small for a bag's N(0, 1) rows."""
    torch.manual_seed(0)
    layers = {
        "0": nn.ConvTranspose2d(16, 24, 3),
        "1": nn.EmbeddingBag(400, 16, padding_idx=3),
        "2": nn.Bilinear(20, 30, 40),
        "3": nn.Linear(16, 8),  # something to generate
    }
    plan = gb.plan(nn.ModuleDict(layers), tile=(8, 8))
    drawn = gb.init(plan, values="draw")["free"]
    for name in ("0.weight", "1.weight", "2.weight"):  # thousands of values each
        module = layers[name[0]]
        module.reset_parameters()
        assert drawn[name].std().item() == pytest.approx(module.weight.std().item(), rel=0.1)
    for name, fan_in in (("0.bias", 24 * 9), ("2.bias", 20)):  # U(+-1 / sqrt(fan_in))
        bound = fan_in**-0.5
        assert 0.5 * bound / 3**0.5 < drawn[name].std().item() <= drawn[name].abs().max() <= bound
    assert torch.equal(drawn["1.weight"][3], torch.zeros(16))
