"""Tensor-parallel (x data-parallel) training of a small GPT whose weights come from g-nets.

Q/K/V and fc1 are column-parallel, the attention output and fc2 row-parallel
(`torch.distributed.tensor.parallel`); each rank generates only the tiles of its own shards,
so no weight is communicated. The tile (32 x 32) divides every local shard at `--tp 2`.

    TMPDIR=/tmp/torchrun GLOO_SOCKET_IFNAME=lo \\
        torchrun --nproc_per_node=2 -m examples.train_tp --tp 2

With 4 ranks and `--tp 2` it runs 2-way data parallel x 2-way tensor parallel; on GPUs the
same command runs with NCCL.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from examples import launch
from examples.gpt import loss_fn, tp_plan


def main() -> None:
    parser = launch.parser(__doc__)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    mesh = gbd.init_mesh(tp=args.tp)
    device = launch.local_device()
    cfg, model, plan = launch.small_gpt()  # the unsharded model's plan: same on every rank
    parallelize_module(model, mesh["tp"], tp_plan(model))
    shards = gbd.TensorParallel(plan, model, mesh["tp"])
    if shards.misaligned and dist.get_rank() == 0:
        print(f"tiles cut by shard edges (generated twice): {shards.misaligned}")

    gparams = gb.init(plan, seed=0, device=device)
    sync = gbd.GradSync(gb.trainable_leaves(gparams), mesh)  # sum over tp, mean over dp
    opt = torch.optim.AdamW(gb.optim.param_groups(gparams, plan, free_lr=1e-2))

    batches = launch.batches(cfg, args.global_batch, mesh, device)
    launch.train(
        args.steps,
        batches,
        lambda x, y: loss_fn(functional_call(model, shards.apply(gparams), (x,)), y),
        sync,
        opt,
        lambda: f"tiles here {shards.selection.num_tiles}",
    )


if __name__ == "__main__":
    main()
