"""Files that are not checkpoints, crafted checkpoints whose hash was recomputed, and the
umask: every failure is a `gb.CheckpointError` naming the file, and nothing hangs."""

import json
import os
import stat
import struct
import threading
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from forged import forge, in_plan
from torch import nn

import gbfunc as gb


@pytest.fixture
def saved(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    plan = gb.plan(model, tile=(4, 4))
    path = tmp_path / "c.safetensors"
    gb.save(path, gb.init(plan), plan, step=2)
    return path, model


def load_fails(path, model, match: str) -> None:
    with pytest.raises(gb.CheckpointError, match=match) as info:
        gb.load(path, model)
    assert str(path) in str(info.value)


def test_devices_are_refused_without_reading():
    load_fails("/dev/zero", nn.Linear(2, 2), "not a regular file")


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []
    thread = threading.Thread(target=lambda: outcome.append(_error(fifo)), daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "gb.load blocked on a FIFO"
    assert isinstance(outcome[0], gb.CheckpointError)
    assert "not a regular file" in str(outcome[0])


def _error(path) -> BaseException:
    try:
        gb.load(path, nn.Linear(2, 2))
    except BaseException as e:
        return e
    raise AssertionError("no error")


@pytest.mark.parametrize("kind", ["text", "torch.save", "json"])
def test_other_files_are_named_not_a_checkpoint(tmp_path, kind):
    path = tmp_path / "other"
    if kind == "text":
        path.write_text("These are not the weights you are looking for.\n" * 3)
    elif kind == "torch.save":
        torch.save({"weight": torch.ones(3)}, path)
    else:
        path.write_text(json.dumps({"weight": [1, 2, 3]}))
    load_fails(path, nn.Linear(2, 2), "not a gbfunc checkpoint")


def test_deeply_nested_and_overflowing_headers_are_corrupt(tmp_path):
    nested = b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}"
    path = tmp_path / "nested"
    path.write_bytes(struct.pack("<Q", len(nested)) + nested)
    load_fails(path, nn.Linear(2, 2), "header is damaged")
    huge = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,1e400]}}'
    path.write_bytes(struct.pack("<Q", len(huge)) + huge + b"\0" * 4)
    load_fails(path, nn.Linear(2, 2), "header is damaged")


def test_crafted_step_and_integer_tensors_are_refused(saved):
    path, model = saved
    forge(path, lambda t, m: m.update(step='"abc"'))
    load_fails(path, model, "step must be an int")
    forge(path, lambda t, m: m.update(step="2"))
    gb.load(path, model)  # the same file, made valid again

    def integer_free(tensors, metadata):
        key = next(k for k in tensors if k.startswith("free/"))
        tensors[key] = tensors[key].to(torch.int64)

    forge(path, integer_free)
    load_fails(path, model, "inconsistent contents")


def test_new_files_follow_the_umask_and_existing_files_keep_their_mode(tmp_path):
    plan = gb.plan(nn.Linear(8, 8), tile=(4, 4))
    gparams = gb.init(plan)
    old = os.umask(0o077)
    try:
        gb.save(tmp_path / "private.safetensors", gparams, plan)
        existing = tmp_path / "shared.safetensors"
        existing.write_bytes(b"")
        existing.chmod(0o640)
        gb.save(existing, gparams, plan)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "private.safetensors").stat().st_mode) == 0o600
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640


def _generated(plan: dict, index: int = 0) -> dict:
    return [p for p in plan["params"] if p["kind"] == "generated"][index]


def _shift_blocks(plan: dict) -> None:
    """One more g-net at the front of the stack, owned by no block."""
    plan["stacks"][0]["tiles_per_gnet"] = [1] * 9
    for i in range(2):
        _generated(plan, i)["blocks"][0]["first_tile"] += 1


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda p: p["stacks"][0].update(tile=[65536, 65536]), "geometry|larger than"),
        (lambda p: _generated(p).update(scale=float("nan")), "scale"),
        (lambda p: _generated(p).update(scale=-1.0), "scale"),
        (lambda p: _generated(p).update(stack_index=7), "names stack 7"),
        (lambda p: _generated(p).update(split_dim=5), "split_dim"),
        (lambda p: _generated(p)["blocks"][0].update(first_tile=-3), "outside its stack"),
        (lambda p: _generated(p)["blocks"][0].update(grid=[1, 1]), "grid"),
        (lambda p: p["stacks"][0].update(tiles_per_gnet=[-1] * 4), "tiles_per_gnet"),
        (lambda p: _generated(p)["blocks"][0].update(first_tile=4), "both claim|outside"),
        (lambda p: p["params"][1].update(init=["exec", 1.0]), "init"),
        (
            lambda p: p["stacks"][0]["genome"].update(outputs=3),
            r"stacks\[0\]\.tile is \(4, 4\); expected a width that is a multiple of outputs=3",
        ),
        (
            lambda p: p["stacks"][0]["genome"].update(share=True),
            r"tiles_per_gnet is .*; expected \(4, 4\), one g-net per block \(share=True\)",
        ),
        (_shift_blocks, r"tiles 0 to 0 of 's0_4x4' belong to no block"),
    ],
)
def test_a_crafted_plan_is_refused_before_anything_is_allocated(tmp_path, edit, match):
    _crafted_plan_fails(tmp_path, edit, match)


def _crafted_plan_fails(tmp_path, edit: Callable[[dict], None], match: str) -> None:
    """A checkpoint of two Linear(8, 8) on 4x4 tiles whose plan JSON `edit` changed."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    plan = gb.plan(model, tile=(4, 4))
    path = tmp_path / "c.safetensors"
    gb.save(path, gb.init(plan), plan)
    forge(path, in_plan(edit))
    load_fails(path, model, match)


def _block(index: int = 0, **change) -> Callable[[dict], None]:
    return lambda p: _generated(p, index)["blocks"][0].update(**change)


def _stack(**change) -> Callable[[dict], None]:
    return lambda p: p["stacks"][0].update(**change)


# Each check of a crafted plan, with the whole message it must give (every field named, the
# value found and what was expected): the model is two Linear(8, 8), one stack of 4x4 tiles.
CRAFTED_MESSAGES = [
    (_stack(key=""), r"stacks\[0\]\.key is ''; expected a unique name without '/'\."),
    (_stack(key="a/b"), r"stacks\[0\]\.key is 'a/b'; expected a unique name without '/'\."),
    (_stack(tile=[4]), r"stacks\[0\]\.tile is \(4,\); expected \[th, tw\] >= 1\."),
    (_stack(window=[0]), r"stacks\[0\]\.window is \(0,\); expected a list of sizes >= 1\."),
    (_stack(columns=0), r"stacks\[0\]\.columns is 0; expected an integer >= 1\."),
    (_stack(tiles_per_gnet=[]), r"stacks\[0\]\.tiles_per_gnet is \(\); expected a list of counts"),
    (
        _stack(window=[3]),
        r"stacks\[0\]\.window is \(3,\); expected \(\), the kernel window of params\[0\] "
        r"\('0\.weight'\)\.",
    ),
    (
        _block(rows=3),
        r"params\[0\] \('0\.weight'\)\.blocks\[0\] is '3x8'; expected 8x8 for shape \(8, 8\) "
        r"split 1-ways on dim 0\.",
    ),
    (
        _block(grid=[1, 1]),
        r"params\[0\] \('0\.weight'\)\.blocks\[0\]\.grid is \(1, 1\); expected \(2, 2\) for "
        r"8x8 on 4x4 tiles\.",
    ),
    (
        lambda p: _generated(p).update(split_dim=1),
        r"params\[0\] \('0\.weight'\)\.split_dim is 1; expected 0 for one block\.",
    ),
    (
        _stack(tile=[16, 4]),
        r"stacks\[0\]\.tile is \(16, 4\); expected a tile no larger than params\[0\] "
        r"\('0\.weight'\)\.blocks\[0\] \(8x8\), as gb\.plan clips it\.",
    ),
    (
        lambda p: p["stacks"][0]["genome"].update(outputs=16),
        r"stacks\[0\]\.genome\.outputs is 16; expected at most the 8 columns of params\[0\] "
        r"\('0\.weight'\)\.blocks\[0\]\.",
    ),
    (
        lambda p: p["stacks"].append({**p["stacks"][0], "key": "extra"}),
        r"stacks\[1\] is 'extra'; expected a stack that generates some block\.",
    ),
]


@pytest.mark.parametrize(("edit", "match"), CRAFTED_MESSAGES)
def test_a_crafted_plan_names_the_field_the_value_and_what_was_expected(tmp_path, edit, match):
    _crafted_plan_fails(tmp_path, edit, match)


def _hand_built(edit: Callable[[gb.Plan], gb.Plan]) -> tuple[gb.Plan, nn.Module]:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    return edit(gb.plan(model, tile=(4, 4))), model


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda p: gb.Plan(list(p.params), p.stacks), r"params is 'list'; expected a list\."),
        (lambda p: gb.Plan(p.params, list(p.stacks)), r"stacks is 'list'; expected a list\."),
        (
            lambda p: gb.Plan((1, *p.params), p.stacks),
            r"params\[0\] is 'int'; expected a parameter\.",
        ),
        (
            lambda p: gb.Plan(p.params, (*p.stacks, "s")),
            r"stacks\[1\] is 'str'; expected a stack\.",
        ),
        (
            lambda p: gb.Plan((replace(p.params[0], name=""), *p.params[1:]), p.stacks),
            r"params\[0\]\.name is ''; expected a name\.",
        ),
        (
            lambda p: gb.Plan((replace(p.params[0], dtype="float99"), *p.params[1:]), p.stacks),
            r"params\[0\] \('0\.weight'\)\.dtype is 'float99'; expected a torch dtype name such as "
            r"'float32'\.",
        ),
        (
            lambda p: gb.Plan((replace(p.params[0], scale=True), *p.params[1:]), p.stacks),
            r"params\[0\] \('0\.weight'\)\.scale is True; expected a finite number > 0\.",
        ),
        (
            lambda p: gb.Plan((replace(p.params[0], scale="1"), *p.params[1:]), p.stacks),
            r"params\[0\] \('0\.weight'\)\.scale is '1'; expected a finite number > 0\.",
        ),
        (
            lambda p: gb.Plan(p.params, (replace(p.stacks[0], genome="g"),)),
            r"stacks\[0\]\.genome is 'g'; expected a genome\.",
        ),
    ],
)
def test_a_hand_built_plan_is_checked_like_a_crafted_file(edit, match):
    """`check_plan` also guards plans built in code, not only read from JSON."""
    from gbfunc._check_plan import check_plan

    plan, model = _hand_built(edit)
    with pytest.raises(gb.CheckpointCorruptError, match=match):
        check_plan(
            plan,
            model,
            "where",
            corrupt=gb.CheckpointCorruptError,
            mismatch=gb.CheckpointMismatchError,
        )
