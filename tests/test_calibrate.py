"""`gb.calibrate`: every layer starts at zero-mean outputs, through free or generated biases."""

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

import gbfunc as gb


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 25, 12),
        nn.ReLU(), nn.Linear(12, 3),
    )  # fmt: skip


def layer_outputs(model: nn.Module, params: dict, x: torch.Tensor) -> dict[str, torch.Tensor]:
    outputs = {}
    hooks = [
        m.register_forward_hook(lambda _m, _i, out, n=n: outputs.__setitem__(n, out))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d)
    ]
    with torch.no_grad():
        functional_call(model, params, (x,))
    for h in hooks:
        h.remove()
    return outputs


X = torch.rand(128, 1, 5, 5, generator=torch.Generator().manual_seed(0)) + 0.5  # all positive
X1 = torch.rand(16, 2, 7, generator=torch.Generator().manual_seed(1)) + 1.0


@pytest.mark.parametrize("biases", [True, False])
def test_every_layer_starts_at_zero_mean_outputs(biases):
    model = cnn()
    plan = (
        gb.plan(model, tile="full", biases=True, hidden=4)
        if biases
        else gb.plan(model, tile=(4, 4), hidden=4)
    )
    gparams = gb.init(plan, seed=3)
    before = layer_outputs(model, gb.apply(gparams, plan), X)
    calibrated = gb.calibrate(gparams, plan, model, X)
    after = layer_outputs(model, gb.apply(calibrated, plan), X)
    assert max(abs(float(y.mean())) for y in before.values()) > 1e-2  # there was an offset
    for name, y in after.items():
        unit = 1 if name == "0" else -1
        per_unit = y.movedim(unit, -1).reshape(-1, y.shape[unit]).mean(0)
        if biases:  # one shift of the generated vector: the mean over units is zero
            assert abs(float(per_unit.mean())) < 1e-5, name
        else:  # a free bias: every unit's mean is zero
            torch.testing.assert_close(per_unit, torch.zeros_like(per_unit), atol=1e-5, rtol=0)


def test_only_biases_move_and_the_input_is_left_alone():
    model = cnn()
    plan = gb.plan(model, tile="full", biases=True, hidden=4)
    gparams = gb.init(plan, seed=3)
    saved = [t.clone() for t in tree_leaves(gparams)]
    calibrated = gb.calibrate(gparams, plan, model, (X,))
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(gparams), saved, strict=True))
    before, after = gb.apply(gparams, plan), gb.apply(calibrated, plan)
    for name in before:
        same = torch.equal(before[name], after[name])
        assert same == name.endswith("weight"), name
    assert all(t.requires_grad for t in tree_leaves(calibrated))


def test_frozen_biases_stay_and_wrong_gparams_are_named():
    model = cnn()
    model[5].bias.requires_grad_(False)
    plan = gb.plan(model, tile=(4, 4), hidden=4)
    gparams = gb.init(plan, seed=1)
    calibrated = gb.calibrate(gparams, plan, model, X)
    assert torch.equal(calibrated["frozen"]["5.bias"], gparams["frozen"]["5.bias"])
    with pytest.raises(ValueError, match=r"gb\.calibrate"):
        gb.calibrate({"stacks": {}, "free": {}, "frozen": {}}, plan, model, X)


def test_buffers_stay_and_the_module_calibrates_in_place():
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    before = {n: b.clone() for n, b in model.named_buffers()}
    b = gb.Bottleneck(model, tile="full", biases=True, hidden=4)
    x = torch.rand(64, 6) + 1.0
    weight = b.stacks  # the parameters an optimizer would hold
    b.calibrate(x)
    assert b.stacks is weight
    for name, value in model.named_buffers():
        assert torch.equal(value, before[name]), name  # no running statistics were updated
    outputs = layer_outputs(model, gb.apply(b.gparams, b.plan), x)
    assert abs(float(outputs["3"].mean())) < 1e-5


@pytest.mark.parametrize("biases", [False, True])
def test_a_model_that_is_the_layer_itself_calibrates(biases):
    # The root module's name is "": its bias, "bias", was looked up as ".bias" and skipped.
    for model, x in ((nn.Linear(8, 4), torch.rand(32, 8) + 1.0), (nn.Conv1d(2, 3, 3), X1)):
        plan = gb.plan(model, tile="full", biases=biases, hidden=4)
        calibrated = gb.calibrate(gb.init(plan, seed=0), plan, model, x)
        with torch.no_grad():
            out = functional_call(model, gb.apply(calibrated, plan), (x,))
        means = out.mean([d for d in range(out.dim()) if d != 1])
        if biases:  # a generated bias moves by one shift: the units' means average to zero
            assert abs(float(means.mean())) < 1e-5, means
        else:
            torch.testing.assert_close(means, torch.zeros_like(means), atol=1e-5, rtol=0)


def test_unbatched_inputs_are_averaged_per_unit():
    # A 1-d input to nn.Linear was reduced over every dimension (`mean([])`); a (C, L) input
    # to nn.Conv1d was read as (N, C), wrong or a raw shape error.
    for model, x in (
        (nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3)), torch.rand(8) + 1.0),
        (nn.Sequential(nn.Conv1d(2, 6, 3), nn.ReLU(), nn.Conv1d(6, 3, 3)), X1[0]),
        (nn.Sequential(nn.Conv1d(2, 5, 3)), X1[0]),  # 5 output positions, 5 channels
    ):
        plan = gb.plan(model, tile="full", hidden=4)
        calibrated = gb.calibrate(gb.init(plan, seed=0), plan, model, x)
        for out in layer_outputs(model, gb.apply(calibrated, plan), x).values():
            means = out.mean(list(range(1, out.dim()))) if out.dim() > 1 else out  # unit first
            torch.testing.assert_close(means, torch.zeros_like(means), atol=1e-5, rtol=0)


def test_a_model_other_than_the_plans_and_inputs_of_another_type_are_named():
    model = cnn()
    plan = gb.plan(model, tile=(4, 4), hidden=4)
    with pytest.raises(ValueError, match=r"^gb\.calibrate: parameter '0\.weight' has shape"):
        gb.calibrate(gb.init(plan), plan, nn.Sequential(nn.Linear(3, 2)), X)
    with pytest.raises(TypeError, match=r"^gb\.calibrate: inputs must be a tensor .* got int"):
        gb.calibrate(gb.init(plan), plan, model, 3)
    with pytest.raises(TypeError, match=r"^gb\.calibrate: inputs must be a tensor .* got str"):
        gb.calibrate(gb.init(plan), plan, model, "x.pt")  # its letters went to forward()


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.mha(h, h, h)[0]


@pytest.mark.parametrize("biases", [False, True])
def test_an_attention_output_projection_is_calibrated(biases):
    # nn.MultiheadAttention applies out_proj without calling its forward: no hook saw it
    torch.manual_seed(0)
    model = _Attention()
    plan = gb.plan(model, tile="full", biases=biases)
    gparams = gb.init(plan)
    if not biases:
        with torch.no_grad():
            gparams["free"]["mha.out_proj.bias"].fill_(2.0)
    x = torch.randn(4, 5, 8)
    out = functional_call(model, gb.apply(gb.calibrate(gparams, plan, model, x), plan), (x,))
    mean = out.detach().mean((0, 1))  # per unit where the bias is free, overall generated
    assert (mean.mean() if biases else mean).abs().max() < 1e-5


def test_a_layer_the_forward_never_calls_is_named_and_left_alone():
    class Functional(nn.Module):  # its head's weight is used through F.linear
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(self.body(x), self.head.weight, self.head.bias)

    model = Functional()
    plan = gb.plan(model, tile="full")
    gparams = gb.init(plan)
    with pytest.warns(UserWarning, match=r"never called 'head', so their biases were left"):
        out = gb.calibrate(gparams, plan, model, torch.randn(16, 6))
    assert torch.equal(out["free"]["head.bias"], gparams["free"]["head.bias"])


def test_dropout_is_off_and_the_random_state_kept_while_it_measures():
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 2))
    plan = gb.plan(model, tile="full")
    gparams, x = gb.init(plan), torch.randn(32, 8)
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    first = gb.calibrate(gparams, plan, model, x)
    assert torch.equal(torch.rand(1), expected)  # the global generator did not move
    second = gb.calibrate(gparams, plan, model, x)
    assert torch.equal(first["free"]["3.bias"], second["free"]["3.bias"])
    assert model[1].training  # switched back on
    out = functional_call(model.eval(), gb.apply(first, plan), (x,))
    assert (out.detach().mean(0).abs() < 1e-5).all()
