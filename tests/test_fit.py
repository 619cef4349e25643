"""`gb.fit` (g-nets regressed onto given weights) and `gb.train_alternating` (the paper's
training: direct p-net training alternating with fits, blended by an annealed epsilon)."""

import math
import re

import pytest
import torch
from torch import nn
from torch.func import functional_call

import gbfunc as gb


def small() -> tuple[nn.Module, gb.Plan]:
    model = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, gb.plan(model, tile=(8, 8), hidden=8)


def test_fit_recovers_weights_the_genome_can_express():
    _, plan = small()
    target = {k: v.detach() for k, v in gb.apply(gb.init(plan, seed=1), plan).items()}
    start = gb.init(plan, seed=0)
    before = gb.fit(start, plan, target, steps=1).errors
    fitted = gb.fit(start, plan, target, steps=300, lr=1e-2)
    for name, error in fitted.errors.items():
        assert error < 0.3 * before[name], (name, error, before[name])
    with torch.no_grad():
        generated = gb.apply(fitted.gparams, plan)
    for name, error in fitted.errors.items():
        measured = (generated[name] - target[name]).square().sum() / target[name].square().sum()
        assert float(measured) == pytest.approx(error, rel=1e-4)


def test_fit_copies_free_parameters_and_leaves_its_input_alone():
    model, plan = small()
    start = gb.init(plan, seed=0)
    snapshot = {k: v.clone() for k, v in start["stacks"][plan.stacks[0].key].items()}
    target = {k: v.detach() + 1.0 for k, v in model.named_parameters()}
    fitted = gb.fit(start, plan, target, steps=5).gparams
    assert torch.equal(fitted["free"]["0.bias"], target["0.bias"])
    for name, value in start["stacks"][plan.stacks[0].key].items():
        assert torch.equal(value, snapshot[name])  # not modified in place
        assert fitted["stacks"][plan.stacks[0].key][name].requires_grad == value.requires_grad


def test_fit_compiled_matches_eager():
    _, plan = small()
    target = {k: v.detach() for k, v in gb.apply(gb.init(plan, seed=1), plan).items()}
    eager = gb.fit(gb.init(plan), plan, target, steps=20).errors
    compiled = gb.fit(gb.init(plan), plan, target, steps=20, compile=True).errors
    for name in eager:  # Adam amplifies rounding differences a little
        assert compiled[name] == pytest.approx(eager[name], rel=1e-2)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_fit_can_take_each_leafs_training_rate(activation):
    """`lr=None`: Adam's first step moves every entry with a gradient by its leaf's
    `gnet_lr`."""
    model = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = gb.plan(model, tile="full", hidden=4, hashed=8, activation=activation)
    start = gb.init(plan, seed=0)
    target = {k: v.detach() + 0.1 for k, v in model.named_parameters()}
    stepped = gb.fit(start, plan, target, steps=1, lr=None).gparams
    for stack in plan.stacks:
        # the hashed genome's g-nets start at zero output: only the output layer and the
        # table have a gradient at the first step
        for leaf in ("w_out", "b_out", "tile_hash"):
            before = start["stacks"][stack.key][leaf]
            moved = (stepped["stacks"][stack.key][leaf] - before).detach().abs().max()
            want = gb.optim.gnet_lr(plan, stack, leaf)
            assert float(moved) == pytest.approx(want, rel=1e-3), (leaf, want)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": {}}, "target has no '0.weight'"),
        ({"target": {"0.weight": torch.zeros(3), "2.weight": torch.zeros(4, 16)}}, "shape"),
        ({"steps": 0}, "steps must be"),
        ({"lr": -1.0}, "lr must be"),
    ],
)
def test_fit_rejects_bad_input(kwargs, message):
    model, plan = small()
    args = {"target": dict(model.named_parameters()), **kwargs}
    with pytest.raises((KeyError, ValueError), match=message):
        gb.fit(gb.init(plan), plan, args.pop("target"), **args)


@pytest.mark.parametrize(
    ("entry", "value", "error", "message"),
    [
        ("2.weight", torch.full((4, 16), float("nan")), ValueError, "contains NaN or inf"),
        ("0.bias", torch.zeros(3), ValueError, r"has shape \(3,\); .* has \(16,\)"),
        ("0.bias", torch.zeros(1).expand(16).numpy(), TypeError, "must be a Tensor, got ndarray"),
        ("2.bias", torch.tensor([1.0, float("inf"), 0.0, 0.0]), ValueError, "contains NaN or inf"),
        # Tensor.item() on meta; the imaginary part dropped with only torch's warning
        ("2.weight", torch.empty(4, 16, device="meta"), ValueError, "is on the meta device"),
        ("2.weight", torch.ones(4, 16, dtype=torch.complex64), TypeError, "is torch.complex64"),
    ],
)
def test_fit_names_a_bad_target_entry(entry, value, error, message):
    # A NaN target gave NaN g-nets silently; a free entry of the wrong shape was blamed on
    # gparams ("made by gb.init with a different plan?"); a numpy one raised AttributeError.
    model, plan = small()
    target = {n: p.detach() for n, p in model.named_parameters()} | {entry: value}
    with pytest.raises(error, match=rf"^gb\.fit: target\['{re.escape(entry)}'\] {message}"):
        gb.fit(gb.init(plan), plan, target, steps=1)


def test_fit_fits_a_zero_target_against_the_weights_starting_variance():
    # Divided by its own mean square (clamped at 1e-30), a zero target's gradients overflowed
    # Adam's moments: the weight did not move, and its error read 4e28.
    model, plan = small()
    with torch.no_grad():
        model[2].weight.zero_()
    target = {n: p.detach() for n, p in model.named_parameters()}
    start = gb.init(plan, seed=0)
    fitted = gb.fit(start, plan, target, steps=100)
    with torch.no_grad():
        before = gb.apply(start, plan)["2.weight"].square().mean()
        after = gb.apply(fitted.gparams, plan)["2.weight"].square().mean()
    assert float(after) < 0.05 * float(before)
    start_variance = plan.generated[1].init_std ** 2
    assert fitted.errors["2.weight"] == pytest.approx(float(after) / start_variance, rel=1e-4)


def test_fit_copies_the_task_embeddings():
    # They were returned as the input's own storage: a step on the fitted ones moved both.
    model = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = gb.plan(model, tile=(8, 8), hidden=8, condition=3, tasks=2)
    start = gb.init(plan)
    fitted = gb.fit(start, plan, model.state_dict(), steps=1, task=0).gparams
    assert torch.equal(fitted["tasks"], start["tasks"])
    assert (
        fitted["tasks"].untyped_storage().data_ptr() != start["tasks"].untyped_storage().data_ptr()
    )


def test_alternating_training_blends_with_the_annealed_epsilon():
    model, plan = small()
    seen: list[dict] = []

    def train_dense(params, generation):
        seen.append({k: v.clone() for k, v in params.items()})
        return {k: v + 1.0 for k, v in params.items()}  # a stand-in for training

    start = {k: v.detach() for k, v in model.named_parameters()}
    fits: list[int] = []
    gparams = gb.train_alternating(
        gb.init(plan),
        plan,
        train_dense,
        generations=2,
        anneal=4.0,
        fit_steps=3,
        start=start,
        on_generation=lambda n, g, errors: fits.append(n),
    )
    assert fits == [0, 1]
    assert torch.equal(seen[0]["0.weight"], start["0.weight"])  # eps(0) = 1
    generated = gb.apply(
        gb.fit(gb.init(plan), plan, {k: v + 1.0 for k, v in start.items()}, steps=3).gparams, plan
    )
    eps = math.exp(-1 / 4.0)
    expected = eps * (start["0.weight"] + 1.0) + (1 - eps) * generated["0.weight"]
    torch.testing.assert_close(seen[1]["0.weight"], expected)
    assert torch.equal(seen[1]["0.bias"], start["0.bias"] + 1.0)  # free: the trained values
    assert set(gparams) == {"stacks", "free", "frozen"}


def test_alternating_training_learns_a_task():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    plan = gb.plan(model, tile="full", hidden=16, biases=True)
    x = torch.randn(256, 8)
    y = (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(1)

    def loss_of(params):
        return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    def train_dense(params, generation):
        params = {k: v.clone().requires_grad_() for k, v in params.items()}
        opt = torch.optim.Adam(params.values(), lr=1e-2)
        for _ in range(30):
            opt.zero_grad()
            loss_of(params).backward()
            opt.step()
        return {k: v.detach() for k, v in params.items()}

    gparams = gb.init(plan, requires_grad=False)
    before = float(loss_of(gb.apply(gparams, plan)))
    gparams = gb.train_alternating(
        gparams, plan, train_dense, generations=4, anneal=2.0, fit_steps=150
    )
    after = float(loss_of(gb.apply(gparams, plan)))
    assert after < 0.7 * before, (before, after)


def test_alternating_training_rejects_bad_options():
    _, plan = small()
    with pytest.raises(ValueError, match="generations must be"):
        gb.train_alternating(gb.init(plan), plan, lambda p, n: p, generations=0)
    with pytest.raises(KeyError, match=r"train_dense\(params, 0\)'s result has no '0\.weight'"):
        gb.train_alternating(gb.init(plan), plan, lambda p, n: {}, generations=1)
    # Each of these raised raw (KeyError, a torch size mismatch, "'NoneType' object is not
    # iterable", AttributeError) or, for a (1, n) start, broadcast it silently.
    model, _ = small()
    start = {n: p.detach() for n, p in model.named_parameters()}
    for args, kwargs, error, message in (
        (
            (plan, lambda p, n: None),
            {},
            TypeError,
            r"train_dense\(params, 0\)'s result must map names to tensors, got NoneType",
        ),
        ((plan, lambda p, n: p), {"start": {}}, KeyError, r"start has no '0\.weight'"),
        (
            (plan, lambda p, n: p),
            {"start": dict(start, **{"0.weight": start["0.weight"][:1]})},
            ValueError,
            r"start\['0\.weight'\] has shape \(1, 24\)",
        ),
        ((plan, "train"), {}, TypeError, "train_dense must be callable, got str"),
        (("plan", lambda p, n: p), {}, TypeError, "plan must be a gb.Plan"),
    ):
        with pytest.raises(
            error, match=rf"^\"?gb\.train_alternating: {message}"
        ):  # KeyError: "..."
            gb.train_alternating(gb.init(plan), *args, generations=1, fit_steps=1, **kwargs)
    conditioned = gb.plan(model, tile=(8, 8), hidden=8, condition=3)
    with pytest.raises(ValueError, match=r"^gb\.train_alternating: the plan's g-nets read"):
        gb.train_alternating(gb.init(conditioned), conditioned, lambda p, n: p, generations=1)
    called = []
    for option, message in (("fit_lr", "fit_lr must be"), ("fit_steps", "fit_steps must be")):
        with pytest.raises(ValueError, match=rf"gb\.train_alternating: {message}"):
            gb.train_alternating(
                gb.init(plan), plan, lambda p, n: called.append(n), generations=1, **{option: 0}
            )
    assert called == []  # refused before the first generation trains


def test_fit_decays_its_rate_along_a_cosine_to_zero(monkeypatch):
    rates: list[float] = []
    step = torch.optim.Adam.step

    def recorded(self, *args, **kwargs):
        rates.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", recorded)
    trained = nn.Linear(16, 8)
    plan = gb.plan(trained, tile=(8, 8))
    gb.fit(gb.init(plan), plan, trained.state_dict(), steps=10, lr=0.1)
    want = [0.1 * 0.5 * (1 + math.cos(math.pi * t / 10)) for t in range(10)]
    assert rates == pytest.approx(want, abs=1e-12)


def test_alternating_training_starts_from_starts_free_parameters():
    model = nn.Linear(16, 8)
    plan = gb.plan(model, tile=(8, 8))
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    start["bias"] = torch.full((8,), 3.0)
    seen: dict[int, dict] = {}

    def train_dense(params: dict, generation: int) -> dict:
        seen.setdefault(generation, {k: v.clone() for k, v in params.items()})
        return {k: v.clone() for k, v in params.items()}

    gb.train_alternating(gb.init(plan), plan, train_dense, generations=1, fit_steps=1, start=start)
    assert torch.equal(seen[0]["bias"], start["bias"])
