"""Files that are not checkpoints, crafted checkpoints whose hash was recomputed, and the
umask: every failure is a `gb.CheckpointError` naming the file, and nothing hangs."""

import contextlib
import json
import math
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from forged import forge, in_plan
from torch import nn

import gbfunc as gb
from gbfunc._files import write_atomic


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


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    """The process's umask set to `mask` for the block, then restored."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def test_new_files_follow_the_umask_and_existing_files_keep_their_mode(tmp_path):
    plan = gb.plan(nn.Linear(8, 8), tile=(4, 4))
    gparams = gb.init(plan)
    with umask(0o077):
        gb.save(tmp_path / "private.safetensors", gparams, plan)
        existing = tmp_path / "shared.safetensors"
        existing.write_bytes(b"")
        existing.chmod(0o640)
        gb.save(existing, gparams, plan)
    assert stat.S_IMODE((tmp_path / "private.safetensors").stat().st_mode) == 0o600
    assert stat.S_IMODE(existing.stat().st_mode) == 0o640


@pytest.mark.parametrize("mode", [0o444, 0o600])
def test_a_file_is_replaced_whole_keeping_its_mode_and_giving_others_no_more(tmp_path, mode):
    """The temporary file is its owner's to write even where the file it replaces is not
    (as a non-root user, safetensors could not open a read-only one: permission denied),
    and others may read it only where they could read the file (a private one's copy was
    0o644 under a umask of 022 while it was written)."""
    existing = tmp_path / "kept.bin"
    existing.write_bytes(b"old")
    existing.chmod(mode)
    modes = []

    def write(tmp: str) -> None:
        modes.append(stat.S_IMODE(os.stat(tmp).st_mode))
        Path(tmp).write_bytes(b"new")

    with umask(0o022):
        write_atomic(str(existing), write)
    assert modes[0] & 0o600 == 0o600
    assert modes[0] & 0o077 & ~(mode & 0o077) == 0
    assert stat.S_IMODE(existing.stat().st_mode) == mode
    assert existing.read_bytes() == b"new"


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
            r"tiles_per_gnet is \(1, 1, 1, 1, 1, 1, 1, 1\); expected \(4, 4\), one g-net per block "
            r"\(share=True\)",
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
        lambda p: _generated(p).update(fan_in=0),
        r"params\[0\] \('0\.weight'\)\.fan_in is 0; expected an integer >= 1\.",
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


def _param(index: int, **change) -> Callable[[gb.Plan], gb.Plan]:
    """Parameter `index` of the plan with fields changed."""

    def edit(plan: gb.Plan) -> gb.Plan:
        params = list(plan.params)
        params[index] = replace(params[index], **change)
        return gb.Plan(tuple(params), plan.stacks)

    return edit


def _first_block(index: int, **change) -> Callable[[gb.Plan], gb.Plan]:
    """Parameter `index` with its first block's fields changed."""

    def edit(plan: gb.Plan) -> gb.Plan:
        p = plan.params[index]
        return _param(index, blocks=(replace(p.blocks[0], **change), *p.blocks[1:]))(plan)

    return edit


def _stack_fields(**change) -> Callable[[gb.Plan], gb.Plan]:
    return lambda plan: gb.Plan(plan.params, (replace(plan.stacks[0], **change),))


W, B, W1 = (
    r"params\[0\] \('0\.weight'\)",
    r"params\[1\] \('0\.bias'\)",
    r"params\[2\] \('1\.weight'\)",
)
KINDS = r"\('zeros', 'ones', 'uniform', 'normal', 'normal_padded'\)"

# The rest of `check_plan`'s checks on two Linear(8, 8) on 4x4 tiles (biases free), each with
# its whole message: the field, the value found and what was expected.
HAND_BUILT_MESSAGES = [
    (
        _param(1, init=("exec", 1.0)),
        rf"{B}\.init is \('exec', 1\.0\); expected \[kind, value\], kind in {KINDS}\.",
    ),
    (
        _param(1, init=("normal", math.inf)),
        rf"{B}\.init is \('normal', inf\); expected \[kind, value\]",
    ),
    (
        _param(1, init=("normal_padded", 8)),  # an embedding's padding row, outside the 8 rows
        rf"{B}\.init is \('normal_padded', 8\); expected \['normal_padded', a row of the table\]\.",
    ),
    (_param(1, trainable="yes"), rf"{B}\.trainable is 'yes'; expected a bool\."),
    (
        _param(1, dtype="int64"),
        rf"{B}\.dtype is 'int64'; expected a floating dtype \(trainable\)\.",
    ),
    (_param(1, reason=3), rf"{B}\.reason is 3; expected a string\."),
    (_param(0, dtype="int64"), rf"{W}\.dtype is 'int64'; expected a floating dtype\."),
    (_param(0, dtype=3), rf"{W}\.dtype is 3; expected a torch dtype name such as 'float32'\."),
    (_param(0, scale=0.0), rf"{W}\.scale is 0\.0; expected a number in \(0, 3\.40282e\+38\]"),
    (_param(0, shape=[8, 8]), rf"{W}\.shape is \[8, 8\]; expected a list of sizes >= 0\."),
    (_param(0, shape=(8, 0)), rf"{W}\.shape is \(8, 0\); expected a non-empty shape\."),
    (_param(0, stack_index=7), rf"{W} names stack 7; the plan has 1 stacks\."),
    (_param(0, split_dim=5), rf"{W}\.split_dim is 5; expected 0 or 1\."),
    (_param(0, center="no"), rf"{W}\.center is 'no'; expected a bool\."),
    (_param(0, blocks=()), rf"{W}\.blocks is \(\); expected blocks\."),
    (_param(0, blocks=(1,)), rf"{W}\.blocks\[0\] is 1; expected a block\."),
    (_first_block(0, rows=0), rf"{W}\.blocks\[0\]\.rows is 0; expected an integer >= 1\."),
    (_first_block(0, cols=0), rf"{W}\.blocks\[0\]\.cols is 0; expected an integer >= 1\."),
    (
        _first_block(0, grid=(1,)),
        rf"{W}\.blocks\[0\]\.grid is \(1,\); expected \[rows, cols\] >= 1\.",
    ),
    (_first_block(0, first_tile=-3), rf"{W}\.blocks\[0\]\.first_tile is -3, outside its stack\."),
    (_stack_fields(outputs=0), r"stacks\[0\]\.outputs is 0; expected an integer >= 1\."),
    (_stack_fields(row_width=0), r"stacks\[0\]\.row_width is 0; expected an integer >= 1\."),
    (_stack_fields(col_width=0), r"stacks\[0\]\.col_width is 0; expected an integer >= 1\."),
    (
        _stack_fields(tiles_per_gnet=(0,)),
        r"stacks\[0\]\.tiles_per_gnet is \(0,\); expected a list of counts >= 1\.",
    ),
    (
        lambda plan: gb.Plan(plan.params, (*plan.stacks, plan.stacks[0])),
        r"stacks\[1\]\.key is 's0_4x4'; expected a unique name without '/'\.",
    ),
    (
        _stack_fields(columns=3),
        r"stacks\[0\] \(outputs, columns, row_width, col_width\) is \(1, 3, 2, 2\); expected "
        r"\(1, 4, 2, 2\) for its genome, tile and kernel\.",
    ),
    (
        _stack_fields(tiles_per_gnet=(2, 1, 1, 1, 1, 1, 1)),
        r"stacks\[0\]\.tiles_per_gnet is \(2, 1, 1, 1, 1, 1, 1\); expected all ones, one g-net "
        r"per tile\.",
    ),
    (
        _first_block(2, first_tile=6),
        rf"{W1}\.blocks\[0\] \(tiles 6 to 9\) is outside its stack 's0_4x4' of 8 tiles\.",
    ),
    (
        _first_block(2, first_tile=2),
        rf"{W}\.blocks\[0\] and {W1}\.blocks\[0\] both claim tiles of 's0_4x4' from tile 2\.",
    ),
    (
        lambda plan: _param(0, blocks=plan.params[0].blocks * 3)(plan),
        rf"{W}\.blocks is '3 blocks'; expected a divisor of 8\.",
    ),
]


@pytest.mark.parametrize(("edit", "match"), HAND_BUILT_MESSAGES)
def test_every_plan_check_gives_its_whole_message(edit, match):
    _check_hand_built(edit, match)


def _vector_plan(edit: Callable[[gb.Plan], gb.Plan]) -> tuple[gb.Plan, nn.Module]:
    model = nn.Sequential(nn.Linear(8, 8))
    return edit(gb.plan(model, tile=(4, 4), biases=True)), model


def _kernel_plan(edit: Callable[[gb.Plan], gb.Plan]) -> tuple[gb.Plan, nn.Module]:
    model = nn.Sequential(nn.Conv1d(4, 4, 2))  # a kernel window of 2 taps
    return edit(gb.plan(model, tile=(2, 2))), model


def test_a_plan_whose_tile_is_padded_to_whole_evaluations_is_accepted():
    """`gb.plan` pads a tile to whole evaluations: 12 columns at 8 outputs per evaluation take a
    16-wide tile, which `check_plan` must accept (and a 24-wide one refuse)."""
    from gbfunc._check_plan import check_plan

    model = nn.Sequential(nn.Linear(12, 8))
    plan = gb.plan(model, tile=(8, 16), outputs=8)
    assert plan.stacks[0].tile == (8, 16)
    errors = {"corrupt": gb.CheckpointCorruptError, "mismatch": gb.CheckpointMismatchError}
    check_plan(plan, model, "where", **errors)
    wider = gb.Plan(plan.params, (replace(plan.stacks[0], tile=(8, 24)),))
    with pytest.raises(gb.CheckpointCorruptError, match=r"tile is \(8, 24\); expected a tile no"):
        check_plan(wider, model, "where", **errors)


@pytest.mark.parametrize(
    "model",
    [nn.Sequential(nn.Conv1d(4, 4, 1)), nn.Sequential(nn.Linear(8, 1))],
    ids=["one-tap kernel", "one-row block"],
)
def test_the_smallest_windows_and_blocks_are_accepted(model):
    from gbfunc._check_plan import check_plan

    plan = gb.plan(model, tile=(2, 2))
    assert plan.stacks[0].window in ((1,), ())
    errors = {"corrupt": gb.CheckpointCorruptError, "mismatch": gb.CheckpointMismatchError}
    check_plan(plan, model, "where", **errors)


def test_a_kernel_window_that_is_not_the_weights_is_named():
    window_3 = lambda plan: gb.Plan(plan.params, (replace(plan.stacks[0], window=(3,)),))
    match = (
        r"stacks\[0\]\.window is \(3,\); expected \(2,\), the kernel window of params\[0\] "
        r"\('0\.weight'\)\."
    )
    _check_hand_built(window_3, match, _kernel_plan)


def test_a_kernel_window_takes_one_output_per_evaluation():
    outputs_2 = lambda plan: gb.Plan(
        plan.params, (replace(plan.stacks[0], genome=replace(plan.stacks[0].genome, outputs=2)),)
    )
    match = r"stacks\[0\]\.genome\.outputs is 2; expected 1 for a kernel\."
    _check_hand_built(outputs_2, match, _kernel_plan)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_param(1, center=True), rf"{B}\.center is True; expected False for a vector\."),
        (
            lambda plan: _param(1, blocks=plan.params[1].blocks * 2)(plan),
            rf"{B}\.blocks is '2 blocks'; expected one block for a vector\.",
        ),
    ],
)
def test_a_generated_vector_takes_one_uncentred_block(edit, match):
    _check_hand_built(edit, match, _vector_plan)


def _check_hand_built(
    edit: Callable[[gb.Plan], gb.Plan],
    match: str,
    build: Callable[[Callable[[gb.Plan], gb.Plan]], tuple[gb.Plan, nn.Module]] | None = None,
) -> None:
    from gbfunc._check_plan import check_plan

    plan, model = (build or _hand_built)(edit)
    with pytest.raises(gb.CheckpointCorruptError, match=match):
        check_plan(
            plan,
            model,
            "where",
            corrupt=gb.CheckpointCorruptError,
            mismatch=gb.CheckpointMismatchError,
        )


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
            r"params\[0\] \('0\.weight'\)\.scale is True; expected a number in "
            r"\(0, 3\.40282e\+38\], the largest float32\.",
        ),
        (
            lambda p: gb.Plan((replace(p.params[0], scale="1"), *p.params[1:]), p.stacks),
            r"params\[0\] \('0\.weight'\)\.scale is '1'; expected a number in "
            r"\(0, 3\.40282e\+38\], the largest float32\.",
        ),
        (
            lambda p: gb.Plan(p.params, (replace(p.stacks[0], genome="g"),)),
            r"stacks\[0\]\.genome is 'g'; expected a genome\.",
        ),
    ],
)
def test_a_hand_built_plan_is_checked_like_a_crafted_file(edit, match):
    """`check_plan` also guards plans built in code, not only read from JSON."""
    _check_hand_built(edit, match)


def test_a_save_syncs_the_new_file_before_its_rename_and_the_folder_after(tmp_path, monkeypatch):
    """Without the first, a crash can leave an empty file under the name; without the
    second, the old one."""
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(src, dst, *args, **kwargs) -> None:
        events.append(("replace", os.fspath(src)))
        replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    folder = os.path.realpath(tmp_path)
    plan = gb.plan(nn.Linear(8, 8), tile=(4, 4))
    gb.save(os.path.join(folder, "c.safetensors"), gb.init(plan), plan)
    renamed = max(i for i, (kind, _) in enumerate(events) if kind == "replace")
    assert ("fsync", events[renamed][1]) in events[:renamed]
    assert ("fsync", folder) in events[renamed:]
