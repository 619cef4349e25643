"""Data-parallel training that survives a lost rank: checkpoints, and a restart resumes.

    TMPDIR=/tmp/torchrun GLOO_SOCKET_IFNAME=lo \\
        torchrun --nproc_per_node=2 --max-restarts=1 -m examples.train_resume --dir runs/resume

Every `--every` steps the g-nets, the AdamW state and the step go to `<dir>/last.safetensors`
(`gb.dist.save_replicated`: rank 0 writes atomically, every rank waits for it). A started or
restarted job resumes from that file if it exists. Each step's global batch is drawn from a
generator seeded by the step, so a resumed run sees the batches an uninterrupted one does and
ends at the same parameters. The final g-nets go to `<dir>/final.safetensors`.

`--die-at K` makes rank 1 kill itself with SIGKILL at step K in the first attempt (torchrun's
`TORCHELASTIC_RESTART_COUNT` is 0), as a lost machine would; torchrun then stops the other
ranks and restarts all of them (`--max-restarts`).
"""

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from torch.func import functional_call

import gbfunc as gb
import gbfunc.dist as gbd
from examples.gpt import GPT, GPTConfig, counting_data, loss_fn

CONFIG = GPTConfig(vocab=64, dim=64, layers=2, heads=4, seq=32)


def batch_of(step: int, global_batch: int, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of step `step`'s global batch (the same on every attempt)."""
    data = counting_data(CONFIG, global_batch, seed=step)
    return gbd.shard_batch(data.tensors, mesh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="checkpoints go here")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--die-at", type=int, help="rank 1 SIGKILLs itself at this step")
    args = parser.parse_args()

    mesh = gbd.init_mesh()
    with torch.device("meta"):
        model = GPT(CONFIG)  # shapes only: every weight is passed in by functional_call
    plan = gb.plan(model, tile=(32, 32))
    gbd.check_plan(plan)
    args.dir.mkdir(parents=True, exist_ok=True)
    last = args.dir / "last.safetensors"
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if last.exists():
        gparams, _, opt_state, start, _ = gb.load(last, model)
    else:
        gparams, opt_state, start = gb.init(plan, seed=0), None, 0
    sync = gbd.GradSync(gb.trainable_leaves(gparams), mesh)
    opt = torch.optim.AdamW(gb.optim.param_groups(gparams, plan, free_lr=1e-2))
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    if dist.get_rank() == 0:
        print(f"starting at step {start}", flush=True)

    for step in range(start, args.steps):
        if args.die_at == step and first_attempt and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch_of(step, args.global_batch, mesh)
        loss_fn(functional_call(model, gb.apply(gparams, plan), (x,)), y).backward()
        sync.wait()  # g-net gradients summed over ranks, divided by the dp size
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every == 0:
            gbd.save_replicated(last, gparams, plan, opt_state=opt.state_dict(), step=step + 1)
    gbd.save_replicated(args.dir / "final.safetensors", gparams, plan, step=args.steps)
    dist.barrier()  # every rank done before any tears down (see launch.train)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
