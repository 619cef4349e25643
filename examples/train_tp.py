"""Tensor-parallel (x data-parallel) training of a small GPT whose weights come from g-nets.

Q/K/V and fc1 are column-parallel, the attention output and fc2 row-parallel
(`torch.distributed.tensor.parallel`); each rank generates only the tiles of its own shards,
so no weight is communicated. The tile (32 x 32) divides every local shard at `--tp 2`.

    TMPDIR=/tmp/torchrun GLOO_SOCKET_IFNAME=lo \\
        torchrun --nproc_per_node=2 -m examples.train_tp --tp 2

With 4 ranks and `--tp 2` it runs 2-way data parallel x 2-way tensor parallel; on GPUs the
same command runs with NCCL.
"""

import argparse
import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, counting_data, loss_fn, tp_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    args = parser.parse_args()

    mesh = gbd.init_mesh(tp=args.tp)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    cfg = GPTConfig(vocab=64, dim=64, layers=2, heads=4, seq=32)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = gb.plan(model, tile=(32, 32))  # the unsharded model's plan: same on every rank
    gbd.check_plan(plan)
    parallelize_module(model, mesh["tp"], tp_plan(model))
    shards = gbd.TensorParallel(plan, model, mesh["tp"])
    if shards.misaligned and dist.get_rank() == 0:
        print(f"tiles cut by shard edges (generated twice): {shards.misaligned}")

    gparams = gb.init(plan, seed=0, device=device)
    sync = gbd.GradSync(gbd.trainable_leaves(gparams), mesh)  # sum over tp, mean over dp
    opt = torch.optim.AdamW(gbd.trainable_leaves(gparams), lr=1e-2)

    loader = gbd.data_loader(counting_data(cfg, 4096), args.global_batch, mesh)
    batches = itertools.chain.from_iterable(_epochs(loader))
    for step, (x, y) in zip(range(args.steps), batches, strict=False):
        logits = functional_call(model, shards.apply(gparams), (x.to(device),))
        loss = loss_fn(logits, y.to(device))
        loss.backward()
        sync.wait()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0 and step % 10 == 0:
            print(
                f"step {step:4d}  loss {loss.item():.4f}  tiles here {shards.selection.num_tiles}",
                flush=True,
            )
    dist.destroy_process_group()


def _epochs(loader):
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        yield loader


if __name__ == "__main__":
    main()
