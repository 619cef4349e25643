"""Malformed inputs across the public API: each raises its own exception naming the culprit.

Plus the inputs that look suspicious but are valid: tied and duplicated parameters are
generated once and stay tied; frozen parameters pass through untouched.
"""

import errno
import re
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
from forged import Change, forge, in_plan
from torch import nn
from torch.func import functional_call

import gbfunc as gb
from gbfunc.compat import GenomicBottleneck


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))


def frozen_linear() -> nn.Module:
    model = nn.Linear(8, 4)
    model.weight.requires_grad_(False)
    return model


PLAN = gb.plan(mlp(), tile=(4, 4))
S0 = PLAN.stacks[0].key


def gparams(**kwargs) -> dict:
    return gb.init(PLAN, **kwargs)


def replace_leaf(group: str, key: str, leaf: str | None, value: object) -> dict:
    """`gb.init(PLAN)` with one leaf replaced."""
    g = gparams()
    node = g[group] if leaf is None else g[group][key]
    node[leaf if leaf is not None else key] = value
    return g


def with_stack_leaf(leaf: str, fn: Callable[[torch.Tensor], object]) -> dict:
    g = gparams()
    g["stacks"][S0][leaf] = fn(g["stacks"][S0][leaf].detach())
    return g


def without(leaf: str) -> dict:
    g = gparams()
    del g["stacks"][S0][leaf]
    return g


def nan_in(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def empty_linear() -> nn.Module:
    """`nn.Linear(0, 5)`, without PyTorch's warning that initialising it does nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return nn.Linear(0, 5)


def int64_bias(tensors: dict, metadata: dict) -> None:
    tensors["free/0.bias"] = tensors["free/0.bias"].to(torch.int64)


# Crafted checkpoints of PLAN (one stack of 4x4 tiles: 0-3 for '0.weight', 4-5 for '2.weight')
# whose hashes were recomputed, by file name.
FORGED: dict[str, Change] = {
    "tile": in_plan(lambda d: d["stacks"][0].update(tile=[65536, 65536])),
    "nan-scale": in_plan(lambda d: d["params"][0].update(scale=float("nan"))),
    "shared-tiles": in_plan(lambda d: d["params"][2]["blocks"][0].update(first_tile=0)),
    "stack-index": in_plan(lambda d: d["params"][0].update(stack_index=1)),
    "split-dim": in_plan(lambda d: d["params"][0].update(split_dim=2)),
    "negative-count": in_plan(lambda d: d["stacks"][0].update(tiles_per_gnet=[-1] * 6)),
    "unused-stack": in_plan(lambda d: d["stacks"].append({**d["stacks"][0], "key": "extra"})),
    "step": lambda tensors, metadata: metadata.update(step='"abc"'),
    "int64": int64_bias,
    "huge-scale": in_plan(lambda d: d["params"][0].update(scale=1e308)),
    "float64-dtype": in_plan(lambda d: d["params"][0].update(dtype="float64")),
    "float16-free": lambda tensors, metadata: tensors.update(
        {"free/0.bias": tensors["free/0.bias"].half()}
    ),
}


def with_extra_free() -> dict:
    g = gparams()
    g["free"]["ghost.bias"] = torch.zeros(3)
    return g


@dataclass(frozen=True)
class Case:
    call: Callable[[], object]
    error: type[Exception]
    match: str


def corrupt_load(tmp: Path | None, name: str, match: str) -> Case:
    """`gb.load` of the damaged or forged file `tmp / name`: a `gb.CheckpointCorruptError`."""
    return Case(lambda: gb.load(tmp / name, mlp()), gb.CheckpointCorruptError, match)


def cases(tmp) -> dict[str, Case]:
    """`tmp` is a folder with `ok.safetensors` (a checkpoint of `mlp()`) and `dense.safetensors`."""
    meta_g = gparams(device="meta")
    return {
        **_plan_cases_1(tmp),
        **_plan_cases_2(tmp),
        **_init_cases(tmp),
        **_apply_cases_1(tmp, meta_g),
        **_apply_cases_2(tmp),
        **_report_cases(tmp),
        **_save_load_cases_1(tmp, meta_g),
        **_save_load_cases_2(tmp),
        **_save_load_cases_3(tmp),
        **_export_save_dense_cases(tmp, meta_g),
        **_compat_cases(tmp),
        **_probe_cases(tmp),
        **_round_four_cases(tmp),
    }


def _probe_cases(tmp: Path | None) -> dict[str, Case]:
    """Issue 47's held-out probes, one row each."""
    float64_free = gparams()
    float64_free["free"]["0.bias"] = float64_free["free"]["0.bias"].double()
    return {
        "load-forged-huge-scale": corrupt_load(
            tmp,
            "huge-scale.safetensors",
            r"params\[0\] \('0.weight'\).scale is 1e\+308; expected a number in "
            r"\(0, 3.40282e\+38\], the largest float32",
        ),
        "load-float16-free-tensor": corrupt_load(
            tmp,
            "float16-free.safetensors",
            r"gparams\['free'\]\['0.bias'\] has dtype torch.float16 but .* is torch.float32",
        ),
        "apply-float64-free-tensor": Case(
            lambda: gb.apply(float64_free, PLAN),
            TypeError,
            r"gb.apply: gparams\['free'\]\['0.bias'\] has dtype torch.float64 but",
        ),
        "load-forged-dtype": Case(
            lambda: gb.load(tmp / "float64-dtype.safetensors", mlp()),
            gb.CheckpointMismatchError,
            r"parameter '0.weight' has dtype 'float64' in the checkpoint but 'float32' in the "
            "model",
        ),
        "save-into-missing-folder": Case(
            lambda: gb.save(tmp / "missing" / "x.safetensors", gparams(), PLAN),
            gb.CheckpointError,
            r"missing/x.safetensors: cannot be written \(No such file or directory\)",
        ),
        "save-onto-a-folder": Case(
            lambda: gb.save(tmp, gparams(), PLAN),
            gb.CheckpointError,
            r"cannot be written \(not a regular file but a directory\)",
        ),
        "save-nul-in-path": Case(
            lambda: gb.save(f"{tmp}/a\0b.safetensors", gparams(), PLAN),
            gb.CheckpointError,
            r"gb.save: path .* contains a NUL byte",
        ),
        "load-nul-in-path": Case(
            lambda: gb.load(f"{tmp}/a\0b.safetensors", mlp()),
            gb.CheckpointError,
            r"gb.load: path .* contains a NUL byte",
        ),
        "save-sparse-opt-state": Case(
            lambda: gb.save(
                tmp / "x.safetensors", gparams(), PLAN, opt_state={"m": torch.eye(3).to_sparse()}
            ),
            TypeError,
            r"gb.save: opt_state\['m'\] is a sparse_coo tensor; only dense",
        ),
        "init-seed-out-of-range": Case(
            lambda: gb.init(PLAN, seed=2**70),
            ValueError,
            r"gb.init: seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\], "
            r"got 1180591620717411303424",
        ),
        "plan-gnets-larger-than-the-model": Case(
            lambda: gb.plan(mlp(), tile=(16, 16), hidden=10**9),
            ValueError,
            r"the g-nets would hold [\d,]+ parameters to generate 72 weights .*hidden=1000000000",
        ),
        "plan-task-embeddings-larger-than-the-model": Case(
            lambda: gb.plan(mlp(), tile=(4, 4), hidden=5, condition=1024, tasks=10**7),
            ValueError,
            r"gb.plan: the genome would hold [\d,]+ parameters to generate 72 weights, "
            r"10,240,000,000 of them task embeddings \(tasks=10000000 x condition=1024\); "
            r"lower tasks or condition\.",
        ),
        "bottleneck-misspelt-option": Case(
            lambda: gb.Bottleneck(mlp(), hiden=8),
            TypeError,
            r"gb.Bottleneck: unknown option 'hiden'; did you mean 'hidden'\?",
        ),
    }


def plan_with_rule(rule: Callable[[nn.Module], object]) -> gb.Plan:
    """`gb.plan` of an `nn.Linear(8, 4)` subclass `M` made for this call, `rule` registered
    for it (so no other test's modules see the rule)."""
    cls = type("M", (nn.Linear,), {})
    gb.register_rule(cls, rule)
    return gb.plan(cls(8, 4))


class Exp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.exp()


def calibrate_mlp(x: torch.Tensor) -> None:
    """`Bottleneck.calibrate` on `x`, checking that a refused call wrote nothing."""
    b = gb.Bottleneck(mlp(), tile=(4, 4))
    before = {k: v.clone() for k, v in b.state_dict().items()}
    try:
        b.calibrate(x)
    finally:
        assert all(torch.equal(v, before[k]) for k, v in b.state_dict().items())


def _round_four_cases(tmp: Path | None) -> dict[str, Case]:
    """Issue 53's held-out probes, rows 9-10 and 15-16."""
    nan_batch = torch.ones(4, 8)
    nan_batch[1, 2] = float("nan")
    overflowing = nn.Sequential(Exp(), nn.Linear(8, 4))  # finite inputs, infinite outputs
    overflowing_plan = gb.plan(overflowing, tile=(4, 4))
    return {
        "bottleneck-calibrate-empty-batch": Case(
            lambda: calibrate_mlp(torch.zeros(0, 8)),
            ValueError,
            r"gb.Bottleneck.calibrate: inputs\[0\] is empty \(shape \(0, 8\)\); pass a batch",
        ),
        "bottleneck-calibrate-nan-batch": Case(
            lambda: calibrate_mlp(nan_batch),
            ValueError,
            r"gb.Bottleneck.calibrate: inputs\[0\] holds 1 NaN or infinite value\(s\) of 32",
        ),
        "calibrate-inf-batch": Case(
            lambda: gb.calibrate(gparams(), PLAN, mlp(), torch.full((2, 8), float("inf"))),
            ValueError,
            r"gb.calibrate: inputs holds 16 NaN or infinite value\(s\) of 16",
        ),
        "calibrate-no-inputs": Case(
            lambda: gb.calibrate(gparams(), PLAN, mlp(), ()),
            ValueError,
            r"gb.calibrate: inputs is empty; pass a batch of data",
        ),
        "calibrate-infinite-layer-outputs": Case(
            lambda: gb.calibrate(
                gb.init(overflowing_plan), overflowing_plan, overflowing, torch.full((2, 8), 100.0)
            ),
            ValueError,
            r"gb.calibrate: layer '1' has non-finite outputs on inputs .* nothing was changed",
        ),
        "rule-returns-an-int": Case(
            lambda: plan_with_rule(lambda m: 5),
            TypeError,
            r"gb.plan: the rule \S*test_bad_input\.\S*<lambda> registered for M returned 5; a rule "
            r"must return a dict \{local parameter name: gb.Layout\(...\)\} naming some of the "
            r"module's own parameters \(weight, bias\)",
        ),
        "rule-returns-an-unknown-name": Case(
            lambda: plan_with_rule(lambda m: {"weights": gb.Layout(0.1)}),
            ValueError,
            r"gb.plan: the rule \S*test_bad_input\.\S*<lambda> registered for M returned the key "
            r"'weights'; a rule must return",
        ),
        "rule-returns-a-float-layout": Case(
            lambda: plan_with_rule(lambda m: {"weight": 0.1}),
            TypeError,
            r"registered for M returned 0.1 for 'weight'; a rule must return a dict",
        ),
        "rule-splits-do-not-divide": Case(
            lambda: plan_with_rule(lambda m: {"weight": gb.Layout(0.1, splits=3)}),
            ValueError,
            r"registered for M returned splits=3 along dim 0 for 'weight' of shape \(4, 8\); "
            r"the splits must divide",
        ),
        "rule-splits-a-vector": Case(
            lambda: plan_with_rule(lambda m: {"bias": gb.Layout(0.1, splits=2, split_dim=1)}),
            ValueError,
            r"registered for M returned splits=2 for 'bias' of shape \(4,\); only a matrix",
        ),
        "rule-bias-on-a-matrix": Case(
            lambda: plan_with_rule(lambda m: {"weight": gb.Layout(0.1, bias=True)}),
            ValueError,
            r"registered for M returned bias=True for 'weight' of shape \(4, 8\); a bias is a "
            r"vector",
        ),
        "layout-zero-std": Case(
            lambda: gb.Layout(init_std=0.0),
            ValueError,
            r"gb.Layout: init_std must be a number > 0, got 0.0",
        ),
        "layout-bad-split-dim": Case(
            lambda: gb.Layout(0.1, split_dim=2), ValueError, r"gb.Layout: split_dim must be 0 or 1"
        ),
        "layout-int-bias-flag": Case(
            lambda: gb.Layout(0.1, bias=1), TypeError, r"gb.Layout: bias must be a bool, got 1"
        ),
        "explain-compile-not-a-bool": Case(
            lambda: gb.explain(gparams(), PLAN, compile="yes"),
            TypeError,
            r"gb.explain: compile must be True, False or None, got 'yes'",
        ),
        "explain-unknown-backend": Case(
            lambda: gb.explain(gparams(), PLAN, backend="cuda"),
            ValueError,
            r"gb.explain: backend must be one of \('auto', 'torch', 'triton'\), got 'cuda'",
        ),
    }


def _plan_cases_1(tmp: Path | None) -> dict[str, Case]:
    return {
        # gb.plan
        "plan-not-a-module": Case(
            lambda: gb.plan("mlp"), TypeError, "gb.plan: model must be an nn.Module, got str"
        ),
        "plan-empty-model": Case(
            lambda: gb.plan(nn.Sequential()), ValueError, "Sequential has no parameters to generate"
        ),
        "plan-nothing-generatable": Case(
            lambda: gb.plan(nn.LayerNorm(4)),
            ValueError,
            "LayerNorm has no parameter to generate.*no rule for LayerNorm",
        ),
        "plan-all-frozen": Case(
            lambda: gb.plan(frozen_linear()),
            ValueError,
            r"no parameter to generate.*frozen \(requires_grad=False\)",
        ),
        "plan-zero-tile": Case(
            lambda: gb.plan(mlp(), tile=(0, 4)), ValueError, r"tile must be .*got \(0, 4\)"
        ),
        "plan-float-tile": Case(
            lambda: gb.plan(mlp(), tile=(2.0, 4)), TypeError, r"tile must be .*got \(2.0, 4\)"
        ),
        "plan-bad-hidden": Case(
            lambda: gb.plan(mlp(), hidden=0), ValueError, "hidden must be an integer >= 1, got 0"
        ),
        "plan-unmatched-pattern": Case(
            lambda: gb.plan(mlp(), free=["decoder.*"]),
            ValueError,
            r"pattern 'decoder\.\*' matches no parameter",
        ),
        "plan-negative-compression": Case(
            lambda: gb.plan(mlp(), compression=-1),
            ValueError,
            "compression must be a number >= 1 or None, got -1",
        ),
        "plan-compression-below-one": Case(
            lambda: gb.plan(mlp(), compression=0.5), ValueError, "compression must be a number >= 1"
        ),
        "plan-free-none": Case(
            lambda: gb.plan(mlp(), free=None), TypeError, r"gb\.plan: free must be a sequence"
        ),
        "plan-free-int": Case(
            lambda: gb.plan(mlp(), free=[5]), TypeError, r"gb\.plan: free must be a sequence"
        ),
    }


def _plan_cases_2(tmp: Path | None) -> dict[str, Case]:
    return {
        "plan-override-int-key": Case(
            lambda: gb.plan(mlp(), overrides={5: {"hidden": 2}}),
            TypeError,
            r"gb\.plan: overrides keys must be name patterns",
        ),
        "plan-outputs-wider-than-tile": Case(
            lambda: gb.plan(mlp(), tile=(4, 4), outputs=8),
            ValueError,
            r"outputs=8 is wider than its tile's 4 columns",
        ),
        "plan-outputs-wider-than-the-cut-tile": Case(  # docs/training.md's row g-nets, small
            lambda: gb.plan(mlp(), tile=(128, 128), hidden=8, outputs=128),
            ValueError,
            r"0\.weight: outputs=128 is wider than its tile's 8 columns \(the tile \(128, 128\) "
            r"cut to it\); .* for this one: overrides=\{'0\.weight': \{'outputs': 8\}\}\.",
        ),
        "genome-share-not-bool": Case(
            lambda: gb.Genome(share="yes"), TypeError, r"gb\.Genome: share must be a bool"
        ),
        "load-device-file": Case(
            lambda: gb.load("/dev/zero", mlp()), gb.CheckpointError, "not a regular file"
        ),
        "plan-empty-linear": Case(
            lambda: gb.plan(empty_linear()),
            ValueError,
            r"Linear has no parameter to generate: every parameter is free \(.*empty",
        ),
        "plan-empty-embedding": Case(
            lambda: gb.plan(nn.Embedding(0, 4), embeddings=True),
            ValueError,
            r"Embedding has no parameter to generate: every parameter is free \(empty",
        ),
        "plan-override-bad-hidden": Case(
            lambda: gb.plan(mlp(), overrides={"0.*": {"hidden": "8"}}),
            TypeError,
            r"gb.plan: overrides\['0.\*'\]\['hidden'\] must be an integer >= 1, got '8'",
        ),
        "genome-bad-hidden": Case(
            lambda: gb.Genome(hidden=0), ValueError, "gb.Genome: hidden must be an integer >= 1"
        ),
        "genome-float-outputs": Case(
            lambda: gb.Genome(outputs=2.0),
            TypeError,
            "gb.Genome: outputs must be an integer >= 1, got 2.0",
        ),
        "plan-dataparallel": Case(
            lambda: gb.plan(nn.DataParallel(mlp())),
            TypeError,
            "wrapped in DataParallel; pass model.module",
        ),
        "plan-compiled": Case(
            lambda: gb.plan(torch.compile(mlp())),
            TypeError,
            r"torch.compile'd OptimizedModule; pass model._orig_mod",
        ),
        "plan-lazy": Case(
            lambda: gb.plan(nn.Sequential(nn.LazyLinear(8), nn.Linear(8, 4)), tile=(4, 4)),
            ValueError,
            r"gb.plan: parameter '0.weight' is uninitialised \(a lazy module such as "
            r"nn.LazyLinear\): run one forward pass",
        ),
    }


def _init_cases(tmp: Path | None) -> dict[str, Case]:
    return {
        # gb.init
        "init-not-a-plan": Case(
            lambda: gb.init(mlp()), TypeError, "gb.init: plan must be a gb.Plan .*got Sequential"
        ),
        "init-requires-grad-not-a-bool": Case(
            lambda: gparams(requires_grad=0), TypeError, r"gb.init: requires_grad must be a bool"
        ),
        "init-int-dtype": Case(
            lambda: gparams(dtype=torch.int32),
            TypeError,
            r"dtype must be one of torch\.float16, .*torch\.float64 or None, got torch\.int32",
        ),
        "init-str-dtype": Case(
            lambda: gparams(dtype="float32"), TypeError, "or None, got 'float32'"
        ),
        "init-float8-dtype": Case(  # accepted, then gb.apply failed in torch's bmm
            lambda: gparams(dtype=torch.float8_e4m3fn), TypeError, "or None, got torch.float8"
        ),
        "init-float-seed": Case(
            lambda: gparams(seed=1.5), TypeError, r"seed must be an integer in \[.*\], got 1\.5"
        ),
        # torch's errors named neither the call nor the parameter (an AssertionError for CUDA)
        "init-unknown-device": Case(
            lambda: gparams(device="gpu"), ValueError, r"^gb.init: device='gpu' is not a device"
        ),
        "init-absent-device": Case(
            lambda: gparams(device="xpu:3"),
            ValueError,
            r"^gb.init: device='xpu:3' is not available in this process",
        ),
        "init-float-device": Case(
            lambda: gparams(device=1.0), TypeError, r"^gb.init: device must be a torch.device"
        ),
    }


def _apply_cases_1(tmp: Path | None, meta_g: dict) -> dict[str, Case]:
    return {
        # gb.apply
        "apply-not-a-plan": Case(
            lambda: gb.apply(gparams(), "plan"), TypeError, "gb.apply: plan must be a gb.Plan"
        ),
        "apply-list-gparams": Case(
            lambda: gb.apply([], PLAN), TypeError, "gparams must be the dict made by gb.init"
        ),
        "apply-wrong-shape": Case(
            lambda: gb.apply(with_stack_leaf("w_in", lambda t: t[:, :1]), PLAN),
            ValueError,
            rf"gparams\['stacks'\]\['{S0}'\]\['w_in'\] has shape \(\d+, 1, 32\); "
            r"expected \(\d+, 4, 32\)",
        ),
        "apply-int-dtype": Case(
            lambda: gb.apply(with_stack_leaf("b_in", lambda t: t.long()), PLAN),
            TypeError,
            rf"\['{S0}'\]\['b_in'\] has dtype torch.int64; expected a floating dtype",
        ),
        "apply-mixed-dtypes": Case(
            lambda: gb.apply(with_stack_leaf("w_out", lambda t: t.double()), PLAN),
            ValueError,
            rf"\['{S0}'\]\['w_out'\] is torch.float64 on cpu but .*\['w_in'\] is torch.float32 "
            "on cpu",
        ),
        "apply-one-meta-leaf": Case(
            lambda: gb.apply(with_stack_leaf("w_out", lambda t: t.to("meta")), PLAN),
            ValueError,
            rf"\['{S0}'\]\['w_out'\] is torch.float32 on meta but",
        ),
        "apply-check-meta": Case(
            lambda: gb.apply(meta_g, PLAN, check=True),
            ValueError,
            r"\['w_in'\] is on the meta device: it has no values",
        ),
        "apply-check-nan": Case(
            lambda: gb.apply(with_stack_leaf("w_in", nan_in), PLAN, check=True),
            ValueError,
            rf"gparams\['stacks'\]\['{S0}'\]\['w_in'\] contains NaN or inf",
        ),
        "apply-check-inf-free": Case(
            lambda: gb.apply(
                replace_leaf("free", "0.bias", None, torch.full((6,), float("inf"))),
                PLAN,
                check=True,
            ),
            ValueError,
            r"gparams\['free'\]\['0.bias'\] contains NaN or inf",
        ),
    }


def _apply_cases_2(tmp: Path | None) -> dict[str, Case]:
    return {
        "apply-free-not-tensor": Case(
            lambda: gb.apply(replace_leaf("free", "0.bias", None, [0.0] * 6), PLAN),
            TypeError,
            r"gparams\['free'\]\['0.bias'\] must be a Tensor, got list",
        ),
        "apply-missing-leaf": Case(
            lambda: gb.apply(without("b_out"), PLAN),
            ValueError,
            rf"gparams\['stacks'\]\['{S0}'\]\['b_out'\] is missing",
        ),
        "apply-extra-leaf": Case(
            lambda: gb.apply(with_extra_free(), PLAN),
            ValueError,
            r"gparams\['free'\]\['ghost.bias'\] is not in the plan",
        ),
        "apply-other-plan": Case(
            lambda: gb.apply(gparams(), gb.plan(mlp(), tile=(2, 2))),
            ValueError,
            "Were these gparams made by gb.init with a different plan",
        ),
    }


def _report_cases(tmp: Path | None) -> dict[str, Case]:
    return {
        # gb.report
        "report-model": Case(
            lambda: gb.report(mlp()), TypeError, r"got Sequential. Pass gb.plan\(model\) instead"
        ),
        "report-none": Case(
            lambda: gb.report(None), TypeError, "gb.report: plan must be a gb.Plan, got NoneType"
        ),
        "report-bottleneck": Case(
            lambda: gb.report(gb.Bottleneck(mlp(), tile=(4, 4))),
            TypeError,
            r"got Bottleneck. Pass its .plan, or call its .report\(\)",
        ),
    }


def _save_load_cases_1(tmp: Path | None, meta_g: dict) -> dict[str, Case]:
    return {
        # gb.save / gb.load
        "save-meta-gparams": Case(
            lambda: gb.save(tmp / "x.safetensors", meta_g, PLAN),
            ValueError,
            r"gb.save: gparams\['stacks'\].* is on the meta device",
        ),
        "save-negative-step": Case(
            lambda: gb.save(tmp / "x.safetensors", gparams(), PLAN, step=-1),
            ValueError,
            "step must be an integer >= 0 or None, got -1",
        ),
        "save-meta-not-json": Case(
            lambda: gb.save(tmp / "x.safetensors", gparams(), PLAN, meta={"f": object()}),
            TypeError,
            "meta must be JSON-serialisable",
        ),
        "save-opt-state-function": Case(
            lambda: gb.save(
                tmp / "x.safetensors", gparams(), PLAN, opt_state={"state": {0: {"fn": print}}}
            ),
            TypeError,
            r"gb.save: opt_state\['state'\]\[0\]\['fn'\] is a builtin_function_or_method",
        ),
        "save-opt-state-tuple-key": Case(
            lambda: gb.save(tmp / "x.safetensors", gparams(), PLAN, opt_state={(1, 2): 0}),
            TypeError,
            r"opt_state has key \(1, 2\); only str and int keys",
        ),
        "load-missing-file": Case(
            lambda: gb.load(tmp / "none.safetensors", mlp()),
            gb.CheckpointNotFoundError,
            "none.safetensors: no such file",
        ),
        "load-unknown-device-before-reading": Case(  # checked before the file (none here)
            lambda: gb.load(tmp / "none.safetensors", mlp(), device="gpu"),
            ValueError,
            r"^gb.load: device='gpu' is not a device",
        ),
        "load-directory": Case(
            lambda: gb.load(tmp, mlp()), gb.CheckpointUnreadableError, "is a directory"
        ),
        "load-dense-file": corrupt_load(
            tmp, "dense.safetensors", "dense.safetensors: not a gbfunc checkpoint"
        ),
        "load-garbage": corrupt_load(tmp, "garbage.bin", "garbage.bin: the file is truncated"),
    }


def _save_load_cases_2(tmp: Path | None) -> dict[str, Case]:
    return {
        "load-text-file": corrupt_load(tmp, "notes.txt", "notes.txt: not a gbfunc checkpoint"),
        "load-torch-save-file": corrupt_load(tmp, "model.pt", "model.pt: not a gbfunc checkpoint"),
        "load-nested-json": corrupt_load(
            tmp, "nested.safetensors", "nested.safetensors: the header is damaged"
        ),
        "load-1e400-offsets": corrupt_load(
            tmp,
            "offsets.safetensors",
            r"offsets.safetensors: the header is damaged \(tensor 'w' has data_offsets \[0, inf\]",
        ),
        "load-forged-tile": corrupt_load(
            tmp,
            "tile.safetensors",
            r"tile.safetensors: the plan is inconsistent: stacks\[0\].tile is \(65536, 65536\)",
        ),
        "load-forged-nan-scale": corrupt_load(
            tmp,
            "nan-scale.safetensors",
            r"nan-scale.safetensors: the plan is malformed: params\[0\] \('0.weight'\).scale "
            "is nan",
        ),
        "load-forged-shared-tiles": corrupt_load(
            tmp,
            "shared-tiles.safetensors",
            r"params\[2\] \('2.weight'\).blocks\[0\] and params\[0\] \('0.weight'\).blocks\[0\] "
            "both claim tiles of 's0_4x4'",
        ),
        "load-forged-stack-index": corrupt_load(
            tmp,
            "stack-index.safetensors",
            r"params\[0\] \('0.weight'\) names stack 1; the plan has 1 stacks",
        ),
        "load-forged-split-dim": corrupt_load(
            tmp, "split-dim.safetensors", r"\('0.weight'\).split_dim is 2; expected 0 or 1"
        ),
    }


def _save_load_cases_3(tmp: Path | None) -> dict[str, Case]:
    return {
        "load-forged-unused-stack": corrupt_load(
            tmp,
            "unused-stack.safetensors",
            r"stacks\[1\] is 'extra'; expected a stack that generates some block",
        ),
        "load-forged-negative-count": corrupt_load(
            tmp,
            "negative-count.safetensors",
            r"stacks\[0\].tiles_per_gnet is \(-1, -1, -1, -1, -1, -1\)",
        ),
        "load-forged-step": corrupt_load(
            tmp, "step.safetensors", "step.safetensors: step must be an int >= 0 or null, got 'abc'"
        ),
        "load-forged-int64-tensor": corrupt_load(
            tmp,
            "int64.safetensors",
            r"int64.safetensors: inconsistent contents .*\['0.bias'\] has dtype torch.int64",
        ),
        "load-not-a-model": Case(
            lambda: gb.load(tmp / "ok.safetensors", "mlp"),
            TypeError,
            "gb.load: model must be an nn.Module, got str",
        ),
        "load-dataparallel": Case(
            lambda: gb.load(tmp / "ok.safetensors", nn.DataParallel(mlp())),
            TypeError,
            "gb.load: model is wrapped in DataParallel",
        ),
        "load-other-model": Case(
            lambda: gb.load(
                tmp / "ok.safetensors", nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5))
            ),
            gb.CheckpointMismatchError,
            r"ok.safetensors: parameter '2.weight' has shape \(4, 6\) in the checkpoint "
            r"but \(5, 6\) in the model",
        ),
    }


def _export_save_dense_cases(tmp: Path | None, meta_g: dict) -> dict[str, Case]:
    return {
        # gb.export / gb.save_dense
        "export-other-model": Case(
            lambda: gb.export(gparams(), PLAN, model=nn.Linear(8, 6)),
            ValueError,
            r"gb.export: parameter #0 is '0.weight' \(6, 8\) in the plan "
            r"but 'weight' \(6, 8\) in the model",
        ),
        "export-bottleneck-model": Case(  # it compared the g-nets' names with the plan's
            lambda: gb.export(gparams(), PLAN, model=gb.Bottleneck(mlp(), PLAN)),
            TypeError,
            r"gb.export: model is a gb.Bottleneck, whose parameters are g-nets; pass its p-net",
        ),
        "save-dense-format-in-metadata": Case(
            lambda: gb.save_dense(
                tmp / "d.safetensors", gparams(), PLAN, metadata={"format": "np"}
            ),
            ValueError,
            r"gb.save_dense: metadata\['format'\] is 'np'; the header's 'format' says how",
        ),
        "export-meta-gparams": Case(
            lambda: gb.export(meta_g, PLAN), ValueError, "gb.export: .* is on the meta device"
        ),
        "save-dense-bad-metadata": Case(
            lambda: gb.save_dense(tmp / "d.safetensors", gparams(), PLAN, metadata={"epoch": 3}),
            TypeError,
            "metadata must map str to str",
        ),
        # issue 53, row 14: the errors gb.save gives, naming the argument or the user's path
        "save-dense-metadata-not-a-dict": Case(
            lambda: gb.save_dense(tmp / "d.safetensors", gparams(), PLAN, metadata=5),
            TypeError,
            r"gb.save_dense: metadata must map str to str \(safetensors' header\), got 5\.",
        ),
        "save-dense-into-missing-folder": Case(
            lambda: gb.save_dense(tmp / "missing" / "d.safetensors", gparams(), PLAN),
            gb.CheckpointError,
            r"gb.save_dense: \S*/missing/d.safetensors: cannot be written \(No such file or "
            r"directory\); any previous file there is unchanged\.",
        ),
        "save-dense-nul-in-path": Case(
            lambda: gb.save_dense(f"{tmp}/a\0b.safetensors", gparams(), PLAN),
            gb.CheckpointError,
            r"gb.save_dense: path .* contains a NUL byte; no file has that name\.",
        ),
    }


def _compat_cases(tmp: Path | None) -> dict[str, Case]:
    return {
        # gbfunc.compat
        "compat-not-a-module": Case(
            lambda: GenomicBottleneck(None), TypeError, "model must be an nn.Module, got NoneType"
        ),
        "compat-bad-num-batches": Case(
            lambda: GenomicBottleneck(mlp(), "100"),
            TypeError,
            r"local_rank_dict must be a dict \{rank: device\} \(or older torchGB's num_batches, "
            r"an int\) or None, got '100'",
        ),
        "compat-bad-hidden-dim": Case(
            lambda: GenomicBottleneck(mlp(), hidden_dim=0),
            ValueError,
            "GenomicBottleneck: hidden_dim must be an integer >= 1, got 0",
        ),
        "compat-bad-lr": Case(
            lambda: GenomicBottleneck(mlp(), lr="fast"),
            TypeError,
            "GenomicBottleneck: lr must be a number > 0, got 'fast'",
        ),
        "compat-compression-below-1": Case(
            lambda: GenomicBottleneck(mlp(), compression=0.5),
            ValueError,
            "GenomicBottleneck: compression must be a number >= 1 or None, got 0.5",
        ),
        "compat-bad-ignore-layers": Case(
            lambda: GenomicBottleneck(mlp(), ignore_layers=None),
            TypeError,
            "GenomicBottleneck: ignore_layers must be .*got None",
        ),
        "compat-bad-tile": Case(
            lambda: GenomicBottleneck(mlp(), tile=(0, 4)),
            ValueError,
            r"GenomicBottleneck: tile must be \(th, tw\) .*got \(0, 4\)",
        ),
        "compat-bad-optimizer": Case(
            lambda: GenomicBottleneck(mlp(), optimizer="adam"),
            TypeError,
            "GenomicBottleneck: optimizer must be a callable",
        ),
        "compat-nothing-generatable": Case(
            lambda: GenomicBottleneck(nn.LayerNorm(3)),
            ValueError,
            "LayerNorm has no parameter to generate",
        ),
        "compat-backward-first": Case(
            lambda: GenomicBottleneck(mlp(), tile=(4, 4)).backward(),
            RuntimeError,
            r"call predict_weights\(\) before backward\(\)",
        ),
        "compat-no-grad-predict": Case(
            _no_grad_then_backward, RuntimeError, r"predict_weights\(\) ran without gradients"
        ),
    }


def _no_grad_then_backward() -> None:
    gnets = GenomicBottleneck(mlp(), tile=(4, 4))
    with torch.no_grad():
        gnets.predict_weights()
    gnets.backward()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    gb.save(tmp / "ok.safetensors", gparams(), PLAN)
    safetensors.torch.save_file(mlp().state_dict(), tmp / "dense.safetensors")
    (tmp / "garbage.bin").write_bytes(b"\x01\x02")
    (tmp / "notes.txt").write_text("These are not the weights you are looking for.\n")
    torch.save(mlp().state_dict(), tmp / "model.pt")
    nested = b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}"
    (tmp / "nested.safetensors").write_bytes(struct.pack("<Q", len(nested)) + nested)
    offsets = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,1e400]}}'
    (tmp / "offsets.safetensors").write_bytes(struct.pack("<Q", len(offsets)) + offsets + b"\0" * 4)
    for name, change in FORGED.items():
        path = tmp / f"{name}.safetensors"
        gb.save(path, gparams(), PLAN, step=1)
        forge(path, change)
    return tmp


NAMES = list(cases(None))


def test_the_table_is_large_enough():
    assert len(NAMES) >= 25


@pytest.mark.parametrize("name", NAMES)
def test_bad_input(name, files):
    case = cases(files)[name]
    with pytest.raises(case.error, match=case.match):
        case.call()


@pytest.mark.parametrize(
    ("bad", "kwargs"),
    [
        (None, {"compile": "yes"}),
        (None, {"compile": 1}),
        (None, {"backend": "cuda"}),
        (None, {"backend": None}),
        ([], {}),
        (with_stack_leaf("w_out", lambda t: t[:1]), {}),
    ],
)
def test_explain_refuses_exactly_what_apply_refuses(bad, kwargs):
    """Issue 53 row 16: `gb.explain` explains only calls `gb.apply` accepts (one check)."""
    errors = []
    for call, name in ((gb.apply, "gb.apply"), (gb.explain, "gb.explain")):
        with pytest.raises((TypeError, ValueError)) as info:
            call(gparams() if bad is None else bad, PLAN, **kwargs)
        assert str(info.value).startswith(f"{name}: ")
        errors.append((info.type, str(info.value).removeprefix(name)))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("call", ["plan", "load", "export"])
def test_ddp_wrapped_model(process_group, files, call):
    ddp = nn.parallel.DistributedDataParallel(mlp())
    fn = {
        "plan": lambda: gb.plan(ddp),
        "load": lambda: gb.load(files / "ok.safetensors", ddp),
        "export": lambda: gb.export(gparams(), PLAN, model=ddp),
    }[call]
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"gb.{call}: model is wrapped in DistributedDataParallel; pass model.module"
        ),
    ):
        fn()


class TiedLM(nn.Module):
    """GPT-2-style: the output head reuses the embedding table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def test_tied_weights_are_generated_once_and_stay_tied():
    model = TiedLM()
    plan = gb.plan(model, tile=(4, 4), embeddings=True)
    names = [p.name for p in plan.params]
    assert names.count("emb.weight") == 1
    assert "head.weight" not in names
    assert "emb.weight" in [p.name for p in plan.generated]
    gparams = gb.init(plan)
    params = gb.apply(gparams, plan)
    ids = torch.tensor([[1, 5, 7]])
    out = functional_call(model, params, (ids,))
    table = params["emb.weight"]
    manual = (
        torch.tanh(nn.functional.linear(table[ids], params["mix.weight"], params["mix.bias"]))
        @ table.T
    )
    torch.testing.assert_close(out, manual, rtol=0, atol=0)  # the head used the generated table
    sd = gb.export(gparams, plan, model=model)
    assert sd["head.weight"] is sd["emb.weight"]


class HeadFirstLM(nn.Module):
    """An output head registered before the embedding it is tied to."""

    def __init__(self, **embedding: object) -> None:
        super().__init__()
        self.head = nn.Linear(8, 20, bias=False)
        self.emb = nn.Embedding(20, 8, **embedding)
        self.head.weight = self.emb.weight
        self.mix = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.emb(ids)))


def test_a_tied_table_is_an_embedding_whichever_module_is_registered_first():
    """The head's layout decided before: the table was generated without embeddings=True,
    and with padding_idx (whose row must stay zero) or max_norm (which renormalised the
    generated tensor in place)."""
    for embedding, generated in (({}, False), ({"padding_idx": 0}, False), ({}, True)):
        model = HeadFirstLM(**embedding)
        plan = gb.plan(model, tile=(4, 4), embeddings=generated)
        (table,) = [p for p in plan.params if p.name == "head.weight"]
        assert isinstance(table, gb.Generated) is generated, (embedding, generated)
    with pytest.raises(
        ValueError, match=r"asked to be generated, but stays free: embedding with padding_idx=0"
    ):
        gb.plan(
            HeadFirstLM(padding_idx=0), tile=(4, 4), overrides={"head.weight": {"generate": True}}
        )


def test_a_module_registered_twice_is_planned_once():
    shared = nn.Linear(6, 6)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    plan = gb.plan(model, tile=(3, 3))
    assert [p.name for p in plan.params] == ["0.weight", "0.bias"]
    params = gb.apply(gb.init(plan), plan)
    x = torch.randn(2, 6)
    want = nn.functional.linear(
        torch.relu(nn.functional.linear(x, params["0.weight"], params["0.bias"])),
        params["0.weight"],
        params["0.bias"],
    )
    torch.testing.assert_close(functional_call(model, params, (x,)), want, rtol=0, atol=0)


def test_frozen_parameters_pass_through_untouched():
    model = mlp()
    model[2].weight.requires_grad_(False)
    plan = gb.plan(model, tile=(4, 4))
    frozen = next(p for p in plan.free if p.name == "2.weight")
    assert not frozen.trainable
    assert "frozen" in frozen.reason
    gparams = gb.init(plan)
    assert not gparams["frozen"]["2.weight"].requires_grad
    params = gb.apply(gparams, plan)
    assert params["2.weight"] is gparams["frozen"]["2.weight"]
    functional_call(model, params, (torch.randn(3, 8),)).sum().backward()
    assert gparams["frozen"]["2.weight"].grad is None


@pytest.mark.parametrize(
    "fault",
    [
        safetensors.SafetensorError(
            "Error while serializing: No space left on device (os error 28)"
        ),
        OSError(errno.EROFS, "Read-only file system"),
    ],
    ids=["full file system", "read-only file system"],
)
def test_a_failed_save_is_a_checkpoint_error_and_the_old_file_stays(fault, tmp_path, monkeypatch):
    """`gb.save` onto a full or read-only file system: a `gb.CheckpointError` naming the
    file, chained from the cause; the previous checkpoint is untouched and no temporary file
    is left."""
    path = tmp_path / "ckpt.safetensors"
    gb.save(path, gparams(), PLAN, step=1)
    before = path.read_bytes()

    def failing(*args, **kwargs):
        raise fault

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(gb.CheckpointError, match=r"ckpt.safetensors: cannot be written") as info:
        gb.save(path, gparams(), PLAN, step=2)
    assert info.value.__cause__ is fault
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.safetensors"]


def test_a_save_whose_folder_cannot_be_synced_after_the_rename_warns_and_loads(
    tmp_path, monkeypatch
):
    """An error after the new file replaced the old one is no failed save: the file is whole
    and loads, so `gb.save` warns (it said 'any previous file there is unchanged')."""
    from gbfunc import _checkpoint

    path = tmp_path / "ckpt.safetensors"
    gb.save(path, gparams(), PLAN, step=1)

    def failing(directory):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_checkpoint, "sync_dir", failing)
    with pytest.warns(RuntimeWarning, match=r"ckpt.safetensors: written whole, but its folder"):
        gb.save(path, gparams(), PLAN, step=2)
    assert gb.load(path, mlp()).step == 2


def test_a_rule_key_naming_a_buffer_is_refused_not_taken_for_a_derived_weight():
    """Weight-normed and parametrized weights stay free (their rule names a computed tensor);
    any other key that is no parameter, a buffer included, is the rule's error."""

    class Buffered(nn.Linear):
        def __init__(self) -> None:
            super().__init__(8, 8)
            self.register_buffer("wieght", torch.zeros(8, 8))

    gb.register_rule(Buffered, lambda m: {"wieght": gb.Layout(0.1)})
    try:
        with pytest.raises(ValueError, match=r"returned the key 'wieght'"):
            gb.plan(nn.Sequential(Buffered()), tile=(4, 4))
    finally:
        from gbfunc import _rules

        del _rules._RULES[Buffered]


def test_a_registered_rule_leaves_a_legacy_spectral_normed_weight_free():
    """Under `torch.nn.utils.spectral_norm` the layer holds `weight_orig` and computes
    `weight`: a rule naming `weight` leaves it free, as the built-in rules do."""

    class MyLinear(nn.Linear):
        pass

    gb.register_rule(MyLinear, lambda m: {"weight": gb.Layout(0.1)})
    try:
        model = nn.Sequential(torch.nn.utils.spectral_norm(MyLinear(8, 8)), nn.Linear(8, 4))
        plan = gb.plan(model, tile=(4, 4))
    finally:
        from gbfunc import _rules

        del _rules._RULES[MyLinear]
    assert [p.name for p in plan.generated] == ["1.weight"]
    assert "0.weight_orig" in {p.name for p in plan.free}
