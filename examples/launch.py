"""What the torchrun examples share: their common arguments, their small GPT and its plan, this
rank's device, an endless stream of this rank's batches, and the training loop."""

import argparse
import itertools
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, counting_data


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser described by `doc`'s first line, with `--steps` and `--global-batch`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    return parser


def small_gpt(layers: int = 2) -> tuple[GPTConfig, GPT, gb.Plan]:
    """The examples' GPT of `layers` blocks (64 tokens, width 64, 4 heads, 32 positions): its
    config, the model on the meta device (shapes only: every weight is passed in by
    `functional_call`) and its plan of (32, 32) tiles, checked to be the same on every rank."""
    cfg = GPTConfig(vocab=64, dim=64, layers=layers, heads=4, seq=32)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = gb.plan(model, tile=(32, 32))
    gbd.check_plan(plan)
    return cfg, model, plan


def local_device() -> torch.device:
    """This rank's GPU under torchrun with NCCL, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def batches(
    cfg: GPTConfig, global_batch: int, mesh: DeviceMesh, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of every global batch of the counting task, epoch after epoch."""
    loader = gbd.data_loader(counting_data(cfg, 4096), global_batch, mesh)
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            yield x.to(device), y.to(device)


def train(
    steps: int,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sync: gbd.GradSync,
    opt: torch.optim.Optimizer,
    describe: Callable[[], str],
) -> None:
    """`steps` steps of loss, backward, gradient sync and update; rank 0 prints the loss and
    `describe()` every 10 steps. Ends the process group."""
    for step, (x, y) in zip(range(steps), batches, strict=False):
        loss = loss_of(x, y)
        loss.backward()
        sync.wait()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0 and step % 10 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  {describe()}", flush=True)
    # Every rank done before any tears down: without it, 3 of 34 runs of train_tp aborted at
    # exit ("terminate called without an active exception"), 0 of 80 with it.
    dist.barrier()
    dist.destroy_process_group()
