"""Sharded checkpoints (`gb.dist.save_sharded` / `load_sharded`) on real gloo ranks.

Saved by 2 ranks after a training step; loaded by one process without a process group and by
4 ranks, each reading only its own g-nets; damaged and mismatched checkpoints fail clearly.
"""

import hashlib
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, loss_fn
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
    gbd.save_sharded(path, local, owned, step=1, meta={"run": "a"})
    full = owned.gather(local)
    with torch.no_grad():
        loss = loss_fn(functional_call(model, owned.apply(local), (x,)), x).item()
    return {"digest": _digest(full), "loss": loss}


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
    return {
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
        assert r["loss"] == pytest.approx(written[0]["loss"], abs=1e-6)


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
    state = {}
    reader = dcp.FileSystemReader(path)
    for key, item in reader.read_metadata().state_dict_metadata.items():
        state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    dcp.load(state, checkpoint_id=path, no_dist=True)
    altered = tmp_path / "altered"
    key = next(k for k in state if k.startswith("stacks/"))
    state[key] = state[key] + 1.0
    dcp.save(state, checkpoint_id=str(altered), no_dist=True)
    shutil.copy(f"{path}/gbfunc.json", altered / "gbfunc.json")
    with pytest.raises(gb.CheckpointCorruptError, match=rf"{key} in .*\.distcp does not match"):
        gbd.load_sharded(altered, model)

    # A truncated shard file.
    truncated = tmp_path / "truncated"
    shutil.copytree(path, truncated)
    shard = sorted(truncated.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(gb.CheckpointCorruptError, match="a shard is missing or damaged"):
        gbd.load_sharded(truncated, model)
