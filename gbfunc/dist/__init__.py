"""Distributed training of genomic-bottleneck models on `torch.distributed`.

    mesh = gb.dist.init_mesh(tp=1)              # under torchrun: dp = world size
    gb.dist.check_plan(plan)                    # every rank built the same plan
    gparams = gb.init(plan, seed=0)             # identical on every rank: the model is too
    sync = gb.dist.GradSync(gb.trainable_leaves(gparams), mesh)
    x, y = gb.dist.shard_batch((x, y), mesh)    # this rank's rows of the global batch
    loss_fn(functional_call(model, gb.apply(gparams, plan), (x,)), y).backward()
    sync.wait(); opt.step(); opt.zero_grad()

Strategies: replicated g-nets (the default above), `RankOwned` g-nets, `TensorParallel`
p-nets and `StageGenerator` for pipeline stages (their bytes per step:
`benchmarks/bench_comm.py`).
"""

from .._replicated import save_replicated as save_replicated
from .._select import Selection as Selection
from .._tiling import Concat as Concat
from ._check import check_plan as check_plan, plan_difference as plan_difference
from ._data import data_loader as data_loader, shard_batch as shard_batch
from ._fsdp import ShardedFree as ShardedFree
from ._mesh import MeshShape as MeshShape, init_mesh as init_mesh, mesh_shape as mesh_shape
from ._owned import Ownership as Ownership, RankOwned as RankOwned, assign as assign
from ._pipeline import StageGenerator as StageGenerator
from ._sharded import load_sharded as load_sharded
from ._sharded_save import save_sharded as save_sharded
from ._sync import CollectiveError as CollectiveError, GradSync as GradSync
from ._tp import TensorParallel as TensorParallel

# The public API: each name has an entry in docs/api/dist.md (tests/test_docs.py).
__all__ = [
    "CollectiveError",
    "Concat",
    "GradSync",
    "MeshShape",
    "Ownership",
    "RankOwned",
    "Selection",
    "ShardedFree",
    "StageGenerator",
    "TensorParallel",
    "assign",
    "check_plan",
    "data_loader",
    "init_mesh",
    "load_sharded",
    "mesh_shape",
    "plan_difference",
    "save_replicated",
    "save_sharded",
    "shard_batch",
]
