"""The p-net's buffers (BatchNorm running statistics) in checkpoints: every save stores them,
every load restores them, and a model saved and restored gives the same outputs in eval mode."""

import pickle
from dataclasses import replace

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from gbfunc.compat import GenomicBottleneck
from gbfunc.dist import _optim_state


def bn_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def trained_statistics(b: gb.Bottleneck) -> None:
    """A few train-mode forwards on shifted data: the running statistics leave their defaults."""
    b.train()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(5):
            b(3 + 2 * torch.randn(32, 8, generator=gen))
    b.eval()


X = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))


def test_a_bottleneck_saved_and_restored_gives_the_same_eval_outputs(tmp_path):
    b = gb.Bottleneck(bn_net(), tile=(8, 8))
    trained_statistics(b)
    with torch.no_grad():
        expected = b(X)
    gb.save(tmp_path / "b.safetensors", b.gparams, b.plan)  # the exact call

    fresh = bn_net(seed=5)  # other weights, default statistics
    restored = gb.Bottleneck.from_checkpoint(tmp_path / "b.safetensors", fresh).eval()
    with torch.no_grad():
        torch.testing.assert_close(restored(X), expected, rtol=0, atol=0)
    assert int(fresh[1].num_batches_tracked) == 5
    assert restored.pnet_buffers.get("1.running_mean") is fresh[1].running_mean  # still shared


def test_a_bottleneck_restored_from_a_file_saves_its_own_buffers_again(tmp_path):
    b = gb.Bottleneck(bn_net(), tile=(8, 8))
    trained_statistics(b)
    gb.save(tmp_path / "a.safetensors", b.gparams, b.plan)
    again = gb.Bottleneck.from_checkpoint(tmp_path / "a.safetensors", bn_net(seed=3))
    assert again.plan.model() is again.pnet  # the checkpoint's plan now names this p-net
    gb.save(tmp_path / "b.safetensors", again.gparams, again.plan)
    stored = safetensors.torch.load_file(tmp_path / "b.safetensors")
    torch.testing.assert_close(stored["buffers/1.running_var"], b.pnet[1].running_var)


def test_the_functional_save_stores_the_plan_models_buffers_and_load_restores_them(tmp_path):
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan)
    with torch.no_grad():  # train-mode forwards update the model's own buffers in place
        for _ in range(3):
            functional_call(model, gb.apply(gparams, plan), (1 + torch.randn(16, 8),))
    model.eval()
    with torch.no_grad():
        expected = functional_call(model, gb.apply(gparams, plan), (X,))
    gb.save(tmp_path / "c.safetensors", gparams, plan)

    other = bn_net(seed=4).eval()
    ckpt = gb.load(tmp_path / "c.safetensors", other)
    with torch.no_grad():
        got = functional_call(other, gb.apply(ckpt.gparams, ckpt.plan), (X,))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(other[1].running_mean, model[1].running_mean)


def test_buffers_can_be_given_or_left_out(tmp_path):
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan)
    gb.save(tmp_path / "none.safetensors", gparams, plan, buffers={})
    assert not [k for k in safetensors.torch.load_file(tmp_path / "none.safetensors") if "buf" in k]

    source = bn_net(seed=9)
    source[1].running_mean.fill_(0.25)
    gb.save(tmp_path / "given.safetensors", gparams, plan, buffers=source)
    target = bn_net()
    gb.load(tmp_path / "given.safetensors", target)
    assert torch.equal(target[1].running_mean, torch.full((16,), 0.25))

    gb.save(
        tmp_path / "dict.safetensors",
        gparams,
        plan,
        buffers={"1.running_mean": -source[1].running_mean},
    )
    gb.load(tmp_path / "dict.safetensors", target)
    assert torch.equal(target[1].running_mean, torch.full((16,), -0.25))


def test_a_non_persistent_buffer_is_not_stored(tmp_path):
    model = bn_net()
    model.register_buffer("scratch", torch.ones(3), persistent=False)
    plan = gb.plan(model, tile=(8, 8))
    gb.save(tmp_path / "c.safetensors", gb.init(plan), plan)
    keys = safetensors.torch.load_file(tmp_path / "c.safetensors")
    assert "buffers/1.running_mean" in keys
    assert "buffers/scratch" not in keys


MISFIT_BUFFERS = [
    ({"1.running_mean": torch.zeros(15)}, r"buffer '1\.running_mean' is torch\.float32 \(15,\)"),
    (
        {"1.running_mean": torch.zeros(16, dtype=torch.int64)},
        r"buffer '1\.running_mean' is torch\.int64 \(16,\) in the checkpoint but torch\.float32",
    ),
    (
        {"2.gone": torch.zeros(1)},
        r"the checkpoint holds buffer '2\.gone', which the model does not",
    ),
    (  # a count stored as a float would be truncated into the model's int64
        {"1.num_batches_tracked": torch.tensor(3.7)},
        r"buffer '1\.num_batches_tracked' is torch\.float32 \(\) in the checkpoint but "
        r"torch\.int64",
    ),
]


@pytest.mark.parametrize(("buffers", "message"), MISFIT_BUFFERS)
def test_buffers_that_do_not_fit_the_model_are_refused_and_nothing_changes(
    tmp_path, buffers, message
):
    # Its model gone and its buffers' names unknown: gb.save cannot check the buffers.
    plan = replace(gb.plan(bn_net(), tile=(8, 8)), buffer_names=())
    path = tmp_path / "c.safetensors"
    gb.save(path, gb.init(plan), plan, buffers=buffers)
    target = bn_net()
    target[1].running_var.fill_(7.0)
    with pytest.raises(
        gb.CheckpointMismatchError, match=rf"gb\.load: .*c\.safetensors: .*{message}"
    ):
        gb.load(path, target)
    assert torch.equal(target[1].running_var, torch.full((16,), 7.0))


@pytest.mark.parametrize(
    ("buffers", "message"),
    [
        ([torch.zeros(1)], r"buffers must be an nn\.Module, a \{name: tensor\} mapping or None"),
        ({"a": 1.0}, r"buffers must map names \(str\) to tensors; got 'a': float"),
    ],
)
def test_bad_buffers_argument_names_it(tmp_path, buffers, message):
    plan = gb.plan(bn_net(), tile=(8, 8))
    with pytest.raises(TypeError, match=rf"gb\.save: {message}"):
        gb.save(tmp_path / "c.safetensors", gb.init(plan), plan, buffers=buffers)
    assert not (tmp_path / "c.safetensors").exists()


def test_a_damaged_file_leaves_the_models_buffers_untouched(tmp_path):
    b = gb.Bottleneck(bn_net(), tile=(8, 8))
    trained_statistics(b)
    path = tmp_path / "c.safetensors"
    gb.save(path, b.gparams, b.plan)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    target = bn_net()
    with pytest.raises(gb.CheckpointCorruptError):
        gb.load(path, target)
    assert torch.equal(target[1].running_mean, torch.zeros(16))


def test_the_torchgb_compatible_class_saves_and_restores_buffers(tmp_path):
    model = bn_net()
    gnets = GenomicBottleneck(model, tile=(8, 8))
    model[1].running_mean.fill_(0.5)
    gnets.save(tmp_path / "g.safetensors")
    other = bn_net()
    GenomicBottleneck(other, tile=(8, 8)).load(tmp_path / "g.safetensors")
    assert torch.equal(other[1].running_mean, torch.full((16,), 0.5))


def test_a_sharded_checkpoint_restores_buffers(tmp_path):
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    model[1].running_var.fill_(3.0)
    model[1].num_batches_tracked.fill_(11)
    gbd.save_sharded(tmp_path / "s", gb.init(plan), plan=plan)  # one process, no group
    other = bn_net()
    gbd.load_sharded(tmp_path / "s", other)
    assert torch.equal(other[1].running_var, torch.full((16,), 3.0))
    assert int(other[1].num_batches_tracked) == 11

    narrower = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    narrower[1].register_buffer("running_var", torch.ones(4))
    with pytest.raises(gb.CheckpointMismatchError, match=r"buffer '1\.running_var'"):
        gbd.load_sharded(tmp_path / "s", narrower)


@pytest.mark.parametrize("sharded", [False, True], ids=["gb.load", "load_sharded"])
def test_a_load_into_a_model_on_meta_is_refused_rather_than_dropping_its_buffers(tmp_path, sharded):
    """Copying into a meta buffer does nothing: the stored statistics would be lost."""
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    model[1].running_mean.fill_(3.0)
    path = tmp_path / ("s" if sharded else "c.safetensors")
    if sharded:
        gbd.save_sharded(path, gb.init(plan), plan=plan)
    else:
        gb.save(path, gb.init(plan), plan)
    with torch.device("meta"):
        empty = bn_net()
    with pytest.raises(
        gb.CheckpointMismatchError, match=r"buffer '1\.num_batches_tracked' is on the meta"
    ):
        (gbd.load_sharded if sharded else gb.load)(path, empty)
    empty.to_empty(device="cpu")
    (gbd.load_sharded if sharded else gb.load)(path, empty)
    assert torch.equal(empty[1].running_mean, torch.full((16,), 3.0))


# Issue 53, rows 3, 7 and 11: a resumed run saves its buffers again; gb.save refuses what no
# model could load; a load that cannot write a buffer changes nothing.


def train_functionally(model: nn.Module, gparams: dict, plan: gb.Plan, seed: int) -> None:
    """Three SGD steps through `gb.apply` in train mode: the model's statistics move."""
    model.train()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(gb.trainable_leaves(gparams), lr=0.01)
    for _ in range(3):
        x = 3 + 2 * torch.randn(32, 8, generator=gen)
        functional_call(model, gb.apply(gparams, plan), (x,)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def assert_stored_buffers(stored: dict, model: nn.Module) -> None:
    assert sorted(k for k in stored if k.startswith("buffers/")) == [
        "buffers/1.num_batches_tracked",
        "buffers/1.running_mean",
        "buffers/1.running_var",
    ]
    for name, buf in model.named_buffers():
        assert torch.equal(stored[f"buffers/{name}"], buf), name


def test_resuming_from_gb_load_keeps_the_buffers_over_several_cycles(tmp_path):
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan)
    train_functionally(model, gparams, plan, seed=0)
    gb.save(tmp_path / "0.safetensors", gparams, plan)
    for cycle in range(1, 4):
        model = bn_net(seed=cycle)  # a restarted process: a new model, default statistics
        gparams, plan, *_ = gb.load(tmp_path / f"{cycle - 1}.safetensors", model)
        assert plan.model() is model
        train_functionally(model, gparams, plan, seed=cycle)
        gb.save(tmp_path / f"{cycle}.safetensors", gparams, plan)  # the docs' resume pattern
        assert_stored_buffers(safetensors.torch.load_file(tmp_path / f"{cycle}.safetensors"), model)
    assert int(model[1].num_batches_tracked) == 12  # 3 steps in each of the 4 runs, none lost


def test_resuming_from_load_sharded_keeps_the_buffers_over_several_cycles(tmp_path):
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan)
    train_functionally(model, gparams, plan, seed=0)
    gbd.save_sharded(tmp_path / "0", gparams, plan=plan)
    for cycle in range(1, 4):
        model = bn_net(seed=cycle)
        gparams, plan, *_ = gbd.load_sharded(tmp_path / f"{cycle - 1}", model)
        assert plan.model() is model
        train_functionally(model, gparams, plan, seed=cycle)
        gbd.save_sharded(tmp_path / f"{cycle}", gparams, plan=plan)
    fresh = bn_net(seed=9)
    gbd.load_sharded(tmp_path / "3", fresh)
    for (name, got), want in zip(fresh.named_buffers(), model.buffers(), strict=True):
        assert torch.equal(got, want), name
    assert int(fresh[1].num_batches_tracked) == 12


def unstored(call: str) -> str:
    """The warning of a default save whose plan's model, `bn_net()`, is gone."""
    return (
        rf"{call}: the model this plan names is gone, so its buffers \('1\.running_mean', "
        r"'1\.running_var', '1\.num_batches_tracked'\) are not stored\. Pass buffers=model \(the "
        r"p-net\) to store them, or buffers=\{\} to store none\."
    )


def test_a_default_save_that_cannot_find_the_buffers_says_so(tmp_path):
    path = tmp_path / "c.safetensors"
    gone = gb.plan(bn_net(), tile=(8, 8))  # nothing else holds the model
    with pytest.warns(RuntimeWarning, match=unstored(r"gb\.save")) as record:
        gb.save(path, gb.init(gone), gone)
    assert record[0].filename == __file__  # points at the call of gb.save
    assert not [k for k in safetensors.torch.load_file(path) if k.startswith("buffers/")]
    with pytest.warns(RuntimeWarning, match=unstored(r"gb\.dist\.save_sharded")) as record:
        gbd.save_sharded(tmp_path / "s", gb.init(gone), plan=gone)
    assert record[0].filename == __file__  # points at the call of save_sharded

    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    copied = pickle.loads(pickle.dumps(plan))  # e.g. sent to another process: no model
    with pytest.warns(RuntimeWarning, match=unstored(r"gb\.save")):
        gb.save(path, gb.init(plan), copied)
    gb.save(path, gb.init(plan), copied, buffers={})  # asked for none: nothing to say

    plain = gb.plan(nn.Linear(8, 4), tile=(4, 4))  # gone too, but it had no buffers
    gb.save(path, gb.init(plain), plain)  # no warning (warnings are errors here)


@pytest.mark.parametrize(("buffers", "message"), MISFIT_BUFFERS)
def test_gb_save_refuses_buffers_that_do_not_fit_the_plans_model(tmp_path, buffers, message):
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    path = tmp_path / "c.safetensors"
    with pytest.raises(gb.CheckpointMismatchError, match=rf"gb\.save: {message}"):
        gb.save(path, gb.init(plan), plan, buffers=buffers)
    with pytest.raises(gb.CheckpointMismatchError, match=rf"gb\.dist\.save_sharded: {message}"):
        gbd.save_sharded(tmp_path / "s", gb.init(plan), plan=plan, buffers=buffers)
    assert not path.exists()
    assert not (tmp_path / "s" / "gbfunc.json").exists()


def test_without_the_model_gb_save_still_refuses_names_the_plan_knows_are_wrong(tmp_path):
    model = bn_net()
    copied = pickle.loads(pickle.dumps(gb.plan(model, tile=(8, 8))))  # no model: names only
    path = tmp_path / "c.safetensors"
    with pytest.raises(gb.CheckpointMismatchError, match=r"'0\.weight', a parameter of the plan"):
        gb.save(path, gb.init(copied), copied, buffers=model.state_dict())
    extra = {**dict(model.named_buffers()), "9.extra": torch.zeros(1)}
    with pytest.raises(gb.CheckpointMismatchError, match=r"buffer '9\.extra', which the plan's"):
        gb.save(path, gb.init(copied), copied, buffers=extra)
    assert not path.exists()  # each would have written a file that gb.load refuses
    gb.save(path, gb.init(copied), copied, buffers=dict(model.named_buffers()))
    assert gb.load(path, model).step is None


def test_save_replicated_takes_the_buffers_of_a_plan_made_on_meta(tmp_path):
    model = bn_net()
    trained = gb.Bottleneck(model, tile=(8, 8))
    trained_statistics(trained)
    with torch.device("meta"):
        on_meta = bn_net()
    plan = gb.plan(on_meta, tile=(8, 8))
    path = tmp_path / "c.safetensors"
    with pytest.raises(ValueError, match=r"is on the meta device.*Pass buffers= a model"):
        gbd.save_replicated(path, gb.init(plan, device="cpu"), plan)
    gbd.save_replicated(path, gb.init(plan, device="cpu"), plan, buffers=model)
    fresh = bn_net(seed=1)
    gb.load(path, fresh)
    assert torch.equal(fresh[1].running_mean, model[1].running_mean)
    assert not torch.equal(model[1].running_mean, torch.zeros(16))  # trained statistics


def test_gb_save_refuses_another_models_buffers(tmp_path):
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    path = tmp_path / "c.safetensors"
    with pytest.raises(
        gb.CheckpointMismatchError,
        match=r"gb\.save: buffers=BatchNorm1d is not the model of this plan: parameter #0 is "
        r"'0\.weight' \(16, 8\) in the plan but 'weight' \(16,\) in the model",
    ):
        gb.save(path, gb.init(plan), plan, buffers=nn.BatchNorm1d(16))
    assert not path.exists()


def test_gb_save_refuses_a_plan_that_gb_load_would_call_malformed(tmp_path):
    model = nn.Linear(8, 8)
    plan = gb.plan(model, tile=(4, 4))
    gparams = gb.init(plan)
    huge = replace(plan, params=(replace(plan.params[0], scale=1e39), *plan.params[1:]))
    path = tmp_path / "c.safetensors"
    with pytest.raises(
        gb.CheckpointError,
        match=r"gb\.save: the plan is malformed: params\[0\] \('weight'\)\.scale is 1e\+39; "
        r"expected a number in \(0, 3\.40282e\+38\], the largest float32\.",
    ):
        gb.save(path, gparams, huge)
    assert not path.exists()


def test_a_layer_whose_weights_have_a_std_above_1e4_saves_and_loads(tmp_path):
    model = nn.Linear(8, 8)
    with torch.no_grad():
        model.weight.normal_(0, 1e5, generator=torch.Generator().manual_seed(0))
    plan = gb.plan(model, tile=(4, 4))
    assert plan.generated[0].init_std > 1e4  # the weights' own std, which the plan keeps
    gparams = gb.init(plan)
    gb.save(tmp_path / "c.safetensors", gparams, plan)
    ckpt = gb.load(tmp_path / "c.safetensors", nn.Linear(8, 8))
    got, want = gb.apply(ckpt.gparams, ckpt.plan)["weight"], gb.apply(gparams, plan)["weight"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_half_precision_bottleneck_saves_and_loads_into_a_float32_model(tmp_path):
    b = gb.Bottleneck(bn_net(), tile=(8, 8))
    trained_statistics(b)
    path = tmp_path / "c.safetensors"
    gb.save(path, b.half().gparams, b.plan)  # the call: statistics in float16 too
    restored = gb.Bottleneck.from_checkpoint(path, bn_net(seed=3))
    assert restored.pnet[1].running_var.dtype == torch.float32  # cast, as load_state_dict does
    assert torch.equal(restored.pnet[1].running_var, b.pnet[1].running_var.float())
    for got, saved in zip(restored.parameters(), b.parameters(), strict=True):
        assert torch.equal(got, saved.float())


def test_buffers_may_be_the_bottleneck_itself(tmp_path):
    b = gb.Bottleneck(bn_net(), tile=(8, 8))
    trained_statistics(b)
    path = tmp_path / "c.safetensors"
    gb.save(path, b.gparams, b.plan, buffers=b)  # its p-net's buffers, by their p-net names
    assert_stored_buffers(safetensors.torch.load_file(path), b.pnet)
    restored = gb.Bottleneck.from_checkpoint(path, bn_net())
    assert torch.equal(restored.pnet[1].running_var, b.pnet[1].running_var)


@pytest.mark.parametrize("sharded", [False, True], ids=["gb.load", "load_sharded"])
def test_a_load_that_cannot_write_a_buffer_changes_nothing(tmp_path, sharded):
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    model[1].running_mean.fill_(2.0)
    model[1].running_var.fill_(3.0)
    model[1].num_batches_tracked.fill_(4)
    target = bn_net()
    target[1].running_var = torch.ones(1).expand(16)  # written last; cannot be written at all
    if sharded:
        gbd.save_sharded(tmp_path / "s", gb.init(plan), plan=plan)
        where, load = (
            r"gb\.dist\.load_sharded: \S*/s",
            lambda: gbd.load_sharded(tmp_path / "s", target),
        )
    else:
        gb.save(tmp_path / "c.safetensors", gb.init(plan), plan)
        where, load = (
            r"gb\.load: \S*/c\.safetensors",
            lambda: gb.load(tmp_path / "c.safetensors", target),
        )
    with pytest.raises(
        gb.CheckpointError,
        match=rf"{where}: the model's buffer '1\.running_var' cannot be written \(.*\); the "
        r"model is unchanged\. Give it a buffer of its own",
    ) as info:
        load()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert torch.equal(target[1].running_mean, torch.zeros(16))  # written, then put back
    assert int(target[1].num_batches_tracked) == 0
    assert torch.equal(target[1].running_var, torch.ones(16))


def test_a_sharded_load_whose_buffer_cannot_be_written_leaves_the_optimizer_as_it_was(tmp_path):
    """Row 11 with an optimizer: `load_sharded` restored its state before the buffers, so a
    buffer that cannot be written left the optimizer changed. Now nothing changes."""
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan)
    opt = torch.optim.Adam(gb.trainable_leaves(gparams), lr=1e-2)
    gb.trainable_leaves(gparams)[0].grad = torch.ones_like(gb.trainable_leaves(gparams)[0])
    opt.step()
    gbd.save_sharded(tmp_path / "s", gparams, plan=plan, optimizer=opt)
    target = bn_net()
    target[1].running_var = torch.ones(1).expand(16)
    into = gb.init(plan, seed=1)
    fresh = torch.optim.Adam(gb.trainable_leaves(into), lr=5e-1)
    with pytest.raises(gb.CheckpointError, match=r"buffer '1\.running_var' cannot be written"):
        gbd.load_sharded(tmp_path / "s", target, into=into, optimizer=fresh)
    assert fresh.state_dict()["state"] == {}
    assert fresh.param_groups[0]["lr"] == 5e-1
    assert torch.equal(target[1].running_mean, torch.zeros(16))


def test_a_sharded_load_whose_optimizer_cannot_be_restored_changes_nothing(tmp_path, monkeypatch):
    """An error part-way through restoring the optimizer (here moving a state tensor to its
    parameter's device, on the fourth of them, after the first parameter's state) left the
    settings and the state already set changed. Now the optimizer, the buffers and `into` are
    as they were."""
    model = bn_net()
    model[1].running_mean.fill_(2.0)
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan)
    opt = torch.optim.Adam(gb.trainable_leaves(gparams), lr=1e-2)
    for leaf in gb.trainable_leaves(gparams):
        leaf.grad = torch.ones_like(leaf)
    opt.step()
    gbd.save_sharded(tmp_path / "s", gparams, plan=plan, optimizer=opt)
    target = bn_net()
    into = gb.init(plan, seed=1)
    fresh = torch.optim.Adam(gb.trainable_leaves(into), lr=5e-1, betas=(0.5, 0.6))
    for leaf in gb.trainable_leaves(into):
        leaf.grad = torch.full_like(leaf, 3.0)
    fresh.step()  # a state of its own, to be kept
    groups = [{k: v for k, v in g.items() if k != "params"} for g in fresh.param_groups]
    state = {p: {k: v.clone() for k, v in s.items()} for p, s in fresh.state.items()}
    values = [t.clone() for t in gb.trainable_leaves(into)]
    calls = iter(range(1, 1000))
    on = _optim_state._on

    def fails_on_the_fourth(value, param):
        if next(calls) == 4:
            raise RuntimeError("device lost")
        return on(value, param)

    monkeypatch.setattr(_optim_state, "_on", fails_on_the_fourth)
    with pytest.raises(RuntimeError, match="device lost"):
        gbd.load_sharded(tmp_path / "s", target, into=into, optimizer=fresh)
    assert [{k: v for k, v in g.items() if k != "params"} for g in fresh.param_groups] == groups
    assert fresh.state.keys() == state.keys()
    for param, saved in state.items():
        assert fresh.state[param].keys() == saved.keys()
        assert all(torch.equal(fresh.state[param][k], v) for k, v in saved.items())
    assert all(torch.equal(a, b) for a, b in zip(values, gb.trainable_leaves(into), strict=True))
    assert torch.equal(target[1].running_mean, torch.zeros(16))
