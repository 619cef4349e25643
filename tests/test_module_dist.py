"""gb.Bottleneck under DDP and FSDP2 on 2 real gloo ranks: each equals one process trained on
the concatenated batch."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gbfunc as gb
from gbfunc.dist.testing import spawn

LOCAL_BATCH, STEPS = 4, 3


def _bottleneck() -> gb.Bottleneck:
    torch.manual_seed(0)  # the same p-net, hence the same Bottleneck, on every rank
    model = nn.Sequential(nn.Linear(12, 24), nn.LayerNorm(24), nn.Tanh(), nn.Linear(24, 3))
    return gb.Bottleneck(model, tile=(8, 8), seed=0)


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(rows, 12, generator=gen), torch.randn(rows, 3, generator=gen)


def _train(module: nn.Module, shard) -> None:
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = shard(_batch(step, LOCAL_BATCH * dist.get_world_size()))
        nn.functional.mse_loss(module(x), y).backward()
        opt.step()
        opt.zero_grad()


def _rows(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    rank = dist.get_rank()
    return tuple(t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for t in batch)


def _reference() -> dict[str, torch.Tensor]:
    """One process, the whole (concatenated) batch."""
    ref = _bottleneck()
    _train(ref, lambda batch: batch)
    return {k: v.detach() for k, v in ref.state_dict().items()}


def _diff(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert ours.keys() == ref.keys()
    return max((ours[k] - ref[k]).abs().max().item() for k in ref)


def ddp_worker(rank: int, world: int) -> dict:
    module = _bottleneck()
    ddp = nn.parallel.DistributedDataParallel(module)
    _train(ddp, _rows)
    ours = {k: v.detach() for k, v in module.state_dict().items()}
    return {"diff": _diff(ours, _reference()), "state": ours}


def fsdp_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    module = _bottleneck()
    fully_shard(module, mesh=init_device_mesh("cpu", (world,)))
    sharded = [p for p in module.parameters() if isinstance(p, DTensor)]
    _train(module, _rows)
    ours = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
        for k, v in module.state_dict().items()
    }
    return {"diff": _diff(ours, _reference()), "sharded": len(sharded)}


@pytest.mark.slow
def test_ddp_equals_one_process_on_the_concatenated_batch():
    results = spawn(ddp_worker, 2)
    for r in results:
        assert r["diff"] < 2e-5, r["diff"]
    first, second = (r["state"] for r in results)
    assert all(torch.equal(first[k], second[k]) for k in first)  # replicas stay identical


@pytest.mark.slow
def test_fsdp2_equals_one_process_on_the_concatenated_batch():
    results = spawn(fsdp_worker, 2)
    for r in results:
        assert r["sharded"] == len(list(_bottleneck().parameters()))  # every leaf sharded
        assert r["diff"] < 2e-5, r["diff"]
