"""Sharded checkpoints (`gb.dist.save_sharded` / `load_sharded`) on real gloo ranks.

Saved by 2 ranks after a training step; loaded by one process without a process group and by
4 ranks, each reading only its own g-nets; damaged and mismatched checkpoints fail clearly.
"""

import dataclasses
import errno
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_files
import torch.utils._pytree as pytree
from sharded_files import data_of, entries, rewrite
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, loss_fn
from gbfunc.dist import _layout
from gbfunc.dist.testing import spawn

CFG = GPTConfig(vocab=64, dim=32, layers=2, heads=4, seq=16)
TILE = (16, 16)


def _model() -> GPT:
    with torch.device("meta"):
        return GPT(CFG)


def _batch() -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (4, CFG.seq), generator=torch.Generator().manual_seed(1))


def _digest(gparams: dict) -> str:
    leaves = gb.trainable_leaves(gparams) + list(gparams["frozen"].values())
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in leaves)).hexdigest()


def save_worker(rank: int, world: int, path: str) -> dict:
    gbd.init_mesh()
    model = _model()
    plan = gb.plan(model, tile=TILE)
    owned = gbd.RankOwned(plan)
    local = owned.shard(gb.init(plan, seed=0))
    sync = gbd.GradSync(list(local["free"].values()))
    x = _batch()
    loss_fn(functional_call(model, owned.apply(local), (x,)), x).backward()
    sync.wait()
    with torch.no_grad():  # one SGD step, so the saved values are not gb.init's
        for leaf in gb.trainable_leaves(local):
            leaf -= 0.5 * leaf.grad
    refused = None
    try:  # rank 1's meta cannot be written: every rank raises, before anything is written
        gbd.save_sharded(path, local, owned, meta={"run": "a"} if rank == 0 else {1: object()})
    except (TypeError, gb.CheckpointError) as e:
        refused = f"{type(e).__name__}: {e}"
    try:  # rank 1 passes `plan=` besides `owned`: refused there, and on rank 0, no rank hangs
        gbd.save_sharded(path, local, owned, **({"plan": plan} if rank == 1 else {}))
    except (TypeError, gb.CheckpointError) as e:
        refused += f" | {type(e).__name__}: {e}"
    untouched = not os.path.exists(path)
    gbd.save_sharded(path, local, owned, step=1, meta={"run": "a"})
    # rank 1 passes the whole gparams as `into` (not its shard): refused there; rank 0, which
    # would have gone on into DCP's collective read and waited, raises naming rank 1
    into = owned.shard(gb.init(plan, seed=1)) if rank == 0 else gb.init(plan, seed=1)
    before = _digest(into)
    try:
        gbd.load_sharded(path, model, owned, into=into)
        load_refused = None
    except (ValueError, gb.CheckpointError) as e:
        load_refused = f"{type(e).__name__}: {e}"
    load_refused = (load_refused, _digest(into) == before)
    full = owned.gather(local)
    with torch.no_grad():
        loss = loss_fn(functional_call(model, owned.apply(local), (x,)), x).item()
    drifted = _save_drifted(rank, f"{path}-drifted")
    return {
        "digest": _digest(full),
        "loss": loss,
        "refused": refused,
        "untouched": untouched,
        "load_refused": load_refused,
        **drifted,
    }


def _drifted_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16))


def _save_drifted(rank: int, path: str) -> dict:
    """Replicated g-nets (`plan=`) whose copies differ between the ranks where they should
    not (a free bias) and where they may (BatchNorm's statistics, from each rank's data)."""
    torch.manual_seed(0)
    model = _drifted_model()
    plan = gb.plan(model, tile=(8, 8))
    gparams = gb.init(plan, seed=0)
    model(torch.randn(8, 16, generator=torch.Generator().manual_seed(rank)))
    with torch.no_grad():
        gparams["free"]["0.bias"] += rank
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gbd.save_sharded(path, gparams, plan=plan)
    return {
        "warned": [str(w.message) for w in caught if w.category is RuntimeWarning],
        "running_mean": model[1].running_mean.clone(),
        "bias": gparams["free"]["0.bias"].detach().clone(),
    }


def load_worker(rank: int, world: int, path: str) -> dict:
    gbd.init_mesh()
    model = _model()
    owned = gbd.RankOwned(gb.plan(model, tile=TILE))
    checkpoint = gbd.load_sharded(path, model, owned)
    local = checkpoint.gparams
    stack = owned.plan.stacks[0]
    rows = local["stacks"][stack.key]["w_in"].shape[0]
    x = _batch()
    with torch.no_grad():
        loss = loss_fn(functional_call(model, owned.apply(local), (x,)), x).item()
    # RankOwned over a data-parallel group of a dp x tp layout (groups {0, 2} and {1, 3},
    # made by every rank in one order): each group's copy is made by its members alone
    # (the copies were made as if by every rank, {0, 2} on some, {1, 3} on the others)
    pairs = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])]
    paired = gbd.RankOwned(owned.plan, group=pairs[rank % 2])
    with torch.no_grad():
        got = paired.apply(paired.shard(gb.init(owned.plan, seed=0)))
        want = gb.apply(gb.init(owned.plan, seed=0), owned.plan)
    return {
        "paired": (paired.world, all(torch.equal(got[k], want[k]) for k in want)),
        "digest": _digest(owned.gather(local)),
        "rows": rows,
        "owned": len(owned.ownership.gnets(0, owned.rank)),
        "step": checkpoint.step,
        "loss": loss,
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, list[dict]]:
    path = str(tmp_path_factory.mktemp("sharded") / "ckpt")
    return path, spawn(save_worker, 2, path)


@pytest.mark.slow
def test_sharded_checkpoint_of_two_ranks_loads_in_one_process_and_on_four_ranks(saved):
    path, written = saved
    assert written[0]["refused"].startswith(
        "CheckpointError: gb.dist.save_sharded: rank 1 failed (meta must be JSON-serialisable"
    )
    assert written[1]["refused"].startswith("TypeError: gb.dist.save_sharded: meta must be JSON")
    second = "gb.dist.save_sharded: rank 1 failed (pass `owned` (rank-owned g-nets) or `plan=`"
    assert f" | CheckpointError: {second}" in written[0]["refused"]
    assert " | TypeError: gb.dist.save_sharded: pass `owned` " in written[1]["refused"]
    assert written[0]["untouched"]
    assert written[1]["untouched"]
    (mine, kept), (theirs, kept_too) = written[1]["load_refused"], written[0]["load_refused"]
    assert mine.startswith("ValueError: gb.dist.load_sharded: ")
    assert "this rank reads" in mine
    assert theirs.startswith("CheckpointError: gb.dist.load_sharded: ")
    assert "rank 1 failed (" in theirs
    assert theirs.endswith("; nothing was loaded.")
    assert kept
    assert kept_too
    assert written[0]["digest"] == written[1]["digest"]
    model = _model()
    whole = gbd.load_sharded(path, model)  # one process, no process group: every g-net
    assert (whole.step, whole.meta) == (1, {"run": "a"})
    assert _digest(whole.gparams) == written[0]["digest"]
    x = _batch()
    with torch.no_grad():
        params = gb.apply(whole.gparams, whole.plan)
        loss = loss_fn(functional_call(GPT(CFG), params, (x,)), x).item()
    assert loss == pytest.approx(written[0]["loss"], abs=1e-6)
    four = spawn(load_worker, 4, path)
    for r in four:
        assert r["digest"] == written[0]["digest"]  # bitwise, after gathering
        assert r["rows"] == r["owned"]  # each rank read only its own g-nets
        assert r["step"] == 1
        assert r["paired"] == (2, True)
        assert r["loss"] == pytest.approx(written[0]["loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, below
def test_what_the_ranks_hold_differently_is_saved_from_rank_0_and_loads(saved):
    """Each rank's copy of a replicated entry was once written by whichever rank DCP chose,
    with another rank's digest recorded: a checkpoint that load then called damaged."""
    path, written = saved
    assert not torch.equal(written[0]["running_mean"], written[1]["running_mean"])
    model = _drifted_model()
    checkpoint = gbd.load_sharded(f"{path}-drifted", model)
    assert torch.equal(model[1].running_mean, written[0]["running_mean"])
    assert torch.equal(checkpoint.gparams["free"]["0.bias"], written[0]["bias"])
    (warning,) = written[0]["warned"]  # the bias, not the statistics; from rank 0 only
    assert warning.startswith("gb.dist.save_sharded: free/0.bias differ between the ranks")
    assert "rank's copy is saved" in warning
    assert written[1]["warned"] == []


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, below
def test_sharded_checkpoint_errors_name_the_file_and_the_entry(saved, tmp_path):
    path, _ = saved
    model = _model()
    with pytest.raises(gb.CheckpointMismatchError, match=r"gb\.dist\.load_sharded: .*ckpt"):
        gbd.load_sharded(path, GPT(GPTConfig(vocab=64, dim=48, layers=2, heads=4, seq=16)))
    with pytest.raises(gb.CheckpointNotFoundError, match=r"no gbfunc\.json"):
        gbd.load_sharded(tmp_path, model)

    # An entry altered after the manifest was written: its SHA-256 no longer matches.
    state = entries(path)
    altered = tmp_path / "altered"
    key = next(k for k in state if k.startswith("stacks/"))
    state[key] = state[key] + 1.0
    rewrite(path, altered, state)
    with pytest.raises(gb.CheckpointCorruptError, match=rf"{key} in .*\.distcp does not match"):
        gbd.load_sharded(altered, model)

    # A truncated shard file.
    truncated = tmp_path / "truncated"
    shutil.copytree(path, truncated)
    shard = sorted(data_of(truncated).glob("*.distcp"))[0]
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    with pytest.raises(gb.CheckpointCorruptError, match="a shard is missing or damaged") as e:
        gbd.load_sharded(truncated, model)
    assert f"{shard} is truncated: it has {size // 2} bytes, its entries need " in str(e.value)

    # A shard file gone.
    shard.unlink()
    with pytest.raises(gb.CheckpointCorruptError, match=rf"\({shard} is missing\)"):
        gbd.load_sharded(truncated, model)

    # A `.metadata` naming a file by a non-string: a bare TypeError came out of the check.
    odd = tmp_path / "odd"
    shutil.copytree(path, odd)
    metadata_file = data_of(odd) / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = dataclasses.replace(info, relative_path=7)
    metadata_file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(gb.CheckpointCorruptError, match="a shard is missing or damaged"):
        gbd.load_sharded(odd, model)


def _small() -> tuple[torch.nn.Module, gb.Plan, dict, torch.optim.Optimizer]:
    """A Linear-LayerNorm-Linear model, its replicated g-nets and their AdamW after 2 steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    plan = gb.plan(model, tile=(4, 4))
    gparams = gb.init(plan, seed=0)
    opt = torch.optim.AdamW(gb.trainable_leaves(gparams), lr=1e-2, weight_decay=0.1)
    _steps(model, plan, gparams, opt, 2)
    return model, plan, gparams, opt


def _steps(model, plan, gparams, opt, n: int) -> None:
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    for _ in range(n):
        functional_call(model, gb.apply(gparams, plan), (x,)).square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_one_process_resumes_gnets_and_adamw_bitwise(tmp_path):
    model, plan, gparams, opt = _small()
    gbd.save_sharded(tmp_path, gparams, plan=plan, optimizer=opt, step=2)
    fresh = gb.init(plan, seed=1)
    fresh_opt = torch.optim.AdamW(gb.trainable_leaves(fresh), lr=5.0)  # settings restored too
    checkpoint = gbd.load_sharded(tmp_path, model, into=fresh, optimizer=fresh_opt)
    assert checkpoint.gparams is fresh
    assert checkpoint.step == 2
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    assert fresh_opt.param_groups[0]["weight_decay"] == 0.1
    _steps(model, plan, gparams, opt, 1)
    _steps(model, plan, fresh, fresh_opt, 1)
    for ours, theirs in zip(gb.trainable_leaves(fresh), gb.trainable_leaves(gparams), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_leaves_in_another_dtype_than_the_models_load_as_saved(tmp_path, dtype):
    # The free leaves' templates took the model's dtype: DCP read float64 values into float32
    # ones, and the load called the shard damaged (a checksum mismatch).
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    plan = gb.plan(model, tile=(4, 4))
    gparams = gb.init(plan, seed=0, dtype=dtype)
    gbd.save_sharded(tmp_path, gparams, plan=plan, step=1)
    loaded = gbd.load_sharded(tmp_path, model).gparams
    into = gb.init(plan, seed=1, dtype=dtype)
    gbd.load_sharded(tmp_path, model, into=into)
    for got in (loaded, into):
        for ours, theirs in zip(pytree.tree_leaves(got), pytree.tree_leaves(gparams), strict=True):
            assert ours.dtype == theirs.dtype
            assert torch.equal(ours, theirs)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_meta_with_int_keys_and_tuples_comes_back_equal(tmp_path):
    # the manifest's json.dumps(sort_keys=True) failed on mixed keys after the shards were
    # written; JSON returned string keys and lists for the rest
    model, plan, gparams, _ = _small()
    meta = {1: "a", "b": (2, [3])}
    gbd.save_sharded(tmp_path, gparams, plan=plan, step=2, meta=meta)
    assert gbd.load_sharded(tmp_path, model).meta == meta


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_factored_optimizer_state_of_the_gnets_is_refused_and_the_checkpoint_kept(tmp_path):
    # Adafactor's row_var/col_var are not shaped like their g-net leaves: saved as one entry
    # each, from the lowest rank, rank-owned shards loaded rank 0's state without a word.
    model, plan, gparams, opt = _small()
    gbd.save_sharded(tmp_path, gparams, plan=plan, optimizer=opt, step=2)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    factored = torch.optim.Adafactor(gb.trainable_leaves(gparams))
    _steps(model, plan, gparams, factored, 1)
    stack = plan.stacks[0].key
    with pytest.raises(
        ValueError,
        match=rf"^gb\.dist\.save_sharded: optimizer state 'row_var' of stacks/{stack}/w_in has "
        r"shape .* Use an optimizer whose state is shaped like its parameters",
    ):
        gbd.save_sharded(tmp_path, gparams, plan=plan, optimizer=factored, step=3)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert gbd.load_sharded(tmp_path, model).step == 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_bad_resume_is_refused_before_anything_changes(tmp_path):
    model, plan, gparams, opt = _small()
    with pytest.raises(TypeError, match=r"pass `owned` .* or `plan=`"):
        gbd.save_sharded(tmp_path, gparams, optimizer=opt)
    gbd.save_sharded(tmp_path, gparams, plan=plan, optimizer=opt)
    fresh = gb.init(plan, seed=1)
    before = [t.clone() for t in gb.trainable_leaves(fresh)]
    leaves = gb.trainable_leaves(fresh)
    other = torch.optim.AdamW([{"params": leaves[:2]}, {"params": leaves[2:]}])
    with pytest.raises(gb.CheckpointMismatchError, match=r"parameter groups .* are not the"):
        gbd.load_sharded(tmp_path, model, into=fresh, optimizer=other)
    sgd = torch.optim.SGD(leaves, lr=0.5, momentum=0.9)  # took AdamW's rate and moments
    with pytest.raises(gb.CheckpointMismatchError, match=r"AdamW's and the optimizer .*SGD"):
        gbd.load_sharded(tmp_path, model, into=fresh, optimizer=sgd)
    assert sgd.param_groups[0]["lr"] == 0.5
    assert not sgd.state
    stranger = torch.optim.AdamW([torch.zeros(3, requires_grad=True)])
    with pytest.raises(ValueError, match=r"holds a tensor of shape \(3,\) that is not"):
        gbd.load_sharded(tmp_path, model, into=fresh, optimizer=stranger)
    wrong = gb.init(plan, seed=1)
    wrong["free"]["0.bias"] = torch.zeros(3)
    with pytest.raises(
        ValueError, match=r"into\['free'\]\['0\.bias'\] is \(3,\); this rank reads \(16,\)"
    ):
        gbd.load_sharded(tmp_path, model, into=wrong)
    del wrong["stacks"][plan.stacks[0].key]["w_in"]
    with pytest.raises(ValueError, match=r"into\['stacks'\]\['s0_4x4'\]\['w_in'\] is NoneType"):
        gbd.load_sharded(tmp_path, model, into=wrong)
    with pytest.raises(ValueError, match=r"restoring an optimizer needs `into`"):
        gbd.load_sharded(tmp_path, model, optimizer=opt)
    # An optimizer entry altered after the manifest was written.
    state = entries(tmp_path)
    key = next(k for k in state if k.startswith("optim/") and k.endswith("/exp_avg"))
    state[key] += 1.0
    altered = tmp_path / "altered"
    rewrite(tmp_path, altered, state)
    fresh_opt = torch.optim.AdamW(leaves)
    with pytest.raises(gb.CheckpointCorruptError, match=rf"{key} in .* does not match"):
        gbd.load_sharded(altered, model, into=fresh, optimizer=fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(before, gb.trainable_leaves(fresh), strict=True))
    assert not fresh_opt.state  # nothing restored from a damaged checkpoint


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_gparams_of_another_plan_are_refused_and_the_checkpoint_kept(tmp_path):
    model, plan, gparams, _ = _small()
    gbd.save_sharded(tmp_path, gparams, plan=plan, step=1)
    wider = gb.init(gb.plan(model, tile=(4, 4), hidden=plan.stacks[0].genome.hidden * 2))
    with pytest.raises(ValueError, match=r"gb.dist.save_sharded: gparams\['stacks'\].* shape"):
        gbd.save_sharded(tmp_path, wider, plan=plan, step=2)
    with pytest.raises(TypeError, match=r"plan must be a gb.Plan"):
        gbd.save_sharded(tmp_path, gparams, plan=model, step=2)
    assert gbd.load_sharded(tmp_path, model).step == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_into_that_cannot_take_the_values_is_refused_before_anything_changes(tmp_path):
    model, plan, gparams, _ = _small()
    gbd.save_sharded(tmp_path, gparams, plan=plan)
    with pytest.raises(ValueError, match=r"into\['stacks'\].* is on the meta device"):
        gbd.load_sharded(tmp_path, model, into=gb.init(plan, device="meta"))
    with pytest.raises(ValueError, match=r"^gb.dist.load_sharded: device='gpu' is not a device"):
        gbd.load_sharded(tmp_path, model, into=gb.init(plan, seed=1), device="gpu")
    with torch.inference_mode():
        inference = gb.init(plan, seed=1)
    with pytest.raises(ValueError, match=r"is an inference tensor"):
        gbd.load_sharded(tmp_path, model, into=inference)
    truncating = gb.init(plan, seed=1)
    truncating["free"]["1.weight"] = torch.zeros(16, dtype=torch.int64)
    before = [t.clone() for t in gb.trainable_leaves(truncating)]
    with pytest.raises(TypeError, match=r"into\['free'\]\['1\.weight'\] is torch.int64"):
        gbd.load_sharded(tmp_path, model, into=truncating)
    assert all(
        torch.equal(a, b) for a, b in zip(before, gb.trainable_leaves(truncating), strict=True)
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_older_manifests_load_and_unknown_versions_are_refused(tmp_path):
    """A format-2 manifest (SHA-256 only, written before checksums and optimizer state, DCP's
    files beside it) loads, also into DTensors; a save over it replaces it, DCP's old files
    and all, and leaves other files alone; a later format is refused with the versions this
    gbfunc reads."""
    model, plan, gparams, _ = _small()
    gbd.save_sharded(tmp_path, gparams, plan=plan, step=2)
    manifest = json.loads((tmp_path / "gbfunc.json").read_text())
    data = data_of(tmp_path)
    for file in data.iterdir():
        file.rename(tmp_path / file.name)
    data.rmdir()
    old = {k: v for k, v in manifest.items() if k not in ("checksums", "optimizer", "data")}
    (tmp_path / "gbfunc.json").write_text(json.dumps({**old, "format_version": 2}))
    assert _digest(gbd.load_sharded(tmp_path, model).gparams) == _digest(gparams)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:  # one rank whose free parameters are DTensors: the SHA-256 is taken of them whole
        mesh = init_device_mesh("cpu", (1,))
        fresh = gb.init(plan, seed=1)
        fresh["free"] = {
            k: distribute_tensor(v.detach(), mesh, [Shard(0)]) for k, v in fresh["free"].items()
        }
        gbd.load_sharded(tmp_path, model, into=fresh)
        whole = {k: v.full_tensor() for k, v in fresh["free"].items()}
        assert all(torch.equal(whole[k], gparams["free"][k]) for k in whole)
    finally:
        dist.destroy_process_group()
    (tmp_path / "notes.txt").write_text("mine")
    gbd.save_sharded(tmp_path, gb.init(plan, seed=1), plan=plan, step=3)
    assert not [f.name for f in tmp_path.iterdir() if f.name.endswith((".distcp", ".metadata"))]
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert gbd.load_sharded(tmp_path, model).step == 3
    # DCP files of the user's own beside a format-5 checkpoint (or in a folder a first save
    # writes into) are not the checkpoint's: they stay
    for folder in (tmp_path, tmp_path / "new"):
        folder.mkdir(exist_ok=True)
        (folder / ".metadata").write_text("mine")
        (folder / "__0_0.distcp").write_text("mine")
        gbd.save_sharded(folder, gb.init(plan, seed=1), plan=plan, step=3)
        assert (folder / ".metadata").read_text() == (folder / "__0_0.distcp").read_text() == "mine"
    manifest = json.loads((tmp_path / "gbfunc.json").read_text())
    (tmp_path / "gbfunc.json").write_text(json.dumps({**manifest, "format_version": 6}))
    with pytest.raises(gb.CheckpointVersionError, match=r"format version 6; .* \(1, 2, 3, 4, 5\)"):
        gbd.load_sharded(tmp_path, model)


def _files(path: Path) -> dict[str, bytes]:
    return {str(f.relative_to(path)): f.read_bytes() for f in path.rglob("*") if f.is_file()}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_that_fails_leaves_the_previous_checkpoint_as_it_was(tmp_path, monkeypatch):
    """Issue 53, row 2: a `meta` JSON cannot hold is refused before anything is written, and a
    write that fails once every shard is written (here: the disk fills up as DCP finishes)
    leaves no trace; the previous checkpoint loads as it was saved."""
    model, plan, gparams, _ = _small()
    path = tmp_path / "ckpt"
    gbd.save_sharded(path, gparams, plan=plan, step=1)
    before = _files(path)
    other = gb.init(plan, seed=1)
    with pytest.raises(TypeError, match=r"gb\.dist\.save_sharded: meta must be JSON-serialisable"):
        gbd.save_sharded(path, other, plan=plan, step=2, meta={"t": object()})
    assert _files(path) == before

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dcp_files._FileSystemWriter, "finish", full_disk)
    unwritten = r"ckpt: cannot be written \(rank 0: No space left on device\); the checkpoint there"
    with pytest.raises(gb.CheckpointError, match=rf"gb\.dist\.save_sharded: .*{unwritten}") as e:
        gbd.save_sharded(path, other, plan=plan, step=2)
    assert isinstance(e.value.__cause__, dcp.CheckpointException)
    assert _files(path) == before
    loaded = gbd.load_sharded(path, model)
    assert (loaded.step, _digest(loaded.gparams)) == (1, _digest(gparams))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_overlapping_saves_and_a_load_keep_the_checkpoint_loadable(tmp_path, monkeypatch):
    """Two saves into one directory (two jobs), and a load while a save runs: a save removed
    every other data folder, one still being written, just published or being read, so both
    saves returned and nothing on disk loaded, or a healthy checkpoint read as damaged."""
    model, plan, gparams, _ = _small()
    path = tmp_path / "ckpt"
    gbd.save_sharded(path, gparams, plan=plan, step=1)
    replace_manifest = _layout.write_atomic

    def with_a_whole_save_first(target, write):  # just before the first save's switch
        monkeypatch.setattr(_layout, "write_atomic", replace_manifest)
        gbd.save_sharded(path, gparams, plan=plan, step=3)
        return replace_manifest(target, write)

    monkeypatch.setattr(_layout, "write_atomic", with_a_whole_save_first)
    gbd.save_sharded(path, gparams, plan=plan, step=2)
    assert gbd.load_sharded(path, model).step == 2  # the last switch wins, whole
    assert list(path.glob("shards-*")) == [data_of(path)]
    with _layout.sharing(path):  # a load, between reading the manifest and the data
        read = data_of(path)
        gbd.save_sharded(path, gparams, plan=plan, step=4)
        assert read.is_dir()
        assert data_of(path) != read
    gbd.save_sharded(path, gparams, plan=plan, step=5)  # what the others left is removed
    assert list(path.glob("shards-*")) == [data_of(path)]
    assert gbd.load_sharded(path, model).step == 5


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_where_the_file_system_takes_no_lock_a_save_still_cleans_up(tmp_path, monkeypatch):
    """A descriptor whose lock failed was kept, so no save could ever take it exclusively
    and remove what it replaced."""

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(_layout.fcntl, "flock", no_locks)
    model, plan, gparams, _ = _small()
    path = tmp_path / "ckpt"
    for step in (1, 2):
        gbd.save_sharded(path, gparams, plan=plan, step=step)
    assert list(path.glob("shards-*")) == [data_of(path)]
    assert gbd.load_sharded(path, model).step == 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_failure_after_the_switch_is_a_warning_and_the_new_checkpoint_loads(
    tmp_path, monkeypatch
):
    """Once the manifest is renamed, the new checkpoint is complete: a failure after that
    (syncing the directory, listing what the new one replaced) is a warning, not an error
    saying that the previous checkpoint is unchanged. What stays is removed by the next save."""
    model, plan, gparams, _ = _small()
    path = tmp_path / "ckpt"
    gbd.save_sharded(path, gparams, plan=plan, step=1)
    first = data_of(path).name
    fsync, scandir = os.fsync, os.scandir

    def fsync_fails_on_the_directory(fd: int) -> None:
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_fails_on_the_directory)
    done = r"gb\.dist\.save_sharded: \S*ckpt: the new checkpoint is complete and loadable, but"
    with pytest.warns(
        RuntimeWarning, match=rf"{done} the directory could not be synced \(Input/output error\)"
    ) as record:
        gbd.save_sharded(path, gb.init(plan, seed=1), plan=plan, step=2)
    assert record[0].filename == __file__
    monkeypatch.setattr(os, "fsync", fsync)
    assert gbd.load_sharded(path, model).step == 2
    assert (path / first).is_dir()  # kept: a crash may yet bring back the manifest naming it

    def scandir_fails_on_the_directory(where=".") -> object:
        if isinstance(where, str | os.PathLike) and Path(where) == path:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return scandir(where)

    monkeypatch.setattr(os, "scandir", scandir_fails_on_the_directory)
    with pytest.warns(
        RuntimeWarning, match=rf"{done} what it replaced could not be removed \(Permission denied"
    ):
        gbd.save_sharded(path, gparams, plan=plan, step=3)
    monkeypatch.setattr(os, "scandir", scandir)
    assert gbd.load_sharded(path, model).step == 3
    assert len(list(path.glob("shards-*"))) == 3
    gbd.save_sharded(path, gparams, plan=plan, step=4)
    assert [f.name for f in path.iterdir() if f.name not in ("gbfunc.json", ".gbfunc.lock")] == [
        data_of(path).name
    ]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_save_sharded_onto_a_file_or_a_nul_path_raises_a_checkpoint_error(tmp_path):
    """Issue 53, row 13: DCP's `CheckpointException` is a `BaseException`; the caller gets a
    `gb.CheckpointError` naming the path, the DCP error chained where there is one."""
    _, plan, gparams, _ = _small()
    file = tmp_path / "file"
    file.write_text("mine")
    with pytest.raises(gb.CheckpointError, match=r"save_sharded: .*file: is a file, not a dir"):
        gbd.save_sharded(file, gparams, plan=plan)
    assert file.read_text() == "mine"
    with pytest.raises(gb.CheckpointError, match=r"save_sharded: path '.*a\\x00b' contains a NUL"):
        gbd.save_sharded(f"{tmp_path}/a\0b", gparams, plan=plan)
    with pytest.raises(gb.CheckpointError, match=r"file/ckpt: cannot be written \(rank 0: ") as e:
        gbd.save_sharded(file / "ckpt", gparams, plan=plan)
    assert isinstance(e.value.__cause__, dcp.CheckpointException)


def _child(function: str, *args: object) -> subprocess.Popen:
    """A Python process running this file's `function(*args)` (paths as strings)."""
    here = Path(__file__).resolve()
    code = f"import runpy; runpy.run_path({str(here)!r})[{function!r}](*{list(map(str, args))!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here.parents[1])])}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)


def _wait_for(file: Path, child: subprocess.Popen, never: str) -> None:
    """Until `file` exists, while `child` runs (its stderr shown if it ended), for 120 s."""
    deadline = time.monotonic() + 120
    while not file.exists():
        assert child.poll() is None, child.stderr.read().decode()
        assert time.monotonic() < deadline, never
        time.sleep(0.05)


def save_until_killed(path: str, signal_file: str) -> None:
    """Save other values over the checkpoint at `path`, and wait for SIGKILL once DCP has
    written every file but before the save returns (run in a child process)."""
    finish = dcp_files._FileSystemWriter.finish

    def finish_then_wait(self, *args, **kwargs) -> None:
        finish(self, *args, **kwargs)
        Path(signal_file).touch()
        time.sleep(120)

    dcp_files._FileSystemWriter.finish = finish_then_wait
    _, plan, _, _ = _small()
    gbd.save_sharded(path, gb.init(plan, seed=1), plan=plan, step=2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    """Issue 53, row 2: a process SIGKILLed while it saves over a checkpoint, once its shards
    are written, leaves the previous checkpoint loadable; the next save removes what the
    killed one left."""
    model, plan, gparams, _ = _small()
    path, signal_file = tmp_path / "ckpt", tmp_path / "written"
    gbd.save_sharded(path, gparams, plan=plan, step=1)
    child = _child("save_until_killed", path, signal_file)
    try:
        _wait_for(signal_file, child, "the child never reached the end of its write")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    loaded = gbd.load_sharded(path, model)
    assert (loaded.step, _digest(loaded.gparams)) == (1, _digest(gparams))
    assert len(list(path.glob("shards-*"))) == 2  # the killed save's files are all there
    gbd.save_sharded(path, gparams, plan=plan, step=3)
    assert [f.name for f in path.iterdir() if f.name not in ("gbfunc.json", ".gbfunc.lock")] == [
        data_of(path).name
    ]
    assert gbd.load_sharded(path, model).step == 3


def load_slowly(path: str, reading: str, go: str, out: str) -> None:
    """Load the checkpoint at `path`, pausing once DCP starts reading its data files until
    the file `go` exists; write the step and digest read to `out` (run in a child process)."""
    read_data = dcp_files.FileSystemReader.read_data

    def wait_then_read(self, *args, **kwargs) -> object:
        Path(reading).touch()
        deadline = time.monotonic() + 120
        while not Path(go).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return read_data(self, *args, **kwargs)

    dcp_files.FileSystemReader.read_data = wait_then_read
    model, _, _, _ = _small()
    loaded = gbd.load_sharded(path, model)
    Path(out).write_text(json.dumps([loaded.step, _digest(loaded.gparams)]))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_saves_by_another_process_keep_the_folder_a_load_is_reading(tmp_path):
    """The directory's lock between two real processes (flock is per open file description,
    so one process's test could not show it): saves while another process reads leave its
    data folder in place, and the first save after it cleans up."""
    model, plan, gparams, _ = _small()
    path = tmp_path / "ckpt"
    gbd.save_sharded(path, gparams, plan=plan, step=1)
    first = data_of(path).name
    reading, go, out = (tmp_path / name for name in ("reading", "go", "out"))
    child = _child("load_slowly", path, reading, go, out)
    try:
        _wait_for(reading, child, "the child never started reading")
        for step in (2, 3):
            gbd.save_sharded(path, gb.init(plan, seed=step), plan=plan, step=step)
        assert (path / first).is_dir()  # the reader's folder stays
        assert gbd.load_sharded(path, model).step == 3
        go.touch()
        assert child.wait(timeout=120) == 0, child.stderr.read().decode()
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    assert json.loads(out.read_text()) == [1, _digest(gparams)]
    gbd.save_sharded(path, gparams, plan=plan, step=4)
    assert [f.name for f in path.iterdir() if f.name not in ("gbfunc.json", ".gbfunc.lock")] == [
        data_of(path).name
    ]


def test_a_sharded_checkpoint_loads_trainable_leaves_without_into(tmp_path):
    model, plan, gparams, _ = _small()
    gbd.save_sharded(tmp_path, gparams, plan=plan, step=2)
    gparams = gbd.load_sharded(tmp_path, model).gparams
    assert gb.trainable_leaves(gparams)
    assert all(t.requires_grad for t in gb.trainable_leaves(gparams))
