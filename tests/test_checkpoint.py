"""gb.save / gb.load: bitwise round trips, exact resumption, validation, atomicity, size."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import safetensors
import safetensors.torch
import torch
from conv1d import Conv1D
from forged import forge, in_plan
from torch import nn
from torch.func import functional_call

import gbfunc as gb
from gbfunc._serial import plan_from_json, plan_to_json


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 6))


def leaves(gparams: dict) -> list[torch.Tensor]:
    """Trainable leaves in gb.init order, for torch.optim."""
    stacks = [t for s in gparams["stacks"].values() for t in s.values()]
    return stacks + list(gparams["free"].values())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def assert_trees_equal(a: object, b: object, path: str = "") -> None:
    """Same structure, same types, tensors bitwise equal (dtype included)."""
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert torch.equal(_bytes(a), _bytes(b)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_trees_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_trees_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), path  # NaN == NaN here


@pytest.mark.parametrize(
    ("model", "kwargs"),
    [
        (mlp(), {"tile": (8, 8)}),
        (nn.Conv2d(3, 8, 3), {"tile": (4, 2), "window_in": "output", "depth": 2}),
        (nn.MultiheadAttention(16, 2), {"tile": (4, 8), "share": True, "encoding": "fourier"}),
        (nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 9)), {"tile": "full", "embeddings": True}),
        (nn.Conv2d(3, 8, 3), {"tile": (4, 2), "hashed": 5, "share": True}),
    ],
    ids=["mlp", "conv", "attention-shared", "embedding-full", "conv-hashed-shared"],
)
def test_plan_json_round_trip_gives_an_equal_plan(model, kwargs):
    plan = gb.plan(model, **kwargs)
    again = plan_from_json(plan_to_json(plan))
    assert again == plan
    assert hash(again) == hash(plan)
    assert again.fingerprint() == plan.fingerprint()
    assert [p.fan_in for p in again.generated] == [p.fan_in for p in plan.generated]


def test_a_plan_written_before_fan_ins_reads_them_from_its_shapes():
    """Plan JSON without `fan_in` (gbfunc before 2026-12-02): torch's reading of each shape,
    the plan and its fingerprint as they were."""
    plan = gb.plan(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8, 5)), tile=(4, 4))
    data = json.loads(plan_to_json(plan))
    for p in data["params"]:
        p.pop("fan_in", None)
    old = plan_from_json(json.dumps(data))
    assert old == plan
    assert old.fingerprint() == plan.fingerprint()
    assert {p.name: p.fan_in for p in old.generated} == {"0.weight": 27, "2.weight": 8} | {
        p.name: 1 for p in old.generated if len(p.shape) == 1
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_round_trip_is_bitwise(tmp_path, dtype):
    model = mlp()
    model[0].bias.requires_grad_(False)  # a frozen leaf too
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan, seed=3, dtype=dtype)
    opt = torch.optim.Adam(leaves(gparams), lr=1e-2)
    params = gb.apply(gparams, plan)
    functional_call(
        model, params, (torch.randn(5, 24, dtype=dtype),)
    ).float().square().mean().backward()
    opt.step()
    meta = {"run": "test", "lr": 1e-2, "tags": ["a", "b"], "nested": {"x": None}}
    gb.save(
        tmp_path / "c.safetensors", gparams, plan, opt_state=opt.state_dict(), step=7, meta=meta
    )

    ckpt = gb.load(tmp_path / "c.safetensors", model)
    loaded, plan2, opt_state, step, meta2 = ckpt  # unpackable
    assert (plan2, step, meta2) == (plan, 7, meta)
    assert_trees_equal(loaded, gparams)
    for group in ("stacks", "free", "frozen"):
        for t in torch.utils._pytree.tree_leaves(loaded[group]):
            assert t.is_leaf
            assert t.requires_grad == (group != "frozen")
    assert_trees_equal(opt_state, opt.state_dict())


def test_a_plain_pytree_opt_state_round_trips(tmp_path):
    plan = gb.plan(mlp(), tile=(8, 8))
    gparams = gb.init(plan)
    state = {
        "adamw": gb.optim.adamw_init(gparams),
        3: (torch.arange(4), [1, 2.5, None, True, "s", float("inf")]),
        "empty": (torch.zeros(0, 3), {}, [], ()),
        "scalar": torch.tensor(2.0, dtype=torch.float64),
    }
    gb.save(tmp_path / "c.safetensors", gparams, plan, opt_state=state)
    assert_trees_equal(gb.load(tmp_path / "c.safetensors", mlp()).opt_state, state)


@pytest.mark.parametrize(
    "tagged",
    [
        '{"$tensor": "meta/0"}',
        '{"$dict": [[1]]}',
        '{"$tuple": 3}',
        "[" * 5000,
        '{"$tuple": [1], "$dict": []}',  # a node holds one tag
        '{"$tuple": [1], "extra": 2}',
    ],
)
def test_a_forged_tagged_meta_is_refused_as_corrupt(saved, tagged):
    forge(saved, lambda tensors, metadata: metadata.update(meta_tagged=tagged))
    with pytest.raises(gb.CheckpointCorruptError, match=f"{saved}: unreadable metadata"):
        gb.load(saved, mlp())


@pytest.mark.parametrize(
    "meta",
    [
        {"config": {"tile": (64, 64), "hidden": 8}, "tags": ("a", ["b", ()])},
        {"by_epoch": {1: 0.5, "best": 2}, 3: None},
        (1, "a"),
    ],
)
def test_a_meta_with_tuples_and_int_keys_comes_back_equal(tmp_path, meta):
    # JSON returned lists and string keys in their place (and mixed keys failed sort_keys)
    plan = gb.plan(mlp(), tile=(8, 8))
    gb.save(tmp_path / "c.safetensors", gb.init(plan), plan, meta=meta)
    back = gb.load(tmp_path / "c.safetensors", mlp()).meta
    assert back == meta
    assert repr(back) == repr(meta)


def test_a_meta_json_cannot_hold_is_refused_naming_it_and_the_previous_file_kept(tmp_path):
    plan = gb.plan(mlp(), tile=(8, 8))
    path = tmp_path / "c.safetensors"
    gb.save(path, gb.init(plan), plan, meta={"run": 1})
    before = path.read_bytes()
    for meta, found in [
        ([{"f": print}], r"meta\[0\]\['f'\] is a builtin_function_or_method"),
        ({"w": (torch.ones(2),)}, r"meta\['w'\]\[0\] is a Tensor"),
    ]:
        with pytest.raises(TypeError, match="gb.save: meta must be JSON-serialisable: " + found):
            gb.save(path, gb.init(plan, seed=1), plan, meta=meta)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["c.safetensors"]


def _train(model, plan, gparams, opt, steps: range) -> list[float]:
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 24, generator=gen), torch.randn(16, 6, generator=gen)
        opt.zero_grad()
        loss = (functional_call(model, gb.apply(gparams, plan), (x,)) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_resumed_training_follows_the_uninterrupted_trajectory_exactly(tmp_path):
    model = mlp()
    plan = gb.plan(model, tile=(8, 8))

    straight = gb.init(plan, seed=1)
    opt = torch.optim.Adam(leaves(straight), lr=3e-3)
    straight_losses = _train(model, plan, straight, opt, range(6))

    first = gb.init(plan, seed=1)
    opt = torch.optim.Adam(leaves(first), lr=3e-3)
    losses = _train(model, plan, first, opt, range(3))
    gb.save(tmp_path / "c.safetensors", first, plan, opt_state=opt.state_dict(), step=3)
    del first, opt

    resumed, plan2, opt_state, step, _ = gb.load(tmp_path / "c.safetensors", mlp())
    opt = torch.optim.Adam(leaves(resumed), lr=3e-3)
    opt.load_state_dict(opt_state)
    losses += _train(model, plan2, resumed, opt, range(step, 6))

    assert losses == straight_losses
    assert_trees_equal(resumed, straight)


@pytest.mark.parametrize(
    ("tile", "hidden"), [((64, 64), 32), ((128, 128), 16)], ids=["torchGB-like", "large-tiles"]
)
def test_compressed_checkpoint_is_about_compression_times_smaller(tmp_path, capsys, tile, hidden):
    model = nn.Sequential(
        nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)
    )
    plan = gb.plan(model, tile=tile, hidden=hidden)
    gparams = gb.init(plan)
    gb.save(tmp_path / "c.safetensors", gparams, plan)
    gb.save_dense(tmp_path / "d.safetensors", gparams, plan, model=model)
    compressed, dense = (os.path.getsize(tmp_path / f) for f in ("c.safetensors", "d.safetensors"))
    rep = gb.report(plan)
    ratio = dense / compressed
    with capsys.disabled():
        print(
            f"\n{tile} tiles, hidden {hidden}: checkpoint {compressed:,} B vs dense state_dict "
            f"{dense:,} B: {ratio:.1f}x smaller "
            f"(report: whole model {rep.compression:.1f}x, "
            f"generated part {rep.generated_compression:.1f}x)"
        )
    assert ratio == pytest.approx(rep.compression, rel=0.1)


def _corrupt(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path):
    plan = gb.plan(mlp(), tile=(8, 8))
    path = tmp_path / "c.safetensors"
    gb.save(path, gb.init(plan), plan, step=1)
    return path


def test_missing_file(tmp_path):
    path = tmp_path / "nope.safetensors"
    with pytest.raises(gb.CheckpointNotFoundError, match=f"gb.load: {path}: no such file") as e:
        gb.load(path, mlp())
    assert isinstance(e.value, FileNotFoundError)
    assert isinstance(e.value, gb.CheckpointError)


@pytest.mark.parametrize("keep", [0, 5, 100, -1])
def test_truncated_file(saved, keep):
    data = saved.read_bytes()
    saved.write_bytes(data[: keep if keep >= 0 else len(data) - 1])
    with pytest.raises(gb.CheckpointCorruptError, match=f"{saved}: the file is truncated"):
        gb.load(saved, mlp())


def test_bit_flip_in_the_tensor_data(saved):
    _corrupt(saved, saved.stat().st_size - 10)
    with pytest.raises(gb.CheckpointCorruptError, match=f"{saved}: SHA-256 mismatch"):
        gb.load(saved, mlp())


def test_bit_flip_in_the_json_metadata(saved):
    data = saved.read_bytes()
    _corrupt(saved, data.index(b'\\"scale\\":') + 4)  # inside the plan's JSON
    with pytest.raises(
        gb.CheckpointCorruptError, match=f"{saved}: (SHA-256 mismatch|the header is damaged)"
    ):
        gb.load(saved, mlp())


def _rewrite_metadata(path, **changes) -> None:
    with safetensors.safe_open(path, "pt") as f:
        metadata = {**f.metadata(), **changes}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    safetensors.torch.save_file(tensors, path, metadata)


def test_unknown_format_version(saved):
    _rewrite_metadata(saved, format_version="4", gbfunc_version="9.0")
    with pytest.raises(
        gb.CheckpointVersionError,
        match=rf"{saved}: format version 4 .*gbfunc 9.0.*reads versions \(1, 2, 3\)",
    ):
        gb.load(saved, mlp())


def test_a_forged_file_with_a_valid_hash_but_a_missing_tensor(saved):
    forge(saved, lambda tensors, metadata: tensors.pop("free/0.bias"))
    with pytest.raises(
        gb.CheckpointCorruptError,
        match=f"{saved}: inconsistent contents \\(tensor 'free/0.bias' is missing",
    ):
        gb.load(saved, mlp())


@pytest.mark.parametrize(
    ("store", "entry", "dtype"),
    [
        ("buffers", "entry 'buffers/scale'", "float8_e8m0fnu"),  # written, not read back
        ("opt_state", "opt_state\\['x'\\]", "complex128"),  # not written (a bare KeyError)
    ],
)
def test_a_dtype_safetensors_cannot_read_back_is_refused_and_the_previous_file_kept(
    tmp_path, store, entry, dtype
):
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 8)
            self.register_buffer("scale", torch.ones(4))

    model = Scaled()
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan)
    path = tmp_path / "c.safetensors"
    gb.save(path, gparams, plan, step=1)
    odd = torch.zeros(4, dtype=getattr(torch, dtype))
    extra = {"buffers": {"scale": odd}} if store == "buffers" else {"opt_state": {"x": odd}}
    with pytest.raises(TypeError, match=rf"gb\.save: {entry} is torch\.{dtype}, which safetens"):
        gb.save(path, gparams, plan, step=2, **extra)
    assert gb.load(path, model).step == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


def test_a_path_ending_in_a_separator_is_refused_not_written_as_a_file(tmp_path):
    plan = gb.plan(nn.Linear(16, 8), tile=(8, 8))
    with pytest.raises(gb.CheckpointError, match=r"names a directory; give a file name"):
        gb.save(f"{tmp_path}/new/", gb.init(plan), plan)
    assert not (tmp_path / "new").exists()


def test_not_a_gbfunc_checkpoint(tmp_path):
    path = tmp_path / "dense.safetensors"
    safetensors.torch.save_file(mlp().state_dict(), path)
    with pytest.raises(gb.CheckpointCorruptError, match=f"{path}: not a gbfunc checkpoint"):
        gb.load(path, mlp())


def test_checkpoint_of_a_different_model_names_the_parameter(saved):
    other = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 7))
    with pytest.raises(
        gb.CheckpointMismatchError,
        match=r"parameter '2.weight' has shape \(6, 40\) in the checkpoint but \(7, 40\)",
    ):
        gb.load(saved, other)
    renamed = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 6))
    with pytest.raises(
        gb.CheckpointMismatchError,
        match=r"parameter #2 is '2.weight' \(6, 40\) in the checkpoint but '1.weight'",
    ):
        gb.load(saved, renamed)
    longer = nn.Sequential(*mlp(), nn.Linear(6, 2))
    with pytest.raises(
        gb.CheckpointMismatchError,
        match=r"the model's parameter '3.weight' \(2, 6\) is not in the checkpoint",
    ):
        gb.load(saved, longer)


def test_a_failed_save_leaves_the_previous_file_and_no_temporary(saved, monkeypatch):
    before = saved.read_bytes()

    def half_write(tensors, path, metadata):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", half_write)
    plan = gb.plan(mlp(), tile=(8, 8))
    with pytest.raises(gb.CheckpointError, match=r"cannot be written \(disk full\)"):
        gb.save(saved, gb.init(plan, seed=5), plan)
    assert saved.read_bytes() == before
    assert sorted(os.listdir(saved.parent)) == [saved.name]


# The saver stops at a named point of its second save, says so, and waits to be killed: the
# kill lands at a known point, whatever the machine's load.
_SAVER = textwrap.dedent(
    """
    import os, sys, safetensors.torch, torch, gbfunc as gb
    from torch import nn
    path, point = sys.argv[1], sys.argv[2]
    plan = gb.plan(nn.Linear(32, 32), tile=(8, 8))
    gparams = gb.init(plan)
    gb.save(path, gparams, plan, step=0)
    real_save, real_replace = safetensors.torch.save_file, os.replace

    def stop(where):
        print(where, flush=True)
        sys.stdin.read()  # killed here

    def torn_save(tensors, tmp, metadata):  # half the file is on disk
        real_save(tensors, tmp, metadata)
        with open(tmp, "r+b") as f:
            f.truncate(os.path.getsize(tmp) // 2)
        stop("torn")

    def late_replace(src, dst):  # whole and synced, not yet renamed
        stop("written")

    if point == "torn":
        safetensors.torch.save_file = torn_save
    else:
        os.replace = late_replace
    gb.save(path, gparams, plan, opt_state={"blob": torch.randn(1000)}, step=1)
    """
)


@pytest.mark.parametrize("point", ["torn", "written"])
def test_sigkill_during_save_leaves_the_previous_checkpoint(tmp_path, point):
    path = tmp_path / "c.safetensors"
    cmd = [sys.executable, "-c", _SAVER, str(path), point]
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout.readline().strip() == point
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert any(n.endswith(".tmp") for n in os.listdir(tmp_path))  # the interrupted write
    ckpt = gb.load(path, nn.Linear(32, 32))  # hash verified: the previous file, whole
    assert ckpt.step == 0
    assert ckpt.opt_state is None
    assert ckpt.plan == gb.plan(nn.Linear(32, 32), tile=(8, 8))


_RANK = textwrap.dedent(
    """
    import sys, json, torch, torch.distributed as dist, gbfunc as gb, gbfunc.dist
    from torch import nn
    rank, store_path, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.manual_seed(0)
    model = nn.Linear(16, 8)  # the same model on every rank, as DDP users build it
    plan = gb.plan(model, tile=(4, 4))
    gparams = gb.init(plan, seed=0)  # bitwise the same replica on every rank
    gb.dist.save_replicated(path, gparams, plan, step=5, meta={"writer": rank})
    ckpt = gb.load(path, model)  # every rank reads, right after the collective
    same = all(torch.equal(a, b) for a, b in zip(
        torch.utils._pytree.tree_leaves(ckpt.gparams), torch.utils._pytree.tree_leaves(gparams)))
    out = {"rank": rank, "meta": ckpt.meta, "step": ckpt.step, "same": same}
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    """
)


def test_replicated_save_rank0_writes_all_ranks_read(tmp_path):
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    args = [str(tmp_path / "store"), str(tmp_path / "c.safetensors")]
    outs = []
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), *args], stdout=subprocess.PIPE, text=True, env=env
        )
        for r in range(2)
    ]
    for p in procs:
        with p:
            out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for rank, out in enumerate(outs):
        assert out == {"rank": rank, "meta": {"writer": 0}, "step": 5, "same": True}


def _set(path: str, value: object):
    """An `edit_plan` edit setting `data[k1][k2]...` (path `"params.0.scale"`) to `value`."""

    def edit(data):
        *keys, last = (int(k) if k.isdigit() else k for k in path.split("."))
        for k in keys:
            data = data[k]
        data[last] = value

    return edit


def twin() -> nn.Module:
    """Two layers on one stack of 8x8 tiles: tiles 0-3 for `0.weight`, 4-7 for `2.weight`."""
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


def _alias_opt_state(tensors, metadata) -> None:
    metadata["opt_state"] = json.dumps({"$tensor": "free/0.bias"})


CRAFTED = {
    # Beyond tests/test_checkpoint_files.py: types, geometry, labels, stray and aliased tensors.
    "float-shape": (
        in_plan(_set("params.0.shape", [16.0, 16])),
        r"the plan is malformed: params\[0\] \('0.weight'\)\.shape is \(16\.0, 16\)",
    ),
    "kernel-dict": (
        in_plan(_set("stacks.0.window", {"a": 1})),
        r"stacks\[0\]\.window is \{'a': 1\}",
    ),
    "labels": (
        in_plan(_set("stacks.0.genome.row_labels", [4, 4])),
        r"inconsistent: 0.weight has row_labels=\(4, 4\), which label neurons, but its tile",
    ),
    "first-tile-beyond": (
        in_plan(_set("params.2.blocks.0.first_tile", 6)),
        r"\('2.weight'\)\.blocks\[0\] \(tiles 6 to 9\) is outside its stack 's0_8x8' of 8 tiles",
    ),
    "unused-tiles": (
        in_plan(_set("stacks.0.tiles_per_gnet", [1] * 9)),
        "tiles 8 to 8 of 's0_8x8' belong to no block",
    ),
    "negative-grid": (in_plan(_set("params.0.blocks.0.grid", [-2, -2])), r"\.grid is \(-2, -2\)"),
    "string-rows": (in_plan(_set("params.0.blocks.0.rows", "16")), r"\.rows is '16'"),
    "geometry": (
        in_plan(_set("stacks.0.row_width", 9)),
        r"stacks\[0\] \(outputs, columns, row_width, col_width\) is \(1, 8, 9, 3\); "
        r"expected \(1, 8, 3, 3\)",
    ),
    "dtype": (in_plan(_set("params.1.dtype", "float99")), r"\.dtype is 'float99'"),
    "stack-key": (in_plan(_set("stacks.0.key", "../x")), r"\.key is '\.\./x'"),
    "genome": (
        in_plan(_set("stacks.0.genome.hidden", 0)),
        "unreadable metadata .*gb.Genome: hidden must be an integer >= 1, got 0",
    ),
    "unknown-field": (in_plan(_set("params.0.evil", 1)), "malformed plan JSON"),
    "step-negative": (lambda t, m: m.update(step="-3"), "step must be an int >= 0 or null, got -3"),
    "extra-tensor": (
        lambda t, m: t.update(evil=torch.zeros(2)),
        "tensor 'evil' belongs to neither the plan nor opt_state",
    ),
    "opt-state-alias": (_alias_opt_state, "the optimizer state refers to tensor 'free/0.bias'"),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_checkpoint_with_a_valid_hash_is_refused(tmp_path, name):
    change, match = CRAFTED[name]
    plan = gb.plan(twin(), tile=(8, 8))
    path = tmp_path / "c.safetensors"
    gb.save(path, gb.init(plan), plan, step=2)
    gb.load(path, twin())
    forge(path, change)
    with pytest.raises(gb.CheckpointCorruptError, match=match) as info:
        gb.load(path, twin())
    assert str(info.value).startswith(f"gb.load: {path}: ")


def test_a_crafted_plan_for_another_shape_is_a_mismatch(tmp_path):
    plan = gb.plan(twin(), tile=(8, 8))
    path = tmp_path / "c.safetensors"
    gb.save(path, gb.init(plan), plan)
    forge(path, in_plan(_set("params.0.shape", [16, 17])))
    with pytest.raises(
        gb.CheckpointMismatchError, match=r"'0.weight' has shape \(16, 17\) in the checkpoint"
    ):
        gb.load(path, twin())


class WithCounts(nn.Module):
    """A layer with an integer parameter, which can only be frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.counts = nn.Parameter(torch.arange(4), requires_grad=False)


def test_an_integer_frozen_parameter_round_trips_and_keeps_its_dtype(tmp_path):
    model = WithCounts()
    plan = gb.plan(model, tile=(4, 4))
    gparams = gb.init(plan)
    path = tmp_path / "c.safetensors"
    gb.save(path, gparams, plan)
    loaded = gb.load(path, WithCounts()).gparams
    assert loaded["frozen"]["counts"].dtype == torch.int64
    assert torch.equal(loaded["frozen"]["counts"], torch.arange(4))

    def as_float(tensors, metadata):
        tensors["frozen/counts"] = tensors["frozen/counts"].float()

    forge(path, as_float)
    with pytest.raises(
        gb.CheckpointCorruptError,
        match=r"gparams\['frozen'\]\['counts'\] has dtype torch.float32; expected torch.int64",
    ):
        gb.load(path, WithCounts())


def test_plans_of_every_kind_pass_the_checks_of_gb_load(tmp_path):
    paper = {
        "tile": "full",
        "biases": True,
        "center": True,
        "overrides": {"1.weight": {"col_labels": (4, 4)}, "3.*": {"row_labels": "onehot"}},
    }
    cases = [
        (lambda: nn.Conv2d(3, 8, 3), {"tile": (4, 2), "window_in": "output", "depth": 2}),
        (lambda: nn.Conv1d(5, 11, 3), {"tile": (4, 4), "encoding": "gray"}),
        (lambda: nn.TransformerEncoderLayer(16, 2, 32), {"tile": (4, 8), "share": True}),
        (lambda: nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 9)), {"embeddings": True}),
        (lambda: nn.Linear(50, 70), {"tile": (16, 7), "outputs": 3}),
        (lambda: nn.Linear(50, 70), {"tile": (16, 7), "outputs": 3, "hashed": 9}),
        (lambda: nn.ModuleDict({"c_attn": Conv1D(48, 16)}), {"tile": (8, 8)}),
        (lambda: nn.Sequential(Conv1D(16, 8), nn.ReLU(), Conv1D(4, 16)), {"tile": (8, 8)}),
        (
            lambda: nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3)),
            paper,
        ),
    ]
    for i, (make, options) in enumerate(cases):
        torch.manual_seed(i)
        model = make()
        plan = gb.plan(model, **options)
        gb.save(tmp_path / f"{i}.safetensors", gb.init(plan), plan)
        assert gb.load(tmp_path / f"{i}.safetensors", make()).plan == plan, options
