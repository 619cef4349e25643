"""gbfunc.compat.GenomicBottleneck: torchGB's training loop on plain and DDP-wrapped models."""

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call

import gbfunc as gb
from gbfunc.compat import GenomicBottleneck


class Encoder(nn.Module):
    """A small nn.TransformerEncoder classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.inp(x)).mean(1))


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3)
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(64, 3),
    )  # fmt: skip


CASES = {
    "mlp": (mlp, (16,), {"tile": (16, 16)}),
    "cnn": (cnn, (1, 8, 8), {"tile": (8, 4)}),
    "transformer": (Encoder, (5, 6), {"tile": (16, 16), "ignore_layers": ["norm"]}),
}


def batch(shape: tuple[int, ...], n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed, learnable classification batch."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, *shape, generator=gen)
    return x, (x.flatten(1)[:, :3].argmax(1))


def torchgb_loop(model, gnets, optimizer, x, y, steps: int) -> list[float]:
    """torchGB's canonical loop, verbatim."""
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        gnets.zero_grad()
        gnets.predict_weights()
        loss = criterion(model(x), y)
        loss.backward()
        gnets.backward()
        optimizer.step()
        gnets.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(CASES))
def test_torchgb_loop_trains(name):
    build, shape, kwargs = CASES[name]
    model = build()
    gnets = GenomicBottleneck(model, lr=1e-2, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = batch(shape)
    losses = torchgb_loop(model, gnets, optimizer, x, y, steps=25)
    assert losses[-1] < 0.5 * losses[0], losses
    generated = [dict(model.named_parameters())[p.name] for p in gnets.plan.generated]
    assert all(p.grad is None and p not in optimizer.state for p in generated)  # no p-net state
    free = [dict(model.named_parameters())[p.name] for p in gnets.plan.free]
    assert free
    assert all(p in optimizer.state for p in free)  # trained by the user's optimizer


def test_gnet_gradients_equal_end_to_end_autograd():
    model = mlp()
    gnets = GenomicBottleneck(model, tile=(16, 16))
    x, y = batch((16,))
    gnets.predict_weights()
    nn.functional.cross_entropy(model(x), y).backward()
    gnets.backward()

    def loss(stacks):
        params = gb.apply({**gnets.gparams, "stacks": stacks}, gnets.plan)
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    want = torch.func.grad(loss)(gnets.gparams["stacks"])
    for key, leaves in gnets.gparams["stacks"].items():
        for leaf, value in leaves.items():
            torch.testing.assert_close(value.grad, want[key][leaf], msg=f"{key}/{leaf}")


def test_one_optimizer_over_the_stacks_and_an_honest_repr():
    model = mlp()
    gnets = GenomicBottleneck(model, tile=(16, 16), hidden_dim=8, ignore_layers=["4."])
    assert isinstance(gnets.optimizer, torch.optim.AdamW)
    assert len(gnets.optimizer.param_groups) == 1
    assert len(gnets.optimizer.param_groups[0]["params"]) == sum(
        len(s) for s in gnets.gparams["stacks"].values()
    )
    assert "4.weight" in [p.name for p in gnets.plan.free]  # ignore_layers substring
    assert gnets.compression() == pytest.approx(gb.report(gnets.plan).compression)
    assert f"compression {gnets.compression():.2f}x of the whole model" in repr(gnets)
    ratio = gb.report(gnets.plan).generated_compression  # what `compression=` asks for
    assert f"{ratio:.2f}x of the generated weights" in repr(gnets)
    assert gnets.eval() is gnets
    assert not model.training
    gnets.train()
    assert model.training


def test_compiled_model_is_unwrapped():
    model = mlp()
    gnets = GenomicBottleneck(torch.compile(model), tile=(16, 16))
    assert [p.name for p in gnets.plan.params] == [n for n, _ in model.named_parameters()]


def trained(lr: float, steps: int) -> tuple[nn.Module, GenomicBottleneck, torch.optim.Optimizer]:
    """An MLP, its g-nets and its optimizer after `steps` of torchGB's loop at `lr`."""
    x, y = batch((16,))
    torch.manual_seed(0)
    model = mlp()
    gnets = GenomicBottleneck(model, tile=(16, 16), lr=lr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    torchgb_loop(model, gnets, optimizer, x, y, steps=steps)
    return model, gnets, optimizer


def test_save_load_resumes_exactly(tmp_path):
    x, y = batch((16,))
    model, gnets, optimizer = trained(lr=3e-3, steps=3)
    gnets.save(tmp_path / "g.safetensors")
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")  # the user's own, as in torchGB
    straight = torchgb_loop(model, gnets, optimizer, x, y, steps=3)

    other = mlp()  # fresh weights everywhere
    gnets2 = GenomicBottleneck(other, tile=(16, 16), lr=3e-3, seed=7)
    gnets2.load(tmp_path / "g.safetensors")
    optimizer2 = torch.optim.AdamW(other.parameters(), lr=3e-3)
    optimizer2.load_state_dict(torch.load(tmp_path / "opt.pt"))
    assert torchgb_loop(other, gnets2, optimizer2, x, y, steps=3) == straight


def test_torchgbs_current_signature_and_scheduler_resume_exactly(tmp_path):
    """torchGB HEAD's GenomicBottleneck(model, local_rank_dict, ..., scheduler=f(opt, lr),
    gnet_batchsize=...) runs as written; the scheduler's state is saved with the g-nets."""
    x, y = batch((16,))

    def halving(optimizer, lr):  # its milestones, a Counter with int keys, must come back whole
        return torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[4, 5], gamma=0.5)

    def build(seed: int) -> tuple[nn.Module, GenomicBottleneck, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = mlp()
        gnets = GenomicBottleneck(
            model, {0: "cpu"}, hidden_dim=8, scheduler=halving, lr=3e-3, gnet_batchsize=250,
            ignore_layers=[], compression=None, hypernet_type="g-net", seed=seed,
        )  # fmt: skip
        return model, gnets, torch.optim.AdamW(model.parameters(), lr=3e-3)

    model, gnets, optimizer = build(0)
    assert {s.tile for s in gnets.plan.stacks} <= {(16, 16), (3, 16)}  # ceil(sqrt(250)) = 16
    torchgb_loop(model, gnets, optimizer, x, y, steps=3)
    gnets.save(tmp_path / "g.safetensors")
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    straight = torchgb_loop(model, gnets, optimizer, x, y, steps=3)

    other, gnets2, optimizer2 = build(1)
    held, schedule = gnets2.optimizer, gnets2.scheduler
    gnets2.load(tmp_path / "g.safetensors")
    optimizer2.load_state_dict(torch.load(tmp_path / "opt.pt"))
    # The same optimizer and scheduler objects: a scheduler a user built on gnets.optimizer
    # before resuming kept driving a discarded optimizer.
    assert gnets2.optimizer is held
    assert gnets2.scheduler is schedule
    assert schedule.last_epoch == 3
    assert torchgb_loop(other, gnets2, optimizer2, x, y, steps=3) == straight
    assert gnets2.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 / 4)

    with pytest.raises(ValueError, match=r"hypernet_type='xox' is not implemented"):
        GenomicBottleneck(mlp(), {0: "cpu"}, hypernet_type="xox")
    with pytest.raises(ValueError, match="pass one of gnet_batchsize, tile and compression"):
        GenomicBottleneck(mlp(), gnet_batchsize=100, tile=(8, 8))
    plain = GenomicBottleneck(mlp(), hidden_dim=8, gnet_batchsize=250)  # no scheduler
    with pytest.raises(gb.CheckpointMismatchError, match="holds a scheduler's state"):
        plain.load(tmp_path / "g.safetensors")

    def constant(optimizer, lr):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    other = GenomicBottleneck(mlp(), hidden_dim=8, gnet_batchsize=250, scheduler=constant)
    before = [t.detach().clone() for t in other.optimizer.param_groups[0]["params"]]
    with pytest.raises(gb.CheckpointMismatchError, match="scheduler state does not fit"):
        other.load(tmp_path / "g.safetensors")  # checked before anything changed
    after = other.optimizer.param_groups[0]["params"]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_load_takes_an_optimizer_factory_that_keeps_the_trainable_leaves(tmp_path):
    def trainable_only(leaves):
        return torch.optim.AdamW([t for t in leaves if t.requires_grad], lr=1e-3)

    GenomicBottleneck(mlp(), tile=(16, 16)).save(tmp_path / "g.safetensors")
    gnets = GenomicBottleneck(mlp(), tile=(16, 16), seed=3, optimizer=trainable_only)
    gnets.load(tmp_path / "g.safetensors")  # its trial copies were not trainable: no leaves


def test_load_rejects_a_checkpoint_with_other_gnets_and_changes_nothing(tmp_path):
    GenomicBottleneck(mlp(), tile=(16, 16)).save(tmp_path / "g.safetensors")
    model = mlp()
    gnets = GenomicBottleneck(model, tile=(8, 8))
    before = [t.clone() for t in gnets.optimizer.param_groups[0]["params"]]
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        gb.CheckpointMismatchError,
        match=r"parameter '0.weight' is generated on 16x16 tiles .* but generated on 8x8",
    ):
        gnets.load(tmp_path / "g.safetensors")
    assert all(
        torch.equal(a, b)
        for a, b in zip(before, gnets.optimizer.param_groups[0]["params"], strict=True)
    )
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))


def test_a_half_precision_model_gets_float32_gnets_that_every_step_moves():
    """In bfloat16 most of AdamW's steps at torchGB's rates rounded away (two thirds of a
    stack's w_in unchanged after one step); torchGB's g-nets are float32 throughout."""
    x, y = batch((16,))
    model = mlp().to(torch.bfloat16)
    gnets = GenomicBottleneck(model, tile=(16, 16), lr=3e-4)
    leaves = [t for s in gnets.gparams["stacks"].values() for t in s.values()]
    assert {t.dtype for t in leaves} == {torch.float32}
    before = [t.detach().clone() for t in leaves]
    torchgb_loop(model, gnets, torch.optim.SGD(model.parameters(), lr=0.0), x.bfloat16(), y, 1)
    moved = sum(int((a != b).sum()) for a, b in zip(before, leaves, strict=True))
    assert moved > 0.99 * sum(t.numel() for t in leaves)
    with torch.no_grad():
        gnets.predict_weights()
    assert model[0].weight.dtype == torch.bfloat16
    assert torch.equal(model[0].weight, gb.apply(gnets.gparams, gnets.plan)["0.weight"].bfloat16())


def test_a_frozen_stack_trains_the_others_without_blaming_no_grad():
    x, y = batch((16,))
    model = mlp()
    gnets = GenomicBottleneck(model, tile=(16, 16))
    frozen, *others = gnets.gparams["stacks"].values()
    for t in frozen.values():
        t.requires_grad_(False)
    gnets.predict_weights()
    nn.functional.cross_entropy(model(x), y).backward()
    gnets.backward()
    assert all(t.grad is None for t in frozen.values())
    assert all(t.grad is not None for s in others for t in s.values())
    assert all(p.grad is None for p in (model[0].weight, model[2].weight, model[4].weight))
    with torch.no_grad():
        gnets.predict_weights()
    with pytest.raises(RuntimeError, match=r"ran without gradients \(torch\.no_grad\(\)\)"):
        gnets.backward()


def test_a_bottleneck_built_on_trained_weights_loads_their_checkpoint(tmp_path):
    """A plan takes its scales from the model's weights when it is made: one built after
    the trained weights were loaded differs in them alone, and takes the checkpoint's."""
    model, gnets, _ = trained(lr=5e-2, steps=20)
    gnets.save(tmp_path / "g.safetensors")
    with torch.no_grad():
        gnets.predict_weights()  # the weights of the g-nets saved (after their last step)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    again = mlp()
    again.load_state_dict(weights)  # the weights' stds moved: other scales
    gnets2 = GenomicBottleneck(again, tile=(16, 16), lr=5e-2)
    assert gnets2.plan != gnets.plan
    gnets2.load(tmp_path / "g.safetensors")
    assert gnets2.plan == gnets.plan
    assert all(torch.equal(again.state_dict()[k], v) for k, v in weights.items())


def test_a_scheduler_added_on_resume_sets_the_rates(tmp_path):
    GenomicBottleneck(mlp(), tile=(8, 8), lr=1e-3).save(tmp_path / "g.safetensors")

    def warm(optimizer, lr):
        return torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=4)

    gnets = GenomicBottleneck(mlp(), tile=(8, 8), lr=1e-3, scheduler=warm)
    gnets.load(tmp_path / "g.safetensors")
    rates = []
    for _ in range(5):
        rates.append(gnets.optimizer.param_groups[0]["lr"])
        gnets.step()
    assert rates == pytest.approx([1e-4, 3.25e-4, 5.5e-4, 7.75e-4, 1e-3])


def test_torchgb_loop_on_a_ddp_model(process_group, tmp_path):
    model = mlp()
    ddp = nn.parallel.DistributedDataParallel(model)
    gnets = GenomicBottleneck(ddp, tile=(32, 32), hidden_dim=16, lr=1e-2)
    plain = GenomicBottleneck(mlp(), tile=(32, 32), hidden_dim=16)
    assert gnets.compression() == plain.compression() > 1  # torchGB reports < 1 here
    assert [p.name for p in gnets.plan.params] == [n for n, _ in model.named_parameters()]
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    x, y = batch((16,))
    losses = torchgb_loop(ddp, gnets, optimizer, x, y, steps=20)
    assert losses[-1] < 0.6 * losses[0], losses

    gnets.save(tmp_path / "g.safetensors")  # rank 0 writes; every rank returns after
    again = GenomicBottleneck(
        nn.parallel.DistributedDataParallel(mlp()), tile=(32, 32), hidden_dim=16
    )
    again.load(tmp_path / "g.safetensors")  # loads and predicts
    with torch.no_grad():
        gnets.predict_weights()  # the last gnets.step() is not yet in ddp's weights
    for a, b in zip(again.model.parameters(), ddp.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_whose_free_tables_were_drawn_or_worded_otherwise_still_loads(tmp_path):
    """A padded embedding left free (`embeddings=False`) is drawn with its padding row at zero
    since issue 53's row 8; a checkpoint written before records the plain normal draw. How a
    free parameter is drawn or described is no part of what a checkpoint holds: it loads."""
    from forged import forge, in_plan

    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 8))
    net = GenomicBottleneck(model, tile=(4, 4))
    (free,) = [p for p in net.plan.free if p.name == "0.weight"]
    assert free.reason == "embedding (pass embeddings=True to generate)"
    net.save(tmp_path / "c.safetensors")

    def as_before(plan: dict) -> None:
        (entry,) = [p for p in plan["params"] if p["name"] == "0.weight"]
        entry["init"], entry["reason"] = ["normal", 1.0], "worded by an older version"

    forge(tmp_path / "c.safetensors", in_plan(as_before))
    with torch.no_grad():
        model[0].weight.add_(1.0)
    net.load(tmp_path / "c.safetensors")  # refused as another plan before
    assert torch.equal(model[0].weight[0], torch.zeros(4))
    other = gb.plan(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 8)), tile=(4, 4))
    assert other == net.plan
    assert other.fingerprint() == net.plan.fingerprint()
    bigger = gb.plan(nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 8)), tile=(4, 4))
    assert bigger != net.plan
    assert bigger.fingerprint() != net.plan.fingerprint()


def test_a_cyclic_schedule_resumes_exactly(tmp_path):
    """CyclicLR's `load_state_dict` takes a key out of the state it is given: the trial load
    of `load` must read a copy, or the real one fails after the g-nets were replaced."""
    x, y = batch((16,))

    def cyclic(optimizer, lr):
        return torch.optim.lr_scheduler.CyclicLR(
            optimizer, lr / 10, lr, step_size_up=2, cycle_momentum=False
        )

    def build(seed: int):
        torch.manual_seed(seed)
        model = mlp()
        gnets = GenomicBottleneck(model, tile=(16, 16), scheduler=cyclic, lr=3e-3, seed=seed)
        return model, gnets, torch.optim.AdamW(model.parameters(), lr=3e-3)

    model, gnets, optimizer = build(0)
    torchgb_loop(model, gnets, optimizer, x, y, steps=3)
    gnets.save(tmp_path / "g.safetensors")
    torch.save(optimizer.state_dict(), tmp_path / "opt.pt")
    straight = torchgb_loop(model, gnets, optimizer, x, y, steps=3)

    other, gnets2, optimizer2 = build(1)
    gnets2.load(tmp_path / "g.safetensors")
    optimizer2.load_state_dict(torch.load(tmp_path / "opt.pt"))
    assert gnets2.scheduler.last_epoch == 3
    assert torchgb_loop(other, gnets2, optimizer2, x, y, steps=3) == straight


def test_load_refuses_another_optimizers_state_and_changes_nothing(tmp_path):
    GenomicBottleneck(mlp(), tile=(16, 16)).save(tmp_path / "g.safetensors")  # AdamW

    def sgd(leaves):
        return torch.optim.SGD(leaves, lr=1e-2, momentum=0.9)

    gnets = GenomicBottleneck(mlp(), tile=(16, 16), seed=3, optimizer=sgd)
    before = [t.clone() for t in gnets.optimizer.param_groups[0]["params"]]
    with pytest.raises(gb.CheckpointMismatchError, match=r"AdamW's and .* optimizer is .*SGD"):
        gnets.load(tmp_path / "g.safetensors")
    after = gnets.optimizer.param_groups[0]["params"]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert gnets.optimizer.param_groups[0]["momentum"] == 0.9


def test_parameters_replaced_after_construction_are_named(tmp_path):
    """`load_state_dict(assign=True)` swaps the model's parameters: writing into the old ones
    would train nothing, silently."""
    model = mlp()
    gnets = GenomicBottleneck(model, tile=(16, 16))
    gnets.save(tmp_path / "g.safetensors")
    model.load_state_dict(mlp().state_dict(), assign=True)
    with pytest.raises(RuntimeError, match=r"parameter '0.weight' is no longer the tensor"):
        gnets.predict_weights()
    before = [t.clone() for t in gnets.optimizer.param_groups[0]["params"]]
    plan = gnets.plan
    with pytest.raises(RuntimeError, match=r"load: the model's parameter '0.weight' is no"):
        gnets.load(tmp_path / "g.safetensors")  # refused before anything is replaced
    after = gnets.optimizer.param_groups[0]["params"]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert gnets.plan is plan


def test_a_generated_layer_left_without_gradient_is_named_once():
    """Unused in the forward: plain PyTorch's optimizer would skip it, here its g-nets still
    move with their stack; the user is told once which layers and what to do."""
    model = mlp()
    gnets = GenomicBottleneck(model, tile=(16, 16))
    model[4].weight.requires_grad_(False)  # frozen after construction
    x, y = batch((16,))
    with pytest.warns(UserWarning, match=r"\['4.weight'\] got no gradient.*ignore_layers"):
        torchgb_loop(model, gnets, torch.optim.AdamW(model.parameters()), x, y, steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        torchgb_loop(model, gnets, torch.optim.AdamW(model.parameters()), x, y, steps=1)


@pytest.mark.parametrize("second", ["cpu", [0], True])
def test_a_wrong_local_rank_dict_is_named(second):
    with pytest.raises(TypeError, match="local_rank_dict must be a dict"):
        GenomicBottleneck(mlp(), second)


@pytest.mark.parametrize(
    ("factories", "match"),
    [
        ({"optimizer": lambda leaves: None}, r"optimizer\(leaves\) must return a torch\.optim"),
        (
            {"optimizer": lambda leaves: list(leaves)},
            r"optimizer\(leaves\) must return .* got list",
        ),
        ({"scheduler": lambda opt, lr: 3}, r"scheduler\(optimizer, lr\) must return .* got int"),
    ],
)
def test_a_factory_returning_something_else_is_named_at_construction(factories, match):
    """It constructed, then raised AttributeError at zero_grad, step or save."""
    with pytest.raises(TypeError, match=rf"^GenomicBottleneck: {match}"):
        GenomicBottleneck(mlp(), tile=(16, 16), **factories)
