"""gb.init and gb.apply: shapes, determinism, agreement with an unstacked reference, init scale."""

import math

import pytest
import torch
from naive import naive_apply
from torch import nn
from torch.func import functional_call
from torch.testing._internal.two_tensor import TwoTensor

import gbfunc as gb
from gbfunc._spec import reference, stack_terms
from gbfunc.cpu import _relu_rows


def models() -> dict[str, tuple[nn.Module, dict]]:
    return {
        "mlp": (nn.Sequential(nn.Linear(20, 13), nn.ReLU(), nn.Linear(13, 7)), {"tile": (4, 6)}),
        "cnn": (nn.Sequential(nn.Conv2d(3, 10, 3), nn.Conv1d(5, 7, 2)), {"tile": (4, 3)}),
        "cnn-deep-shared": (
            nn.Sequential(nn.Conv2d(3, 10, 3), nn.Conv3d(2, 3, (1, 2, 2))),
            {
                "tile": (4, 3),
                "window_in": "output",
                "share": True,
                "depth": 3,
                "activation": "gelu",
            },
        ),
        "attention": (
            nn.MultiheadAttention(12, 3),
            {"tile": (5, 5), "outputs": 2, "encoding": "gray"},
        ),
        "fourier-shared": (
            nn.Linear(20, 30),
            {"tile": (8, 8), "encoding": "fourier", "share": True},
        ),
        "transformer": (
            nn.TransformerEncoderLayer(16, 2, 24, dropout=0.0),
            {"tile": (8, 8), "activation": "silu"},
        ),
        "tanh-deep": (nn.Linear(9, 11), {"tile": (4, 4), "depth": 2, "activation": "tanh"}),
        "cnn-fourier": (nn.Sequential(nn.Conv2d(3, 5, 3)), {"tile": (4, 2), "encoding": "fourier"}),
        "cnn-hashed": (
            nn.Sequential(nn.Conv2d(3, 10, 3), nn.Linear(9, 11)),
            {"tile": (4, 3), "hashed": 7, "share": True, "biases": True},
        ),
        "hashed-outputs": (nn.Linear(12, 10), {"tile": (4, 4), "hashed": 9, "outputs": 2}),
        "cnn-gray": (
            nn.Sequential(nn.Conv2d(3, 6, 3), nn.Conv1d(3, 4, 2)),
            {"tile": (4, 3), "encoding": "gray", "outputs": 2},
        ),
        "cnn-centred": (  # a row's mean is over its inputs and its kernel's taps
            nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)),
            {"tile": (4, 4), "center": True},
        ),
        "paper-labels": (
            nn.Sequential(nn.Flatten(), nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 5)),
            {
                "tile": "full",
                "encoding": "gray",
                "biases": True,
                "center": True,
                "overrides": {"1.weight": {"col_labels": (3, 4)}, "3.*": {"row_labels": "onehot"}},
            },
        ),
    }


@pytest.mark.parametrize("name", list(models()))
def test_apply_equals_the_unstacked_per_tile_reference(name):
    model, kwargs = models()[name]
    plan = gb.plan(model, **kwargs)
    gparams = gb.init(plan, dtype=torch.float64)
    for leaves in gparams["stacks"].values():
        if "tile_hash" in leaves:  # the g-nets start at zero output beside a table: wake them
            leaves["w_out"].data.normal_(generator=torch.Generator().manual_seed(0))
    fast, slow = gb.apply(gparams, plan), naive_apply(gparams, plan)
    assert list(fast) == [n for n, _ in model.named_parameters()]
    for key in fast:
        assert fast[key].shape == dict(model.named_parameters())[key].shape
        torch.testing.assert_close(fast[key], slow[key], rtol=1e-12, atol=1e-12, msg=key)


def test_same_seed_same_tensors_bitwise():
    model, kwargs = models()["cnn-deep-shared"]
    plan = gb.plan(model, **kwargs)
    a, b, c = gb.init(plan, seed=3), gb.init(plan, seed=3), gb.init(plan, seed=4)
    leaves_a, leaves_b, leaves_c = (torch.utils._pytree.tree_leaves(x) for x in (a, b, c))
    assert all(torch.equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(leaves_a, leaves_c, strict=True))


def test_functional_call_runs_every_model():
    for name, (model, kwargs) in models().items():
        plan = gb.plan(model, **kwargs)
        params = gb.apply(gb.init(plan), plan)
        if name == "attention":
            x = torch.randn(4, 2, 12)
            out = functional_call(model, params, (x, x, x))[0]
        elif name.startswith("cnn"):
            first = model[0]
            out = functional_call(
                first,
                {k[2:]: v for k, v in params.items() if k.startswith("0.")},
                (torch.randn(2, 3, 8, 8),),
            )
        else:
            x = (
                torch.randn(3, 5, model.self_attn.embed_dim)
                if name == "transformer"
                else torch.randn(
                    3, {"tanh-deep": 9, "paper-labels": 12, "hashed-outputs": 12}.get(name, 20)
                )
            )
            out = functional_call(model, params, (x,))
        assert torch.isfinite(out).all(), name


def test_apply_is_pure_and_leaves_the_module_alone():
    model = nn.Linear(16, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = gb.plan(model, tile=(4, 4))
    gb.apply(gb.init(plan), plan)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def target_stds(model: nn.Module, plan: gb.Plan, draws: int = 4) -> dict[str, float]:
    """Std of every generated parameter under the module's own init, averaged over re-inits."""
    stds = {p.name: 0.0 for p in plan.generated}
    for seed in range(draws):
        torch.manual_seed(seed)
        for m in model.modules():
            reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if reset is not None:
                reset()
        named = dict(model.named_parameters())
        for k in stds:
            stds[k] += named[k].std().item() / draws
    return stds


@pytest.mark.parametrize(
    ("model", "kwargs"),
    [
        (nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 10)), {"tile": (64, 64)}),
        (nn.Sequential(nn.Conv2d(8, 32, 3), nn.Conv1d(16, 24, 5)), {"tile": (8, 8)}),
        (nn.TransformerEncoderLayer(64, 4, 128), {"tile": (32, 32)}),
        (nn.Embedding(200, 32), {"tile": (32, 32), "embeddings": True}),
        (nn.Linear(256, 256), {"tile": (32, 32), "share": True}),
        (nn.Linear(256, 256), {"tile": (64, 64), "outputs": 8, "depth": 2}),
        (nn.Sequential(nn.Conv2d(8, 32, 3), nn.Linear(300, 64)), {"tile": (32, 32), "hashed": 90}),
        # One evaluation position per tile: zero codes (these started at exactly zero).
        (nn.Linear(40, 30), {"tile": (1, 1)}),
        (nn.Linear(40, 30), {"tile": (1, 8), "outputs": 8}),
        (nn.Linear(40, 30), {"tile": (1, 1), "share": True}),
    ],
)
def test_generated_weights_start_at_the_pnet_init_std(model, kwargs):
    plan = gb.plan(model, **kwargs)
    params = gb.apply(gb.init(plan), plan)
    for name, target in target_stds(model, plan).items():
        got = params[name].std().item()
        assert got == pytest.approx(target, rel=0.10), (name, got, target)
        assert abs(params[name].mean().item()) < 0.1 * target, name


def test_step_zero_loss_matches_the_dense_classifier():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data[:512], dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target[:512])
    dense_losses, gb_losses = [], []
    for seed in range(3):
        torch.manual_seed(seed)
        model = nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
        plan = gb.plan(model, tile=(32, 32))
        dense_losses.append(nn.functional.cross_entropy(model(x), y).item())
        params = gb.apply(gb.init(plan, seed=seed), plan)
        gb_losses.append(
            nn.functional.cross_entropy(functional_call(model, params, (x,)), y).item()
        )
    dense, ours = sum(dense_losses) / 3, sum(gb_losses) / 3
    assert ours == pytest.approx(dense, rel=0.05)
    assert dense == pytest.approx(math.log(10), rel=0.05)


def test_autograd_keeps_about_4_bytes_per_generated_weight():
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )
    plan = gb.plan(model, tile=(64, 64))
    gparams = gb.init(plan)
    saved = gb.memory.saved_bytes(lambda: gb.apply(gparams, plan))
    per_weight = saved / gb.report(plan).generated_weights
    # The README says "about 4 bytes" (measured 4.3: one float per weight plus the codes).
    assert per_weight <= 4.5, per_weight
    # The plain-autograd path (what torchGB's per-tile MLPs amount to) saves ~H*4 B per weight.
    stacks = plan.stacks
    plain = gb.memory.saved_bytes(
        lambda: [
            reference(stack_terms(s, gparams["stacks"][s.key]), s.genome.activation) for s in stacks
        ]
    )
    assert plain / gb.report(plan).generated_weights > 100


def test_saved_bytes_wants_the_computation_not_its_result():
    x = torch.randn(10, requires_grad=True)
    with pytest.raises(
        TypeError, match=r"^gb\.memory\.saved_bytes: fn must be a callable .* got Tensor"
    ):
        gb.memory.saved_bytes(x.exp())


def test_saved_bytes_counts_a_wrapper_subclass_by_its_inner_tensors():
    """A wrapper subclass (as DTensor) answers `untyped_storage()` with a storage whose data
    pointer raises; its inner tensors hold the bytes."""
    two = TwoTensor(torch.randn(1000), torch.randn(1000)).requires_grad_()
    assert gb.memory.saved_bytes(lambda: two.exp()) == 2 * 1000 * 4  # exp saves its output


def test_saved_bytes_counts_a_storage_once_and_a_meta_tensor_as_nothing():
    x = torch.randn(1000, requires_grad=True)
    assert gb.memory.saved_bytes(lambda: (x[:500].sin(), x[500:].sin())) == 4000  # one storage
    on_meta = torch.randn(1000, device="meta", requires_grad=True)
    assert gb.memory.saved_bytes(lambda: on_meta.exp()) == 0


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_saved_bytes_counts_sparse_and_nested_tensors_by_their_buffers():
    # Their `untyped_storage()` raised (NotImplementedError, "invalid python storage").
    sparse = torch.randn(8, 8).to_sparse().requires_grad_()
    dense = torch.randn(8, 3, requires_grad=True)
    values, indices = sparse._values(), sparse._indices()
    want = values.numel() * 4 + indices.numel() * 8 + dense.numel() * 4
    assert gb.memory.saved_bytes(lambda: torch.sparse.mm(sparse, dense)) == want
    parts = [torch.randn(2, 3), torch.randn(4, 3)]
    nested = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
    assert gb.memory.saved_bytes(lambda: nested.sin()) == 6 * 3 * 4 + 3 * 8  # values, offsets
    # A compressed layout (CSR) counted as dense: its indices' and values' storage instead.
    csr = torch.eye(50).to_sparse_csr()
    parts = (csr.crow_indices(), csr.col_indices(), csr.values())
    want = sum(t.untyped_storage().nbytes() for t in parts)
    assert (
        gb.memory.saved_bytes(lambda: _Keeps.apply(torch.ones(1, requires_grad=True), csr)) == want
    )
    assert want < csr.shape[0] * csr.shape[1] * 4


class _Keeps(torch.autograd.Function):
    """Saves its second input for backward, as is."""

    @staticmethod
    def forward(ctx, x, kept):
        ctx.save_for_backward(kept)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_weights_left_free_start_with_their_modules_own_init():
    model = nn.ModuleDict(
        {
            "fc": nn.Linear(300, 50),
            "conv": nn.Conv2d(16, 8, 3),
            "attn": nn.MultiheadAttention(64, 4),
            "generated": nn.Linear(32, 32),
        }
    )
    plan = gb.plan(model, tile=(16, 16), free=["fc.weight", "conv.weight", "attn.*"])
    free = gb.init(plan, seed=0)["free"]
    own = dict(model.named_parameters())
    for name in ("fc.weight", "conv.weight", "attn.in_proj_weight", "attn.out_proj.weight"):
        assert free[name].std().item() == pytest.approx(own[name].std().item(), rel=0.1), name
    assert not free["attn.out_proj.bias"].any()


def test_hashed_tables_start_as_hashednets_and_share_their_values():
    """A hashed genome starts with zero g-net output: each weight is +-one of its tile's values."""
    model = nn.Linear(40, 24)
    plan = gb.plan(model, tile=(8, 8), hashed=6)
    gparams = gb.init(plan)
    leaves = gparams["stacks"][plan.stacks[0].key]
    assert not leaves["w_out"].any()
    assert not leaves["b_out"].any()
    weight = gb.apply(gparams, plan)["weight"] / plan.params[0].scale
    tile = weight[:8, :8].abs()
    table = (leaves["tile_hash"][0] * 10).abs()  # stored divided by its gain
    assert len(torch.unique(tile)) == 6
    torch.testing.assert_close(torch.unique(tile), torch.unique(table))
    # The plan counts the tables: 15 tiles of 6 values beside the g-nets.
    stack = plan.stacks[0]
    assert gb.report(plan).stored_params == stack.num_params + 24
    assert stack.num_params == 15 * (
        stack.genome.param_count(stack.row_width + stack.col_width, 1) + 6
    )


class _TwoHeadedLinear(nn.Linear):
    """A weight holding two matrices side by side (`(out, 2 * half)`), like GPT-2's fused
    `c_attn` but with blocks that are not square."""


def test_a_rule_splitting_columns_into_non_square_blocks_matches_the_reference():
    gb.register_rule(
        _TwoHeadedLinear, lambda m: {"weight": gb.Layout(init_std=0.1, splits=2, split_dim=1)}
    )
    model = nn.Sequential(_TwoHeadedLinear(16, 6))
    plan = gb.plan(model, tile=(4, 4))
    assert [(b.rows, b.cols) for b in plan.generated[0].blocks] == [(6, 8), (6, 8)]
    gparams = gb.init(plan, dtype=torch.float64)
    got = gb.apply(gparams, plan)["0.weight"]
    torch.testing.assert_close(got, naive_apply(gparams, plan)["0.weight"])


@pytest.mark.parametrize("share", [False, True])
def test_units_major_column_terms_are_the_column_terms_laid_out_units_first(share):
    """What compiled one-output forwards read instead of `b`: the same values, `(T, H, Q)`,
    contiguous (a matmul's own layout, not a strided view), shared g-nets repeated per tile."""
    from gbfunc._spec import stack_terms
    from gbfunc.generate._traced_forms import units_major_columns

    plan = gb.plan(nn.Linear(20, 13), tile=(4, 6), share=share, hidden=5)
    gparams = gb.init(plan, seed=2)
    (stack,) = plan.stacks
    leaves = gparams["stacks"][stack.key]
    b_t = units_major_columns(stack, leaves)
    want = stack_terms(stack, leaves).b.transpose(1, 2)
    assert b_t.shape == want.shape == (stack.num_tiles, 5, stack.columns)
    assert b_t.is_contiguous()
    torch.testing.assert_close(b_t, want)


def test_units_major_column_terms_go_only_to_compiled_one_output_forwards_of_wide_tiles():
    """Compiled one-output forwards read `b_t` where a tile's columns fill a vector register;
    narrower (inductor forks threads inside a serial loop there), deeper or multi-output
    g-nets, and uncompiled eager code, get none."""
    from gbfunc.generate._traced_forms import (
        _reads_units_major,
        _vector_lanes,
        reads_units_major_columns,
    )

    lanes = _vector_lanes(torch.float32, "cpu")
    assert reads_units_major_columns(lanes, torch.float32, torch.device("cpu"))
    assert not reads_units_major_columns(lanes - 1, torch.float32, torch.device("cpu"))
    assert reads_units_major_columns(1, torch.float32, torch.device("meta"))  # no vector ISA
    model = nn.Linear(2 * lanes, 2 * lanes)
    wide, narrow, deep, outputs = (
        gb.plan(model, tile=tile, **kwargs)
        for tile, kwargs in [
            ((lanes, lanes), {}),
            ((lanes, lanes - 1), {}),
            ((lanes, lanes), {"depth": 2}),
            ((lanes, 2 * lanes), {"outputs": 2}),
        ]
    )

    def reads(plan, compiled):
        (stack,) = plan.stacks
        w_in = gb.init(plan)["stacks"][stack.key]["w_in"]
        return _reads_units_major(stack, w_in, compiled)

    assert reads(wide, True)
    assert not reads(wide, False)
    assert not any(reads(plan, True) for plan in (narrow, deep, outputs))


def test_traced_one_output_forwards_of_wide_tiles_read_the_units_major_column_terms(
    monkeypatch,
):
    """What `torch.compile` traces: `evaluate_stack` hands `units_major_columns` to the tile
    MLP, whose forward sums from them (`_one_output_by_columns`, or for ReLU on CPU the C loop
    `relu_one_output`); the weights are unchanged."""
    from gbfunc.cpu import _relu_loops
    from gbfunc.generate import _traced_forms
    from gbfunc.generate._traced_forms import tile_form, units_major_columns
    from gbfunc.generate.torch_ops import evaluate_stack

    lanes = _traced_forms._vector_lanes(torch.float32, "cpu")
    plan = gb.plan(nn.Linear(2 * lanes, 3 * lanes), tile=(lanes, lanes), hidden=5)
    (stack,) = plan.stacks
    leaves = gb.init(plan, seed=4)["stacks"][stack.key]
    want = evaluate_stack(stack, leaves)
    read = []

    def spy(forward):
        def reading(row_terms, b_t, *args):
            read.append(b_t)
            return forward(row_terms, b_t, *args)

        return reading

    forward = _traced_forms._one_output_by_columns
    monkeypatch.setattr(_traced_forms, "_one_output_by_columns", spy(forward))
    monkeypatch.setattr(_relu_loops, "relu_one_output", spy(_relu_loops.relu_one_output))
    form = tile_form(stack, leaves["w_in"], traced=True, exporting=False)
    assert form in _traced_forms.ONE_OUTPUT_UNITS_MAJOR
    got = evaluate_stack(stack, leaves, form=form)
    assert len(read) == 1
    torch.testing.assert_close(read[0], units_major_columns(stack, leaves))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("outputs", "hidden", "depth", "per_weight"),
    [(1, 32, 1, True), (4, 8, 1, True), (1, 4, 2, True), (1, 4, 1, False), (8, 8, 1, False)],
)
def test_traced_tile_mlps_return_each_weights_tiles_apart_and_take_their_gradients_apart(
    monkeypatch, loops_off, outputs, hidden, depth, per_weight
):
    """Traced, a stack's tile MLP returns its weights' tiles as separate outputs and its
    backward runs once per weight, on that weight's gradient: the stack's gradient is never
    concatenated (inductor would allocate it at the first weight's gradient, where a step's
    backward peaks). One-output g-nets whose units are reduced one at a time (4 units here,
    fewer than half a vector register) run it once, on the gradients concatenated once all
    exist. Row g-nets (8 outputs: one evaluation per tile row) split the MLP's output instead
    and run it once on the whole stack's gradient. Op by op it runs once. The weights and the
    gradients are the same either way. (Traced ReLU row g-nets on CPU take the C loops of
    `gbfunc.cpu._relu_rows` instead, switched off here; `tests/test_relu_rows.py` covers them.)"""
    from gbfunc.generate import torch_ops

    model = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 16))
    plan = gb.plan(model, tile=(8, 8), outputs=outputs, hidden=hidden, depth=depth)
    assert len(plan.stacks) == 1
    sizes = [p.numel // 64 for p in plan.generated]  # tiles of each weight
    assert sizes == [6, 4]
    backward_tiles = []
    backward = torch_ops.backward_recompute

    def spy(*args):  # (grad, terms, activation, form)
        backward_tiles.append(args[0].shape[0])
        return backward(*args)

    monkeypatch.setattr(torch_ops, "backward_recompute", spy)
    generator = torch.Generator().manual_seed(2)
    cotangents = {p.name: torch.randn(p.shape, generator=generator) for p in plan.generated}

    def pullback(traced):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: traced)
        backward_tiles.clear()
        gparams = gb.init(plan, seed=1)
        params = gb.apply(gparams, plan, compile=False)
        sum((params[n] * g).sum() for n, g in cotangents.items()).backward()
        leaves = torch.utils._pytree.tree_leaves(gparams["stacks"])
        return params, [leaf.grad for leaf in leaves], list(backward_tiles)

    want, want_grads, eager_calls = pullback(traced=False)
    got, got_grads, traced_calls = pullback(traced=True)
    assert eager_calls == [10]
    assert traced_calls == (sizes if per_weight else [10])
    for name in want:
        torch.testing.assert_close(got[name], want[name])
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.slow
def test_compiled_gradients_through_per_weight_tile_mlp_outputs_match_eager_ones():
    """`torch.compile` (AOTAutograd, no inductor) of a loss through `gb.apply` of a stack that
    generates two weights, hashed and shared genomes included: the same gradients as eager."""
    from torch.func import functional_call, grad

    model = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 16))
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(3))
    for kwargs in ({}, {"outputs": 4, "hidden": 8}, {"hashed": 7}, {"share": True}):
        plan = gb.plan(model, tile=(8, 8), **kwargs)

        def loss(gparams, plan=plan):
            return functional_call(model, gb.apply(gparams, plan), (x,)).square().sum()

        gparams = gb.init(plan, seed=1, requires_grad=False)
        want = grad(loss)(gparams)
        got = torch.compile(grad(loss), backend="aot_eager", fullgraph=True)(gparams)
        for g, w in zip(*map(torch.utils._pytree.tree_leaves, (got, want)), strict=True):
            torch.testing.assert_close(g, w)


# Shapes no other test uses, so that the code tables are first made here.
_MODE_PLANS = {
    "relu one output": (nn.Linear(13, 11), {"tile": (7, 5), "hidden": 4}),
    "tanh two outputs": (
        nn.Linear(13, 9),
        {"tile": (5, 7), "hidden": 4, "outputs": 2, "activation": "tanh"},
    ),
    "hashed": (nn.Linear(11, 13), {"tile": (7, 5), "hidden": 4, "hashed": 3}),
}


@pytest.mark.parametrize("name", list(_MODE_PLANS))
def test_a_first_call_under_inference_mode_leaves_training_working(name):
    # The code tables and hash signs made there were cached as inference tensors, which a
    # later training step's backward could not save.
    model, options = _MODE_PLANS[name]
    plan = gb.plan(model, **options)
    gparams = gb.init(plan, seed=0)
    with torch.inference_mode():
        evaluated = gb.apply(gparams, plan, compile=False)["weight"]
    loops = gb.explain(gparams, plan, compile=True).route.stacks == ("cpu-loops",)
    for compile in (False, True) if loops else (False,):  # torch, and the C loops where built
        weight = gb.apply(gparams, plan, compile=compile)["weight"]
        (gradient,) = torch.autograd.grad(
            weight.square().sum(), gparams["stacks"][plan.stacks[0].key]["w_out"]
        )
        assert bool(gradient.abs().sum() > 0)
        torch.testing.assert_close(weight.detach(), evaluated)


def test_under_a_fake_tensor_mode_every_path_stays_in_torch_and_keeps_nothing_fake():
    # The C loops read a FakeTensor's data pointer (a segfault), and the code tables made
    # under the mode were cached: the next real call mixed them with real tensors.
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = nn.Linear(11, 9)
    plan = gb.plan(model, tile=(5, 3), hidden=4)
    gparams = gb.init(plan, seed=0)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(gparams["stacks"][plan.stacks[0].key]["w_out"])
        assert gb.explain(gparams, plan, compile=True).route.stacks == ("torch",)
        weight = gb.apply(gparams, plan, compile=True)["weight"]
        assert type(weight) is type(fake)
        assert weight.shape == (9, 11)
    real = gb.apply(gparams, plan, compile=False)["weight"]
    torch.testing.assert_close(real, naive_apply(gparams, plan)["weight"].float())


def test_batched_gradients_through_the_compiled_mlp_are_taken_op_by_op():
    """Its backward handed autograd's storage-less batched gradients to dynamo, which raised
    "meta converter nyi" (the graph and the loops already went op by op)."""
    plan = gb.plan(nn.Linear(256, 256), tile=(64, 64), hidden=40, depth=2)
    gparams = gb.init(plan, seed=0)
    assert gb.explain(gparams, plan, compile=True).route.stacks == ("compiled-mlp",)
    w_out = gparams["stacks"][plan.stacks[0].key]["w_out"]
    rows = torch.randn(3, 256, 256, generator=torch.Generator().manual_seed(0))
    got, want = (
        torch.autograd.grad(weight, w_out, rows, is_grads_batched=True)[0]
        for weight in (gb.apply(gparams, plan, compile=c)["weight"] for c in (True, False))
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_switching_the_loops_off_reaches_a_graph_compiled_with_them(monkeypatch):
    """The graph's cache ignored the loops' mode: a graph traced with them kept calling
    them after GBFUNC_CPU_LOOPS=off, while gb.explain named the graph alone."""
    model = nn.ModuleDict({"a": nn.Linear(7, 6), "b": nn.Linear(5, 9)})
    plan = gb.plan(model, tile=(3, 4), hidden=5, overrides={"a.weight": {"outputs": 4},
                   "b.weight": {"activation": "tanh", "depth": 2}})  # fmt: skip
    gparams = gb.init(plan, seed=0)
    if gb.explain(gparams, plan, compile=True).route.stacks != ("cpu-loops", "graph"):
        pytest.skip("the CPU loops are not built here")
    runs = []
    forward = _relu_rows._forward
    monkeypatch.setattr(_relu_rows, "_forward", lambda *a: runs.append(1) or forward(*a))
    want = gb.apply(gparams, plan, compile=False)
    for name, weight in gb.apply(gparams, plan, compile=True).items():
        torch.testing.assert_close(weight, want[name])
    assert runs
    monkeypatch.setenv("GBFUNC_CPU_LOOPS", "off")
    runs.clear()
    assert gb.explain(gparams, plan, compile=True).route.stacks == ("graph", "graph")
    for name, weight in gb.apply(gparams, plan, compile=True).items():
        torch.testing.assert_close(weight, want[name])
    assert not runs


@pytest.mark.parametrize(
    "options",
    [{"hidden": 4}, {"hidden": 4, "outputs": 4}, {"hidden": 4, "hashed": 3}],
    ids=["one output", "rows", "hashed"],
)
@pytest.mark.parametrize("compile", [False, True], ids=["torch", "cpu-loops"])
def test_batched_gradients_give_the_jacobian_row_by_row(options, compile):
    # The torch path multiplied a batched gradient into an unbatched tensor in place (vmap
    # refuses); the loops' backward read batched gradients' missing storage, and their ops
    # cannot run under autograd's legacy vmap (`is_grads_batched=True`).
    plan = gb.plan(nn.Linear(7, 5), tile=(4, 4), **options)
    gparams = gb.init(plan, seed=0)
    path = gb.explain(gparams, plan, compile=compile).route.stacks
    if compile and path != ("cpu-loops",):
        pytest.skip(f"the CPU loops are not built here ({path})")
    leaves = gparams["stacks"][plan.stacks[0].key]

    def generated(w_out):
        stacks = {plan.stacks[0].key: dict(leaves, w_out=w_out)}
        return gb.apply(dict(gparams, stacks=stacks), plan, compile=False)["weight"]

    for name in ("w_out", "tile_hash") if "hashed" in options else ("w_out",):
        weight = gb.apply(gparams, plan, compile=compile)["weight"]
        rows = torch.eye(weight.numel()).reshape(-1, *weight.shape)
        (jacobian,) = torch.autograd.grad(
            weight, leaves[name], rows, retain_graph=True, is_grads_batched=True
        )
        by_row = torch.stack(
            [torch.autograd.grad(weight, leaves[name], r, retain_graph=True)[0] for r in rows]
        )
        torch.testing.assert_close(jacobian, by_row)
        if name == "w_out" and not compile:  # jacrev: vmap over the torch path's backward
            jacobian = torch.func.jacrev(generated)(leaves["w_out"].detach())
            torch.testing.assert_close(jacobian.reshape(by_row.shape), by_row)


def test_weights_come_in_the_gnets_dtype_under_autocast_on_every_path():
    """The torch path's matmuls ran in bfloat16 under `torch.autocast` (8% of a weight's std
    off), the loops in float32: the same gparams gave other weights by path. Autocast still
    applies to the p-net's ops, outside; the backward, run after autocast as PyTorch advises
    (on CPU it would autocast built-in backward ops too), is the float32 one."""
    model = nn.Sequential(nn.Linear(12, 10), nn.ReLU(), nn.Linear(10, 3))
    plan = gb.plan(model, tile=(4, 4), hidden=4, outputs=4)
    gparams = gb.init(plan, seed=0)
    want = gb.apply(gparams, plan, compile=False)
    leaf = gparams["stacks"][plan.stacks[0].key]["w_in"]
    (want_grad,) = torch.autograd.grad(want["0.weight"].square().sum(), leaf)
    x = torch.randn(5, 12)
    for compile in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = gb.apply(gparams, plan, compile=compile)
            assert functional_call(model, got, (x,)).dtype == torch.bfloat16
        for name, weight in want.items():
            torch.testing.assert_close(got[name], weight, rtol=1e-5, atol=1e-6)
        (grad,) = torch.autograd.grad(got["0.weight"].square().sum(), leaf)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)


def test_generation_under_a_meta_default_device_runs_where_the_gnets_are():
    """Under `with torch.device("meta")` (FSDP2's way to build a model), the loops' placement
    tables and the code tables, made on first use, came out on meta: the C loop then wrote
    through their null pointers (a segfault), or copying them failed."""
    from gbfunc import _spec

    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))
    plan = gb.plan(model, tile=(16, 16))
    gparams = gb.init(plan, seed=0)
    for compile in (True, False):
        want = gb.apply(gparams, plan, compile=compile)
        _spec._MADE.clear()
        _relu_rows.placement_tables.cache_clear()
        with torch.device("meta"):
            got = gb.apply(gparams, plan, compile=compile)
        for name, weight in want.items():
            assert got[name].device.type == "cpu"
            torch.testing.assert_close(got[name], weight, rtol=0, atol=0)
