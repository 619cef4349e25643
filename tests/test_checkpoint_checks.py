"""Each check of `gb.save` and `gb.load` on its own: the arguments of a save, the header's
bounds and structure, the file kinds and read errors, and where loaded tensors go.

Every case asserts the whole failure (error type, the file or argument named, the figures it
quotes), so a check that fires for the wrong reason, or a message that lost its facts, fails.
Written for the survivors of a mutation run of `gbfunc/_checkpoint.py` and
`gbfunc/_check_gparams.py` (`benchmarks/results/mutation.md`).
"""

import errno
import json
import math
import os
import re
import struct
import threading

import pytest
import safetensors
import torch
from forged import forge
from torch import nn

import gbfunc as gb
from gbfunc._checkpoint import FORMAT, FORMAT_VERSION, MAX_HEADER

HINT = "Were these gparams made by gb.init with a different plan?"


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))  # one stack and free parameters


@pytest.fixture
def planned():
    plan = gb.plan(model(), tile=(4, 4))
    return plan, gb.init(plan)


@pytest.fixture
def saved(tmp_path, planned):
    plan, gparams = planned
    path = tmp_path / "c.safetensors"
    gb.save(path, gparams, plan, step=2)
    return path


def load_fails(path, match: str, error: type = gb.CheckpointError) -> gb.CheckpointError:
    with pytest.raises(error, match=match) as info:
        gb.load(path, model())
    assert str(path) in str(info.value)
    return info.value


def raw_file(path, header: bytes, body: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


# -- gb.save's arguments ------------------------------------------------------------------


def test_a_plan_that_is_not_a_plan_is_named_with_its_type(tmp_path, planned):
    _, gparams = planned
    with pytest.raises(
        TypeError, match=r"^gb.save: plan must be a gb.Plan \(from gb.plan\), got str"
    ):
        gb.save(tmp_path / "c", gparams, "plan")


@pytest.mark.parametrize(
    ("gparams", "got"),
    [
        ({"stacks": {}, "free": {}}, "['free', 'stacks']"),
        ([], "list"),
    ],
)
def test_gparams_without_the_three_groups_say_what_they_hold(tmp_path, planned, gparams, got):
    plan, _ = planned
    expected = (
        "gb.save: gparams must be the dict made by gb.init with keys "
        f"['stacks', 'free', 'frozen'], got {got}."
    )
    with pytest.raises(TypeError, match=f"^{re.escape(expected)}$"):
        gb.save(tmp_path / "c", gparams, plan)
    assert not (tmp_path / "c").exists()


def test_a_missing_stack_is_named_at_the_level_where_it_is_missing(tmp_path, planned):
    plan, gparams = planned
    (key,) = gparams["stacks"]
    del gparams["stacks"][key]
    expected = f"gb.save: gparams['stacks'][{key!r}] is missing. {HINT}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        gb.save(tmp_path / "c", gparams, plan)


def test_an_extra_leaf_inside_a_stack_is_not_in_the_plan(tmp_path, planned):
    plan, gparams = planned  # free parameters follow the stacks: the extra leaf is seen first
    (key,) = gparams["stacks"]
    gparams["stacks"][key]["w_extra"] = torch.zeros(1)
    expected = f"gb.save: gparams['stacks'][{key!r}]['w_extra'] is not in the plan. {HINT}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        gb.save(tmp_path / "c", gparams, plan)


def test_the_leaves_of_one_stack_share_a_dtype_but_stacks_may_differ(tmp_path):
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 8))
    plan = gb.plan(net, tile=(4, 4))
    gparams = gb.init(plan)
    first, second = gparams["stacks"]  # two stacks: the conv's and the linear's
    gparams["stacks"][first] = {k: v.double() for k, v in gparams["stacks"][first].items()}
    gb.save(tmp_path / "mixed", gparams, plan)  # one stack in float64, the other float32
    loaded = gb.load(tmp_path / "mixed", net).gparams
    assert {t.dtype for t in loaded["stacks"][first].values()} == {torch.float64}
    assert {t.dtype for t in loaded["stacks"][second].values()} == {torch.float32}

    gparams["stacks"][second]["w_in"] = gparams["stacks"][second]["w_in"].double()
    with pytest.raises(ValueError, match=r"the leaves of a stack must share dtype and device\.$"):
        gb.save(tmp_path / "bad", gparams, plan)


def test_a_diverged_run_can_still_be_saved_and_inspected(tmp_path, planned):
    plan, gparams = planned
    gparams["free"]["1.weight"] = torch.full_like(gparams["free"]["1.weight"], math.nan)
    gb.save(tmp_path / "nan", gparams, plan)
    loaded = gb.load(tmp_path / "nan", model()).gparams
    assert torch.isnan(loaded["free"]["1.weight"]).all()


@pytest.mark.parametrize(("step", "error"), [(True, TypeError), (1.5, TypeError), (-1, ValueError)])
def test_a_step_that_is_not_a_count_is_refused(tmp_path, planned, step, error):
    plan, gparams = planned
    with pytest.raises(error, match=rf"^gb.save: step must be an integer >= 0 or None, got {step}"):
        gb.save(tmp_path / "c", gparams, plan, step=step)


def test_step_zero_round_trips(tmp_path, planned):
    plan, gparams = planned
    gb.save(tmp_path / "c", gparams, plan, step=0)
    assert gb.load(tmp_path / "c", model()).step == 0


def test_a_meta_opt_state_tensor_is_named_by_gb_save(tmp_path, planned):
    plan, gparams = planned
    opt_state = {"state": {0: {"exp_avg": torch.zeros(2, device="meta")}}}
    with pytest.raises(ValueError, match=r"^gb.save: opt_state tensor .* is on the meta device"):
        gb.save(tmp_path / "c", gparams, plan, opt_state=opt_state)


def test_the_hash_does_not_depend_on_the_order_of_meta_keys(tmp_path, planned):
    plan, gparams = planned
    digests = []
    for i, meta in enumerate([{"a": 1, "b": 2}, {"b": 2, "a": 1}]):
        gb.save(tmp_path / f"{i}", gparams, plan, meta=meta)
        with safetensors.safe_open(tmp_path / f"{i}", "pt") as f:
            digests.append(f.metadata()["sha256"])
    assert digests[0] == digests[1]


def test_the_header_names_the_writing_versions(saved):
    with safetensors.safe_open(saved, "pt") as f:
        metadata = f.metadata()
    assert metadata["gbfunc_version"] == gb.__version__
    assert metadata["torch_version"] == torch.__version__
    assert metadata["format"] == FORMAT
    assert metadata["format_version"] == str(FORMAT_VERSION)


# -- gb.load: where the tensors go ----------------------------------------------------------


def test_loaded_tensors_go_to_the_device_asked_for(tmp_path, planned):
    plan, gparams = planned
    opt = torch.optim.AdamW(gb.trainable_leaves(gparams))
    loss = sum(t.sum() for t in gb.trainable_leaves(gparams))
    loss.backward()
    opt.step()
    gb.save(tmp_path / "c", gparams, plan, opt_state=opt.state_dict())
    loaded = gb.load(tmp_path / "c", model(), device="meta")  # the one other device here
    leaves = [t for group in ("free", "frozen") for t in loaded.gparams[group].values()]
    leaves += [t for s in loaded.gparams["stacks"].values() for t in s.values()]
    assert leaves
    assert all(t.is_meta for t in leaves)
    states = loaded.opt_state["state"].values()
    assert all(t.is_meta for s in states for t in s.values() if isinstance(t, torch.Tensor))
    on_cpu = gb.load(tmp_path / "c", model())
    assert all(t.device.type == "cpu" for t in on_cpu.gparams["free"].values())
    assert all(t.requires_grad for t in on_cpu.gparams["free"].values())


# -- gb.load: the header --------------------------------------------------------------------


def test_an_eight_byte_file_is_a_truncated_header(tmp_path):
    path = tmp_path / "eight"
    path.write_bytes(struct.pack("<Q", 100))
    load_fails(path, r"the file is truncated: it has 8 bytes, its header needs 108\.$")
    path.write_bytes(struct.pack("<Q", 100)[:7])
    load_fails(path, r"it has 7 bytes, too few for a header\.$")


@pytest.mark.parametrize(
    ("size", "first"),
    [(MAX_HEADER + 1, b"{"), (2**63 + 5, b"{"), (10, b"x")],
    ids=["over the bound", "high bit set", "not json"],
)
def test_a_header_length_that_cannot_be_ours_is_not_a_checkpoint(tmp_path, size, first):
    path = tmp_path / "other"
    path.write_bytes(struct.pack("<Q", size) + first + b"0" * 20)
    expected = (
        ": not a gbfunc checkpoint (not a safetensors file: its first 8 bytes are not the length "
        "of a JSON header); gb.save writes those."
    )
    load_fails(path, f"{re.escape(expected)}$")


def test_a_header_exactly_at_the_bound_is_read_as_truncated(tmp_path):
    path = tmp_path / "bound"
    path.write_bytes(struct.pack("<Q", MAX_HEADER) + b"{}")
    load_fails(path, f"it has 10 bytes, its header needs {MAX_HEADER + 8}\\.$")


@pytest.mark.parametrize(
    ("header", "match"),
    [
        (b'{"__metadata__": [1]}', r"the header is damaged \(metadata entries must be strings\)"),
        (b'{"__metadata__": {"format": 1}}', r"damaged \(metadata entries must be strings\)"),
        (b'{"w": [0, 4]}', r"damaged \(tensor 'w' has data_offsets None; expected \[begin, end\]"),
        (
            b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [10, 5]}}',
            r"damaged \(tensor 'w' has data_offsets \[10, 5\]",
        ),
        (b'{"__metadata__": {"format": "other"}}', f"no '{FORMAT}' header"),
    ],
    ids=["metadata list", "metadata int", "entry list", "offsets reversed", "no tensors"],
)
def test_a_malformed_header_is_named(tmp_path, header, match):
    path = tmp_path / "crafted"
    raw_file(path, header)  # nothing after it: no tensor needs bytes
    load_fails(path, match, gb.CheckpointCorruptError)


def test_a_tensor_of_the_wrong_shape_is_named_with_both_shapes(saved):
    def reshaped(tensors: dict, metadata: dict) -> None:
        tensors["free/1.weight"] = torch.ones(4)

    forge(saved, reshaped)
    expected = (
        ": inconsistent contents (gparams: gparams['free']['1.weight'] has shape (4,); "
        f"expected (8,). {HINT})."
    )
    load_fails(saved, f"{re.escape(expected)}$", gb.CheckpointCorruptError)


def test_tensors_past_the_end_give_the_size_they_need(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[:-10])
    load_fails(saved, f"it has {len(data) - 10} bytes, its tensors need {len(data)}\\.$")


def test_tensor_bytes_that_do_not_fit_their_shape_are_damage(tmp_path):
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION)}
    header = {"__metadata__": metadata, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}
    path = tmp_path / "short"
    raw_file(path, json.dumps(header).encode(), b"\0" * 4)
    load_fails(path, r": the file is damaged \(.+\)\.$", gb.CheckpointCorruptError)


# -- gb.load: file kinds and read errors ----------------------------------------------------


def test_a_fifo_swapped_in_after_the_check_is_refused_without_blocking(tmp_path, monkeypatch):
    regular, fifo = tmp_path / "regular", tmp_path / "pipe"
    regular.write_bytes(b"x")
    os.mkfifo(fifo)
    real_stat = os.stat
    # `os.stat` reports a regular file, as if the FIFO replaced it between the check and open.
    monkeypatch.setattr(
        os, "stat", lambda p, *a, **k: real_stat(regular if str(p) == str(fifo) else p, *a, **k)
    )
    outcome: list[BaseException] = []

    def load() -> None:
        try:
            gb.load(fifo, model())
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=10)
    if thread.is_alive():  # release the blocked open before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("gb.load blocked opening a FIFO")
    assert isinstance(outcome[0], gb.CheckpointCorruptError), outcome
    message = (
        f"gb.load: {fifo}: not a regular file (a FIFO); a checkpoint is a file written by gb.save."
    )
    assert str(outcome[0]) == message


def test_a_file_that_cannot_be_opened_says_why(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    os.symlink(a, b)
    os.symlink(b, a)
    strerror = os.strerror(errno.ELOOP)
    error = load_fails(
        a, re.escape(f": cannot be read ({strerror})."), gb.CheckpointUnreadableError
    )
    # Not "no checkpoint here": a resume that starts afresh on FileNotFoundError would then
    # save over a checkpoint it could not read.
    assert not isinstance(error, FileNotFoundError)


def test_a_read_error_after_opening_says_why(saved, monkeypatch):
    real_fdopen = os.fdopen

    class FailingRead:
        def __init__(self, file) -> None:
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.file.close()

        def fileno(self) -> int:
            return self.file.fileno()

        def read(self, size: int) -> bytes:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdopen", lambda fd, *a, **k: FailingRead(real_fdopen(fd, *a, **k)))
    strerror = os.strerror(errno.EIO)
    error = load_fails(
        saved, re.escape(f": cannot be read ({strerror})."), gb.CheckpointUnreadableError
    )
    assert not isinstance(error, FileNotFoundError)


# -- where gb.save writes -----------------------------------------------------------------


def test_save_through_a_symlink_replaces_the_file_it_names_and_keeps_the_link(saved, planned):
    plan, gparams = planned
    link = saved.parent / "latest.safetensors"
    link.symlink_to(saved.name)
    gb.save(link, gparams, plan, step=7)
    assert link.is_symlink()
    assert os.readlink(link) == saved.name
    assert gb.load(saved, model()).step == 7


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_save_refuses_a_path_that_holds_no_regular_file_and_leaves_it(tmp_path, planned, kind):
    plan, gparams = planned
    path = tmp_path / "c.safetensors"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    what = {"fifo": "a FIFO", "directory": "a directory"}[kind]
    with pytest.raises(gb.CheckpointError, match=f"{re.escape(str(path))}: cannot be written") as e:
        gb.save(path, gparams, plan)
    assert f"not a regular file but {what}" in str(e.value)
    assert path.is_fifo() if kind == "fifo" else path.is_dir()
    assert os.listdir(tmp_path) == [path.name]


@pytest.mark.parametrize("letter", ["c", "é"])  # one byte, two bytes
def test_save_takes_a_file_name_as_long_as_the_file_system_allows(tmp_path, planned, letter):
    plan, gparams = planned
    room = os.pathconf(tmp_path, "PC_NAME_MAX") - len(".safetensors")
    path = tmp_path / (letter * (room // len(letter.encode())) + ".safetensors")
    gb.save(path, gparams, plan, step=3)  # its temporary file's name must fit too
    assert gb.load(path, model()).step == 3


def test_a_sharded_checkpoint_whose_folder_cannot_be_searched_is_unreadable(tmp_path, monkeypatch):
    import pathlib

    import gbfunc.dist as gbd

    def denied(self):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(pathlib.Path, "is_file", denied)  # (root may search any folder)
    with pytest.raises(gb.CheckpointUnreadableError, match=r"cannot read gbfunc\.json"):
        gbd.load_sharded(tmp_path / "s", model())
