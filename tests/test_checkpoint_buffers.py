"""The p-net's buffers (BatchNorm running statistics) in checkpoints: every save stores them,
every load restores them, and a model saved and restored gives the same outputs in eval mode."""

import pytest
import safetensors.torch
import torch
from torch import nn
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from gbfunc.compat import GenomicBottleneck


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


@pytest.mark.parametrize(
    ("buffers", "message"),
    [
        (
            {"1.running_mean": torch.zeros(15)},
            r"buffer '1\.running_mean' is torch\.float32 \(15,\)",
        ),
        ({"1.running_mean": torch.zeros(16, dtype=torch.float64)}, r"torch\.float64 \(16,\)"),
        (
            {"2.gone": torch.zeros(1)},
            r"the checkpoint holds buffer '2\.gone', which the model does not have",
        ),
    ],
)
def test_buffers_that_do_not_fit_the_model_are_refused_and_nothing_changes(
    tmp_path, buffers, message
):
    model = bn_net()
    plan = gb.plan(model, tile=(8, 8))
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
