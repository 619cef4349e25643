"""gb.Bottleneck: the g-nets as an nn.Module whose parameters, buffers and state_dict are the
compressed model's, while forward runs the p-net on generated weights."""

import copy
import inspect
import pickle

import hypothesis.strategies as st
import pytest
import safetensors.torch
import torch
from hypothesis import given
from torch import nn
from torch.func import functional_call

import gbfunc as gb
from gbfunc._module import escape, unescape


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.LayerNorm(24), nn.ReLU(), nn.Linear(24, 3))


def bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 2))


def frozen_net() -> nn.Sequential:
    model = mlp()
    model[1].weight.requires_grad_(False)  # a frozen LayerNorm scale
    return model


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---------------------------------------------------------------- names and parameters


@given(st.text())
def test_escape_is_reversible_and_leaves_no_dots(name):
    key = escape(name)
    assert "." not in key
    assert unescape(key) == name


def test_escape_of_names_that_look_escaped():
    assert escape("a.b%2Ec") == "a%2Eb%252Ec"
    assert unescape(escape("%2E.%25")) == "%2E.%25"


def test_top_level_names_a_dict_already_uses_are_escaped_too():
    """A key-value memory's `keys` and `values` (free) and a frozen `get`: the parameter
    dicts already have those attributes, and registering them raised."""

    class Memory(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.keys = nn.Parameter(torch.randn(4, 8))
            self.values = nn.Parameter(torch.randn(4, 8))
            self.get = nn.Parameter(torch.ones(8), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.proj(x) @ self.keys.T).softmax(-1) @ self.values * self.get

    for name in ("keys", "values", "get"):
        assert escape(name) != name
        assert unescape(escape(name)) == name
    torch.manual_seed(0)
    model = Memory()
    net = gb.Bottleneck(model, tile=(4, 4))
    x = torch.randn(2, 8)
    expected = functional_call(model, gb.apply(net.gparams, net.plan), (x,))
    torch.testing.assert_close(net(x), expected)
    again = gb.Bottleneck(Memory(), tile=(4, 4))
    again.load_state_dict(net.state_dict())
    torch.testing.assert_close(again(x), net(x))


def test_parameters_are_the_stacks_and_free_leaves_under_escaped_names():
    model = mlp()
    b = gb.Bottleneck(model, tile=(8, 8))
    plan = b.plan
    want = [f"stacks.{s.key}.{leaf}" for s in plan.stacks for leaf in s.leaf_shapes()]
    want += [f"free.{p.name.replace('.', '%2E')}" for p in plan.free]
    assert [n for n, _ in b.named_parameters()] == want  # plan order, as gparams
    dense = {n for n, _ in model.named_parameters()}
    assert not dense & {n.split(".", 1)[1] for n in want}
    # The functional view holds the very same tensors, in gb.trainable_leaves order.
    assert all(a is p for a, p in zip(gb.trainable_leaves(b.gparams), b.parameters(), strict=True))
    shapes = [t.shape for t in gb.trainable_leaves(gb.init(plan, seed=0))]
    assert [p.shape for p in b.parameters()] == shapes


def assert_stacks_equal(b: gb.Bottleneck, gparams: dict) -> None:
    """The module's g-nets are bitwise those of `gparams`."""
    for key, leaves in b.gparams["stacks"].items():
        for name, t in leaves.items():
            torch.testing.assert_close(t.detach(), gparams["stacks"][key][name], rtol=0, atol=0)


def test_stacks_are_those_of_gb_init_with_the_seed():
    b = gb.Bottleneck(mlp(), tile=(8, 8), seed=3)
    assert_stacks_equal(b, gb.init(b.plan, seed=3))


def test_forward_is_functional_call_on_generated_weights():
    model = mlp()
    b = gb.Bottleneck(model, tile=(8, 8))
    x = torch.randn(5, 12)
    want = functional_call(model, gb.apply(b.gparams, b.plan), (x,))
    torch.testing.assert_close(b(x), want, rtol=0, atol=0)
    b(x).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in b.parameters())
    assert all(p.grad is None for p in model.parameters())  # the dense weights are never used


def test_a_given_plan_is_used_and_plan_options_are_passed_to_gb_plan():
    model = mlp()
    plan = gb.plan(model, tile=(4, 8), hidden=8)
    assert gb.Bottleneck(model, plan).plan is plan
    assert gb.Bottleneck(model, tile=(4, 8), hidden=8).plan == plan


def test_trainable_leaves_are_stacks_then_free_and_not_the_frozen():
    plan = gb.plan(frozen_net(), tile=(8, 8))
    gparams = gb.init(plan, seed=0)
    leaves = gb.trainable_leaves(gparams)
    stacks = [t for s in gparams["stacks"].values() for t in s.values()]
    assert all(a is b for a, b in zip(leaves, [*stacks, *gparams["free"].values()], strict=True))
    assert not any(t is f for t in leaves for f in gparams["frozen"].values())
    functional = gb.init(plan, seed=0, requires_grad=False)
    assert len(gb.trainable_leaves(functional)) == len(leaves)  # what is trained, not how


def test_trainable_leaves_rejects_other_trees():
    with pytest.raises(TypeError, match=r"gb.trainable_leaves: gparams must be the dict"):
        gb.trainable_leaves([torch.zeros(2)])
    gparams = gb.init(gb.plan(nn.Linear(8, 8), tile=(4, 4)))
    wanted = r"gb.trainable_leaves: gparams\['stacks'\] must be a dict of dicts and "
    for bad, got in (
        (dict(gparams, stacks=[1]), "list and dict"),
        (dict(gparams, free=[1]), "dict and list"),
    ):
        with pytest.raises(TypeError, match=wanted + f".*got {got}"):  # AttributeError
            gb.trainable_leaves(bad)


# ---------------------------------------------------------------- frozen parameters and buffers


def test_frozen_parameters_are_buffers_moved_and_stored_but_not_trained():
    b = gb.Bottleneck(frozen_net(), tile=(8, 8))
    assert list(b.gparams["frozen"]) == ["1.weight"]
    assert "frozen.1%2Eweight" in b.state_dict()
    assert not any("frozen" in n for n, _ in b.named_parameters())
    assert b.gparams["frozen"]["1.weight"] is b.frozen.get("1.weight")
    b.double()
    assert b.gparams["frozen"]["1.weight"].dtype == torch.float64
    assert b(torch.randn(2, 12, dtype=torch.float64)).dtype == torch.float64


def test_batchnorm_statistics_update_in_the_pnet_in_train_mode_only():
    model = bn_net()
    b = gb.Bottleneck(model, tile=(8, 8))
    bn = model[1]
    assert b.pnet_buffers.get("1.running_mean") is bn.running_mean  # shared, not copied
    x = torch.randn(32, 6) + 3.0
    b(x)
    assert bn.num_batches_tracked.item() == 1
    assert bn.running_mean.abs().sum() > 0
    moved = bn.running_mean.clone()
    b.eval()
    assert not model.training
    assert not bn.training
    with torch.no_grad():
        out = b(x)
    torch.testing.assert_close(bn.running_mean, moved, rtol=0, atol=0)
    assert bn.num_batches_tracked.item() == 1
    # eval runs on the running statistics, deterministically (no dropout).
    torch.testing.assert_close(b(x), out, rtol=0, atol=0)
    b.train()
    assert model.training
    assert bn.training


def test_update_bn_recomputes_the_statistics_under_the_generated_weights():
    """`torch.optim.swa_utils.update_bn` given the module finds no BatchNorm (module walks do
    not reach the p-net) and changed nothing without a word; `b.update_bn` computes what it
    computes for the dense model the g-nets generate, into the module's shared buffers."""
    from torch.optim.swa_utils import AveragedModel, update_bn

    torch.manual_seed(0)
    b = gb.Bottleneck(bn_net(), tile=(8, 8))
    for _ in range(5):  # training moves the statistics: update_bn starts them again
        b(torch.randn(16, 6) * 3 - 2)
    loader = [(torch.randn(16, 6) * 2 + 1, torch.zeros(16)) for _ in range(3)]
    before = b.pnet[1].running_mean.clone()
    update_bn(loader, b)
    assert torch.equal(b.pnet[1].running_mean, before)  # why the method exists
    dense = copy.deepcopy(b.pnet)
    dense.load_state_dict(b.export())
    update_bn(loader, dense)
    b.eval()
    b.update_bn(loader)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(b.pnet[1], name), getattr(dense[1], name))
        stored = b.state_dict()[f"pnet_buffers.{escape('1.' + name)}"]
        assert torch.equal(stored, getattr(dense[1], name))
    assert b.pnet[1].momentum == 0.1  # as it was
    assert not b.training
    swa = AveragedModel(b)
    swa.module.update_bn(loader)
    torch.testing.assert_close(swa.module.pnet[1].running_mean, dense[1].running_mean)


def test_to_moves_compressed_tensors_and_pnet_buffers_not_dense_weights():
    model = bn_net()
    b = gb.Bottleneck(model, tile=(8, 8)).double()
    assert all(p.dtype == torch.float64 for p in b.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # dense weights untouched
    assert model[1].running_mean.dtype == torch.float64
    assert model[1].running_mean is b.pnet_buffers.get("1.running_mean")  # still shared
    b(torch.randn(4, 6, dtype=torch.float64))
    assert model[1].num_batches_tracked.item() == 1


def test_state_dict_holds_the_compressed_model_and_pnet_buffers_only():
    """And the plan's fingerprint: 64 bytes."""
    model = bn_net()
    b = gb.Bottleneck(model, tile=(8, 8))
    keys = set(b.state_dict())
    params = {n for n, _ in b.named_parameters()}
    buffers = {f"pnet_buffers.{escape(n)}" for n, _ in model.named_buffers()}
    assert keys == params | buffers | {"_extra_state"}
    assert bytes(b.state_dict()["_extra_state"]).decode() == b.plan.fingerprint()
    stored = sum(b.state_dict()[k].numel() for k in params)
    assert stored == gb.report(b.plan).stored_params


def test_state_dict_round_trip_restores_outputs_and_running_statistics():
    b = gb.Bottleneck(bn_net(), tile=(8, 8))
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    x = torch.randn(16, 6)
    for _ in range(2):
        b(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    saved = state(b)
    fresh_model = bn_net()
    fresh = gb.Bottleneck(fresh_model, tile=(8, 8), seed=1)
    fresh.load_state_dict(saved, strict=True)
    assert fresh_model[1].num_batches_tracked.item() == 2  # reached the p-net
    b.eval()
    fresh.eval()
    torch.testing.assert_close(fresh(x), b(x), rtol=0, atol=0)
    # assign=True replaces the buffers: the p-net follows them.
    fresh.load_state_dict(saved, assign=True)
    assert fresh_model[1].running_var is fresh.pnet_buffers.get("1.running_var")


def test_deepcopy_keeps_buffers_shared_with_its_own_pnet():
    b = gb.Bottleneck(bn_net(), tile=(8, 8))
    c = copy.deepcopy(b)
    assert c.pnet is not b.pnet
    assert c.pnet[1].running_mean is c.pnet_buffers.get("1.running_mean")
    c(torch.randn(4, 6))
    assert b.pnet[1].num_batches_tracked.item() == 0


def test_torch_save_of_the_whole_module_keeps_buffers_shared(tmp_path):
    b = gb.Bottleneck(bn_net(), tile=(8, 8)).eval()  # no dropout
    torch.save(b, tmp_path / "b.pt")
    c = torch.load(tmp_path / "b.pt", weights_only=False)
    assert c.pnet[1].running_mean is c.pnet_buffers.get("1.running_mean")
    assert not c.pnet.training
    x = torch.randn(4, 6)
    torch.testing.assert_close(c(x), b(x), rtol=0, atol=0)
    # Modules pickled before the load_state_dict hook moved name it where it was.
    old = pickle.loads(b"cgbfunc._module\n_check_same_stacks\n.")
    assert old is gb._bottleneck_checks.check_same_stacks


def test_a_pnet_on_the_meta_device_is_never_materialised():
    with torch.device("meta"):
        model = mlp()
    b = gb.Bottleneck(model, tile=(8, 8))
    assert all(not p.is_meta for p in b.parameters())
    x = torch.randn(5, 12)
    want = functional_call(mlp(), gb.apply(b.gparams, b.plan), (x,))
    torch.testing.assert_close(b(x), want, rtol=0, atol=0)
    assert all(p.is_meta for p in model.parameters())


def test_accepts_loss_kwargs_follows_the_pnet():
    class Kw(nn.Linear):
        def forward(self, x, **kwargs):
            return super().forward(x)

    assert gb.Bottleneck(mlp(), tile=(8, 8)).accepts_loss_kwargs is False
    assert gb.Bottleneck(Kw(8, 8), tile=(4, 4)).accepts_loss_kwargs is True


# ---------------------------------------------------------------- export, report, checkpoints


def test_export_is_the_dense_state_dict_of_the_trained_model():
    b = gb.Bottleneck(bn_net(), tile=(8, 8))
    b(torch.randn(8, 6))  # move the running statistics
    dense = b.export()
    fresh = bn_net()
    fresh.load_state_dict(dense, strict=True)
    fresh.eval()
    b.eval()
    x = torch.randn(3, 6)
    torch.testing.assert_close(fresh(x), b(x), rtol=0, atol=0)


def test_report_is_gb_report_of_the_plan():
    b = gb.Bottleneck(mlp(), tile=(8, 8))
    assert b.report() == gb.report(b.plan)
    assert "compression=" in repr(b)


def test_gb_save_and_from_checkpoint_round_trip(tmp_path):
    b = gb.Bottleneck(frozen_net(), tile=(8, 8), seed=0)
    with torch.no_grad():
        for t in gb.trainable_leaves(b.gparams):
            t.add_(0.01)  # not what gb.init would draw
    path = tmp_path / "ckpt.safetensors"
    gb.save(path, b.gparams, b.plan)
    loaded = gb.Bottleneck.from_checkpoint(path, frozen_net())
    assert loaded.plan == b.plan
    for ours, theirs in zip(state(loaded).values(), state(b).values(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    x = torch.randn(4, 12)
    torch.testing.assert_close(loaded(x), b(x), rtol=0, atol=0)


def test_load_gparams_copies_in_place_so_an_optimizer_keeps_its_tensors(tmp_path):
    b = gb.Bottleneck(mlp(), tile=(8, 8), seed=0)
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    before = list(b.parameters())
    path = tmp_path / "ckpt.safetensors"
    gb.save(path, gb.init(b.plan, seed=5), b.plan)
    b.load_gparams(gb.load(path, b.pnet).gparams)
    assert all(p is q for p, q in zip(b.parameters(), before, strict=True))
    assert opt.param_groups[0]["params"][0] is before[0]
    assert_stacks_equal(b, gb.init(b.plan, seed=5))


def test_a_load_that_cannot_finish_changes_nothing(tmp_path):
    """A meta leaf raised after the leaves before it were copied; a plan without g-nets
    raised IndexError after `from_checkpoint` had restored the model's buffers."""
    b = gb.Bottleneck(mlp(), tile=(8, 8), seed=0)
    before = [t.clone() for t in b.parameters()]
    meta = gb.init(b.plan, seed=5)
    last = list(meta["stacks"].values())[-1]
    for name, leaf in last.items():  # the stacks before it were copied, then it raised
        last[name] = torch.empty_like(leaf, device="meta")
    with pytest.raises(ValueError, match=r"load_gparams: .*\['w_in'\] is on the meta device"):
        b.load_gparams(meta)
    assert all(torch.equal(p, q) for p, q in zip(b.parameters(), before, strict=True))

    def model() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    saved = model()
    saved[1].running_mean.fill_(9.0)
    free = [
        gb.Free(n, tuple(p.shape), "float32", ("zeros", 0.0), True, "by hand")
        for n, p in saved.named_parameters()
    ]
    plan = gb.Plan(tuple(free), ()).naming(saved)
    path = tmp_path / "free.safetensors"
    gb.save(path, gb.init(plan), plan)
    fresh = model()
    with pytest.raises(ValueError, match=r"gb.Bottleneck: the plan generates no parameter"):
        gb.Bottleneck.from_checkpoint(path, fresh)
    assert torch.equal(fresh[1].running_mean, torch.zeros(4))  # not restored


def test_load_gparams_refuses_the_gparams_of_another_genome_of_the_same_shapes(tmp_path):
    """A tanh, centred genome has a ReLU one's shapes: its gparams generate other weights."""
    saved = gb.Bottleneck(mlp(), tile=(8, 8), seed=0)
    path = tmp_path / "ckpt.safetensors"
    gb.save(path, saved.gparams, saved.plan)
    ckpt = gb.load(path, saved.pnet)
    other = gb.Bottleneck(mlp(), tile=(8, 8), activation="tanh", center=True)
    before = {k: v.clone() for k, v in state(other).items()}
    with pytest.raises(ValueError, match=r"load_gparams: plan is not this module's plan"):
        other.load_gparams(ckpt.gparams, ckpt.plan)
    assert all(torch.equal(v, before[k]) for k, v in state(other).items())
    again = gb.Bottleneck(mlp(), tile=(8, 8), seed=3)
    again.load_gparams(ckpt.gparams, ckpt.plan)
    assert_stacks_equal(again, saved.gparams)


def test_load_state_dict_refuses_the_state_of_another_genome_of_the_same_shapes(tmp_path):
    """The state carries its plan's fingerprint: a tanh, centred genome's state has a ReLU
    one's shapes and loads whole, strict or not, unless the fingerprints are compared. A
    state without one (saved before it existed) is still taken, by its shapes."""
    saved = gb.Bottleneck(mlp(), tile=(8, 8), seed=0)
    other = gb.Bottleneck(mlp(), tile=(8, 8), activation="tanh", center=True)
    before = {k: v.clone() for k, v in state(other).items()}
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"saved from another plan: its fingerprint"):
            nn.Sequential(other).load_state_dict(nn.Sequential(saved).state_dict(), strict)
    assert all(torch.equal(v, before[k]) for k, v in state(other).items())
    path = tmp_path / "state.safetensors"  # where transformers' Trainer writes it
    safetensors.torch.save_file(saved.state_dict(), path)
    again = gb.Bottleneck(mlp(), tile=(8, 8), seed=3)
    assert not again.load_state_dict(safetensors.torch.load_file(path)).missing_keys
    assert_stacks_equal(again, saved.gparams)
    unmarked = {k: v for k, v in saved.state_dict().items() if k != "_extra_state"}
    other.load_state_dict(unmarked, strict=True)
    assert_stacks_equal(other, saved.gparams)


# ---------------------------------------------------------------- errors


def test_rejects_a_plan_together_with_plan_options():
    model = mlp()
    with pytest.raises(TypeError, match=r"gb.Bottleneck: pass either plan or plan options"):
        gb.Bottleneck(model, gb.plan(model), tile=(8, 8))
    with pytest.raises(TypeError, match=r"^gb.Bottleneck: plan must be a gb.Plan .*got str\.$"):
        gb.Bottleneck(model, "plan.safetensors")


def test_rejects_a_plan_of_another_model():
    plan = gb.plan(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"gb.Bottleneck: parameter #0 is '.*' \(4, 4\)"):
        gb.Bottleneck(mlp(), plan)


def test_rejects_wrapped_models_and_nested_bottlenecks():
    b = gb.Bottleneck(mlp(), tile=(8, 8))
    with pytest.raises(TypeError, match=r"gb.Bottleneck: model is a gb.Bottleneck, whose"):
        gb.Bottleneck(b)
    with pytest.raises(TypeError, match=r"gb.Bottleneck: model must be an nn.Module"):
        gb.Bottleneck("model")


def test_load_gparams_rejects_gparams_of_another_plan():
    b = gb.Bottleneck(mlp(), tile=(8, 8))
    other = gb.init(gb.plan(mlp(), tile=(4, 4)))
    with pytest.raises(ValueError, match=r"gb.Bottleneck.load_gparams: gparams\['stacks'\]"):
        b.load_gparams(other)


# ---------------------------------------------------------------- torch.compile


@pytest.mark.slow
def test_compiled_training_step_matches_eager():
    """Forward and backward through the module under torch.compile(fullgraph=True)."""
    eager = gb.Bottleneck(mlp(), tile=(8, 8))
    compiled_b = copy.deepcopy(eager)
    x, y = torch.randn(8, 12), torch.randn(8, 3)

    def loss_of(b: gb.Bottleneck):
        return lambda x, y: nn.functional.mse_loss(b(x), y)

    compiled = torch.compile(loss_of(compiled_b), fullgraph=True)
    runs = []
    for b, loss_fn in ((eager, loss_of(eager)), (compiled_b, compiled)):
        opt = torch.optim.SGD(b.parameters(), lr=0.05)
        losses = []
        for _ in range(3):
            loss = loss_fn(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append(losses)
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-6)
    assert runs[1][-1] < runs[1][0]
    for p, q in zip(compiled_b.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_forward_reports_the_pnets_signature_also_in_copies():
    """Trainers pick their inputs from `inspect.signature(model.forward)`."""
    b = gb.Bottleneck(bn_net(), tile=(8, 8)).eval()  # no dropout
    assert inspect.signature(b.forward) == inspect.signature(b.pnet.forward)
    assert "input" in inspect.signature(b.forward).parameters
    assert gb.Bottleneck.forward.__doc__.startswith("Generate the p-net's weights")
    c = copy.deepcopy(b)
    assert c.forward.__self__ is c
    assert c.plan.model() is c.pnet  # a copy's plan names the copy's p-net: saves its buffers
    assert c.plan == b.plan
    x = torch.randn(4, 6)
    torch.testing.assert_close(c.forward(x), b(x), rtol=0, atol=0)


def test_torch_export_of_the_module_computes_what_eager_does():
    """Issue 53 row 9: `torch.export` reads `forward.__code__`, which the signature-reporting
    forward exposes as a bound method does; BatchNorm's running statistics ride along."""
    b = gb.Bottleneck(bn_net(), tile=(8, 8)).eval()
    x = torch.randn(4, 6)
    exported = torch.export.export(b, (x,))
    targets = [str(node.target) for node in exported.graph.nodes]
    assert not any("prims." in t or "gbfunc" in t for t in targets)  # for other runtimes
    torch.testing.assert_close(exported.module()(x), b(x), rtol=1e-6, atol=1e-6)
    assert inspect.signature(b.forward) == inspect.signature(b.pnet.forward)


def test_torch_export_of_a_gpt2_module_binds_keywords_by_the_pnets_signature():
    transformers = pytest.importorskip("transformers")
    from tiny_gpt2 import tiny_gpt2_config

    b = gb.Bottleneck(transformers.GPT2LMHeadModel(tiny_gpt2_config(transformers))).eval()
    ids = torch.randint(0, 64, (2, 8))
    exported = torch.export.export(b, (ids,), kwargs={"use_cache": False})
    torch.testing.assert_close(
        exported.module()(ids, use_cache=False).logits,
        b(ids, use_cache=False).logits,
        rtol=1e-5,
        atol=1e-6,
    )


def test_torchscript_is_refused_with_what_to_use_instead():
    b = gb.Bottleneck(mlp(), tile=(8, 8))
    with pytest.raises(
        TypeError,
        match=r"torch\.jit\.script\(gb\.Bottleneck\): TorchScript is not supported .* use "
        r"torch\.export\.export\(b\.eval\(\), args\) or torch\.compile\(b\)",
    ):
        torch.jit.script(b)


def test_forward_follows_a_training_flag_set_directly_as_lightning_does():
    """Lightning's evaluation loop restores `module.training` by attribute on every module it
    finds, never the p-net (a plain attribute): it stayed in eval mode for the rest of the
    training, BatchNorm's statistics frozen and dropout off."""
    b = gb.Bottleneck(bn_net(), tile=(4, 4))
    b.eval()
    for module in b.modules():
        module.training = True
    before = b.pnet[1].running_mean.clone()
    b(torch.randn(8, 6))
    assert b.pnet.training
    assert not torch.equal(b.pnet[1].running_mean, before)


def test_checkpoint_wrappers_in_the_pnet_and_data_parallel_replicas_are_refused():
    """A wrapped layer recomputes in the backward with the p-net's dense weights (a gradient
    5.7 off, the loss the same); `nn.DataParallel`'s replicas share the one p-net across
    threads (35 of 400 outputs wrong in a review's CPU simulation)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = mlp()
    wrapped[0] = checkpoint_wrapper(wrapped[0])
    with pytest.raises(ValueError, match=r"gradient checkpointing inside the p-net would"):
        gb.Bottleneck(wrapped, tile=(4, 4))
    b = gb.Bottleneck(mlp(), tile=(4, 4))
    with pytest.raises(TypeError, match=r"nn\.DataParallel .* use DistributedDataParallel"):
        b._replicate_for_data_parallel()
    b.pnet[0] = checkpoint_wrapper(b.pnet[0])  # after wrapping: it raised a bare KeyError
    with pytest.raises(ValueError, match=r"gradient checkpointing inside the p-net would"):
        b(torch.randn(2, 8))


def test_a_pnet_wrapped_in_eval_mode_stays_in_it():
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 2)).eval()
    b = gb.Bottleneck(model, tile=(8, 8))
    assert not b.training
    assert not b.pnet.training
    x = torch.randn(4, 6)
    assert torch.equal(b(x), b(x))  # no dropout


def test_a_buffer_persistent_under_one_of_its_two_names_is_stored():
    shared = torch.arange(3.0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model[0].register_buffer("s", shared)
    model[1].register_buffer("s", shared, persistent=False)  # the same tensor
    b = gb.Bottleneck(model, tile=(4, 4))
    assert f"pnet_buffers.{escape('0.s')}" in b.state_dict()


def test_load_gparams_refuses_a_genome_that_differs_only_in_its_activation():
    relu = gb.Bottleneck(mlp(), tile=(8, 8), seed=0)
    tanh = gb.Bottleneck(mlp(), tile=(8, 8), activation="tanh")
    assert relu.plan.generated == tanh.plan.generated  # same shapes: only the genome differs
    with pytest.raises(ValueError, match="plan is not this module's plan"):
        tanh.load_gparams(relu.gparams, relu.plan)


def test_an_unmarked_state_of_other_stack_shapes_is_refused_before_anything_loads():
    saved = gb.Bottleneck(mlp(), tile=(8, 8), hidden=16, seed=0)
    other = gb.Bottleneck(mlp(), tile=(8, 8), hidden=32, seed=1)
    unmarked = {k: v for k, v in saved.state_dict().items() if k != "_extra_state"}
    before = {k: v.detach().clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match="g-net stacks are not this module's"):
        other.load_state_dict(unmarked, strict=False)
    after = other.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
