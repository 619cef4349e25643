"""Data-parallel training of a small GPT whose weights come from g-nets.

Every rank sees its shard of each global batch. With `--strategy replicated` (default) each
rank generates every weight and only g-net gradients are all-reduced; with `--strategy
owned` each rank generates its own g-nets' tiles and all-gathers them.

    TMPDIR=/tmp/torchrun GLOO_SOCKET_IFNAME=lo \\
        torchrun --nproc_per_node=2 -m examples.train_ddp [--strategy owned] [--steps 60]

On GPUs the same command runs with NCCL, one GPU per rank.
"""

import argparse
import itertools

import torch
import torch.distributed as dist
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, counting_data, loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("replicated", "owned"), default="replicated")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    args = parser.parse_args()

    mesh = gbd.init_mesh()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    cfg = GPTConfig(vocab=64, dim=64, layers=2, heads=4, seq=32)
    with torch.device("meta"):
        model = GPT(cfg)  # shapes only: every weight is passed in by functional_call
    plan = gb.plan(model, tile=(32, 32))
    gbd.check_plan(plan)
    gparams = gb.init(plan, seed=0, device=device)  # bitwise identical on every rank

    if args.strategy == "replicated":
        generate = lambda g: gb.apply(g, plan)
        sync = gbd.GradSync(gbd.trainable_leaves(gparams), mesh)
        sent = lambda: sync.comm_bytes
    else:
        owned = gbd.RankOwned(plan)
        gparams = owned.shard(gparams)  # this rank's g-nets only
        generate = owned.apply
        sync = gbd.GradSync(list(gparams["free"].values()), mesh)
        sent = lambda: sync.comm_bytes + owned.comm_bytes
    opt = torch.optim.AdamW(gbd.trainable_leaves(gparams), lr=1e-2)

    loader = gbd.data_loader(counting_data(cfg, 4096), args.global_batch, mesh)
    batches = itertools.chain.from_iterable(_epochs(loader))
    for step, (x, y) in zip(range(args.steps), batches, strict=False):
        loss = loss_fn(functional_call(model, generate(gparams), (x.to(device),)), y.to(device))
        loss.backward()
        sync.wait()  # g-net gradients summed over ranks, divided by the dp size
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0 and step % 10 == 0:
            print(
                f"step {step:4d}  loss {loss.item():.4f}  communicated {sent() / 2**10:.1f} KiB",
                flush=True,
            )
    dist.destroy_process_group()


def _epochs(loader):
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        yield loader


if __name__ == "__main__":
    main()
