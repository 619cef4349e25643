"""Golden values: what gbfunc generates for fixed models, plans and seeds, and a checkpoint
written by every checkpoint format version, all committed, so any change of initialisation,
generation or file format that keeps shapes and variance still fails here.

The models are built on the `meta` device, so every value comes from gbfunc alone (seeded
g-nets, free parameters drawn by their modules' rules, scales from the rules).

A deliberate change regenerates the files (and says so in its commit):

    python tests/test_golden.py --regenerate

It rewrites the values and the current format's checkpoint; older versions' files stay as
they were written, since this gbfunc cannot write them any more.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gbfunc as gb
from gbfunc._checkpoint import FORMAT_VERSION, READABLE_VERSIONS

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "generated.json"


def checkpoint(version: int) -> Path:
    return HERE / "fixtures" / f"checkpoint_v{version}.safetensors"


def cases() -> dict[str, tuple[nn.Module, dict]]:
    with torch.device("meta"):
        return {
            "linear": (nn.Linear(20, 12), {"tile": (8, 8)}),
            "conv2d": (nn.Conv2d(3, 8, 3), {"tile": (4, 2), "encoding": "gray"}),
            "transformer": (
                nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                {"tile": (8, 8), "hidden": 8, "outputs": 2},
            ),
            "shared": (
                nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 4)),
                {"tile": (8, 8), "share": True, "hidden": 6, "activation": "tanh"},
            ),
            "deep-gelu": (
                nn.Linear(10, 6),
                {"tile": (4, 4), "depth": 2, "hidden": 6, "activation": "gelu"},
            ),
            "paper": (
                nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3)),
                {
                    "tile": "full",
                    "encoding": "gray",
                    "biases": True,
                    "center": True,
                    "hidden": 5,
                    "overrides": {
                        "1.weight": {"col_labels": (4, 4)},
                        "3.*": {"row_labels": "onehot"},
                    },
                },
            ),
        }


def generated(name: str) -> dict[str, torch.Tensor]:
    model, options = cases()[name]
    plan = gb.plan(model, **options)
    with torch.no_grad():
        return gb.apply(gb.init(plan, seed=7, dtype=torch.float64, requires_grad=False), plan)


def summary(values: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Shape, first values, sum, sum of squares and a projection of every parameter.

    Sums miss values that trade places, and generated rows are often centred and normalised
    (sum 0, fixed sum of squares); the projection on `cos(0.7 i)` weighs every position
    differently, so moving a value changes it.
    """
    return {
        key: {
            "shape": list(v.shape),
            "first": [round(float(x), 10) for x in v.flatten()[:6]],
            "sum": float(v.sum()),
            "sum_sq": float(v.square().sum()),
            "projection": float((v.flatten() * _positions(v.numel(), v.dtype)).sum()),
        }
        for key, v in values.items()
    }


def _positions(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.cos(0.7 * torch.arange(n, dtype=torch.float64)).to(dtype)


def assert_matches_summary(got: dict[str, dict], expected: dict[str, dict], name: str) -> None:
    """`summary`s equal up to rounding: float sums differ in their last bits across CPUs and
    torch versions (vector widths, summation order), and nothing more may differ."""
    assert list(got) == list(expected), name
    for key, want in expected.items():
        have = got[key]
        where = f"{name}/{key}: regenerate deliberately with `python tests/test_golden.py "
        where += "--regenerate` if the change is intended"
        assert have["shape"] == want["shape"], where
        for a, b in zip(have["first"], want["first"], strict=True):
            assert abs(a - b) <= 1e-6, where
        for stat in ("sum", "sum_sq", "projection"):
            assert abs(have[stat] - want[stat]) <= 1e-6 * max(1.0, abs(want[stat])), where


def test_generated_values_match_the_golden_file():
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == sorted(cases())
    for name, expected in golden.items():
        assert_matches_summary(summary(generated(name)), expected, name)


@pytest.mark.parametrize("version", READABLE_VERSIONS)
def test_a_checkpoint_of_every_readable_version_loads_and_generates_the_same_weights(version):
    model, options = cases()["transformer"]
    ckpt = gb.load(checkpoint(version), model)
    assert ckpt.step == 3
    assert ckpt.meta == {"written_by": "tests/test_golden.py", "format_version": version}
    assert ckpt.plan == gb.plan(model, **options)
    expected = json.loads(GOLDEN.with_name(f"checkpoint_v{version}.json").read_text())
    assert_matches_summary(_weights_summary(ckpt), expected["summary"], f"checkpoint v{version}")
    assert ckpt.opt_state["step"] == 3


def _weights_summary(ckpt: gb.Checkpoint) -> dict[str, dict]:
    with torch.no_grad():
        params = gb.apply(ckpt.gparams, ckpt.plan)
    return summary({key: p.detach().double() for key, p in params.items()})


def regenerate() -> None:
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({n: summary(generated(n)) for n in cases()}, indent=1) + "\n")
    model, options = cases()["transformer"]
    plan = gb.plan(model, **options)
    gparams = gb.init(plan, seed=7)
    path = checkpoint(FORMAT_VERSION)
    path.parent.mkdir(exist_ok=True)
    meta = {"written_by": "tests/test_golden.py", "format_version": FORMAT_VERSION}
    gb.save(path, gparams, plan, opt_state={"step": 3}, step=3, meta=meta)
    weights = _weights_summary(gb.load(path, model))
    golden = GOLDEN.with_name(f"checkpoint_v{FORMAT_VERSION}.json")
    golden.write_text(json.dumps({"summary": weights}, indent=1) + "\n")
    print(f"wrote {GOLDEN}, {path}, {golden}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        raise SystemExit(__doc__)
    regenerate()
