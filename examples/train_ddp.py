"""Data-parallel training of a small GPT whose weights come from g-nets.

Every rank sees its shard of each global batch. With `--strategy replicated` (default) each
rank generates every weight and only g-net gradients are all-reduced; with `--strategy
owned` each rank generates its own g-nets' tiles and all-gathers them.

    TMPDIR=/tmp/torchrun GLOO_SOCKET_IFNAME=lo \\
        torchrun --nproc_per_node=2 -m examples.train_ddp [--strategy owned] [--steps 60]

On GPUs the same command runs with NCCL, one GPU per rank.
"""

import torch
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from examples import launch
from examples.gpt import loss_fn


def main() -> None:
    parser = launch.parser(__doc__)
    parser.add_argument("--strategy", choices=("replicated", "owned"), default="replicated")
    args = parser.parse_args()

    mesh = gbd.init_mesh()
    device = launch.local_device()
    cfg, model, plan = launch.small_gpt()  # the model on meta: weights come from gparams
    gparams = gb.init(plan, seed=0, device=device)  # bitwise identical on every rank

    if args.strategy == "replicated":
        generate = lambda g: gb.apply(g, plan)
        sync = gbd.GradSync(gb.trainable_leaves(gparams), mesh)
        sent = lambda: sync.comm_bytes
    else:
        owned = gbd.RankOwned(plan)
        gparams = owned.shard(gparams)  # this rank's g-nets only
        generate = owned.apply
        sync = gbd.GradSync(list(gparams["free"].values()), mesh)
        sent = lambda: sync.comm_bytes + owned.comm_bytes
    opt = torch.optim.AdamW(gb.optim.param_groups(gparams, plan, free_lr=1e-2))

    batches = launch.batches(cfg, args.global_batch, mesh, device)
    # g-net gradients are summed over ranks and divided by the dp size in `sync.wait()`
    launch.train(
        args.steps,
        batches,
        lambda x, y: loss_fn(functional_call(model, generate(gparams), (x,)), y),
        sync,
        opt,
        lambda: f"communicated {sent() / 2**10:.1f} KiB",
    )


if __name__ == "__main__":
    main()
