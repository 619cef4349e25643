"""Numeric arguments (issue 53 row 12): any finite real number is taken, as the Python number
it equals; inf, NaN and bools are refused, naming the argument."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

import gbfunc as gb
import gbfunc.dist as gbd
from gbfunc._numbers import as_finite, as_integer, integer, real

INTEGERS = [3, np.int64(3), np.int32(3), np.uint8(3), torch.tensor(3), torch.tensor(3).byte()]
NOT_INTEGERS = [
    True,
    np.bool_(True),
    3.0,
    np.float32(3),
    "3",
    None,
    Fraction(3),
    torch.tensor(3.0),
    torch.tensor([3]),
    torch.tensor(True),
]
REALS = [
    (0.5, 0.5),
    (2, 2),
    (np.float32(0.5), 0.5),
    (np.float64(0.25), 0.25),
    (np.int64(2), 2),
    (torch.tensor(0.5), 0.5),
    (torch.tensor(2), 2),
    (torch.tensor(0.5, dtype=torch.float64, requires_grad=True), 0.5),
    (Fraction(1, 4), 0.25),
]
NOT_REALS = [
    True,
    np.bool_(False),
    "1",
    None,
    1j,
    torch.tensor([1.0]),
    torch.tensor(True),
    torch.tensor(1 + 1j),
    torch.empty((), device="meta"),
]
NOT_FINITE = [
    math.inf,
    -math.inf,
    math.nan,
    np.float32("inf"),
    np.float64("nan"),
    torch.tensor(math.inf),
    torch.tensor(math.nan),
    10**400,
    Fraction(10**400, 3),
]


@pytest.mark.parametrize("value", INTEGERS, ids=repr)
def test_integers_of_any_kind_become_python_ints(value):
    got = integer("gb.f", "n", value, minimum=1)
    assert type(got) is int
    assert got == 3
    assert as_integer(value) == 3


@pytest.mark.parametrize("value", NOT_INTEGERS, ids=repr)
def test_other_kinds_are_not_integers(value):
    assert as_integer(value) is None
    with pytest.raises(TypeError, match=r"^gb\.f: n must be an integer >= 1, got .*\.$"):
        integer("gb.f", "n", value, minimum=1)


def test_an_integer_out_of_range_is_a_value_error_naming_the_range():
    with pytest.raises(
        ValueError, match=r"^gb\.f: n must be an integer >= 1, got np\.int64\(0\)\.$"
    ):
        integer("gb.f", "n", np.int64(0), minimum=1)
    with pytest.raises(ValueError, match=r"must be an integer in \[-2\*\*63, 2\*\*64 - 1\], got"):
        integer("gb.f", "n", 2**64, minimum=-(2**63), maximum=2**64 - 1)
    with pytest.raises(ValueError, match=r"n must be an integer in \[0, 7\] or None, got 8\.$"):
        integer("gb.f", "n", 8, minimum=0, maximum=7, optional=True)
    assert integer("gb.f", "n", None, optional=True) is None


@pytest.mark.parametrize(("value", "want"), REALS, ids=repr)
def test_reals_of_any_kind_become_python_numbers(value, want):
    got = real("gb.f", "x", value, above=0)
    assert got == want
    assert type(got) is type(want)
    assert as_finite(value) == want


@pytest.mark.parametrize("value", NOT_REALS, ids=repr)
def test_other_kinds_are_not_real_numbers(value):
    assert as_finite(value) is None
    with pytest.raises(TypeError, match=r"^gb\.f: x must be a number > 0, got .*\.$"):
        real("gb.f", "x", value, above=0)


@pytest.mark.parametrize("value", NOT_FINITE, ids=lambda v: f"{v!r:.40}")
def test_inf_and_nan_are_refused(value):
    assert as_finite(value) is None
    with pytest.raises(ValueError, match=r"^gb\.f: x must be a finite number >= 1, got .*\.$"):
        real("gb.f", "x", value, minimum=1)


def test_a_real_out_of_range_is_a_value_error():
    with pytest.raises(ValueError, match=r"^gb\.f: x must be a number > 0 or None, got 0\.$"):
        real("gb.f", "x", 0, above=0, optional=True)
    with pytest.raises(ValueError, match=r"x must be a number >= 1, got np\.float32\(0\.5\)\.$"):
        real("gb.f", "x", np.float32(0.5), minimum=1)
    assert real("gb.f", "x", None, optional=True) is None


# ------------------------------------------------------------------ through the public API


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8))


@pytest.fixture(scope="module")
def planned() -> tuple[gb.Plan, dict]:
    plan = gb.plan(small(), tile=(16, 16), hidden=4)
    return plan, gb.init(plan)


@pytest.mark.parametrize(("value", "want"), REALS, ids=repr)
@pytest.mark.parametrize("name", ["free_lr", "scale"])
def test_param_groups_take_any_real_rate(planned, name, value, want):
    plan, gparams = planned
    kwargs = {"free_lr": 1e-3, "scale": 1.0, name: value}
    groups = gb.optim.param_groups(gparams, plan, **kwargs)
    expected = gb.optim.param_groups(gparams, plan, **{**kwargs, name: want})
    assert [g["lr"] for g in groups] == [g["lr"] for g in expected]
    assert all(type(g["lr"]) in (int, float) for g in groups)


@pytest.mark.parametrize("value", [math.inf, math.nan, np.float32("inf"), torch.tensor(math.nan)])
@pytest.mark.parametrize("name", ["free_lr", "scale"])
def test_param_groups_refuse_inf_and_nan(planned, name, value):
    plan, gparams = planned
    match = rf"^gb\.optim\.param_groups: {name} must be a finite number > 0, got "
    with pytest.raises(ValueError, match=match):
        gb.optim.param_groups(gparams, plan, **{"free_lr": 1e-3, name: value})


@pytest.mark.parametrize("name", ["free_lr", "scale"])
def test_param_groups_refuse_bools(planned, name):
    plan, gparams = planned
    with pytest.raises(TypeError, match=rf"{name} must be a number > 0, got True"):
        gb.optim.param_groups(gparams, plan, **{"free_lr": 1e-3, name: True})


@pytest.mark.parametrize("value", [np.float32(10), np.int64(10), torch.tensor(10.0), Fraction(10)])
def test_plan_takes_any_real_compression(value):
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64))
    plan = gb.plan(model, compression=value)
    assert plan == gb.plan(model, compression=10)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (math.inf, ValueError, "compression must be a finite number >= 1 or None, got inf"),
        (math.nan, ValueError, "compression must be a finite number >= 1 or None, got nan"),
        (True, TypeError, "compression must be a number >= 1 or None, got True"),
    ],
)
def test_plan_refuses_inf_nan_and_bool_compression(value, error, match):
    with pytest.raises(error, match=rf"^gb\.plan: {match}\.$"):
        gb.plan(small(), compression=value)


def test_shapes_and_counts_take_numpy_and_tensor_integers(tmp_path):
    """The plan is the one Python ints give, and saves (JSON holds Python numbers only)."""
    model = small()
    depth = {"0.*": {"depth": torch.tensor(2)}}
    plan = gb.plan(
        model, tile=(np.int64(16), torch.tensor(16)), hidden=np.int32(4), overrides=depth
    )
    assert plan == gb.plan(model, tile=(16, 16), hidden=4, overrides={"0.*": {"depth": 2}})
    grid = gb.plan(model, tile="full", overrides={"0.*": {"col_labels": [np.int64(8), 8]}})
    assert grid == gb.plan(model, tile="full", overrides={"0.*": {"col_labels": (8, 8)}})
    gparams = gb.init(plan, seed=np.int64(7))
    same = gb.init(plan, seed=7)
    assert all(
        torch.equal(a, b)
        for a, b in zip(gb.trainable_leaves(gparams), gb.trainable_leaves(same), strict=True)
    )
    gb.save(tmp_path / "c", gparams, plan, step=np.int64(5))
    loaded = gb.load(tmp_path / "c", model)
    assert loaded.step == 5
    assert type(loaded.step) is int
    assert gbd.mesh_shape(np.int64(8), tp=torch.tensor(2)) == gbd.MeshShape(4, 2, 1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"steps": np.int64(0)}, ValueError, r"gb\.fit: steps must be an integer >= 1, got"),
        ({"steps": True}, TypeError, r"gb\.fit: steps must be an integer >= 1, got True"),
        ({"lr": math.inf}, ValueError, r"gb\.fit: lr must be a finite number > 0 or None"),
    ],
)
def test_fit_refuses_bad_steps_and_rates(planned, kwargs, error, match):
    plan, gparams = planned
    with pytest.raises(error, match=match):
        gb.fit(gparams, plan, dict(small().named_parameters()), **kwargs)


def test_fit_takes_numpy_steps_and_rates(planned):
    plan, gparams = planned
    target = dict(small().named_parameters())
    fitted = gb.fit(gparams, plan, target, steps=np.int64(2), lr=np.float32(1e-2))
    assert set(fitted.errors) == {p.name for p in plan.generated}
