"""Pipeline-parallel (GPipe) training of a small GPT whose weights come from g-nets.

Each stage holds and generates only its own blocks (`torch.distributed.pipelining`):
weights are generated once per step before the schedule, and the stage's gradients are
pushed into the g-nets after it (two-phase generation, `gb.dist.StageGenerator`).

    TMPDIR=/tmp/torchrun GLOO_SOCKET_IFNAME=lo \\
        torchrun --nproc_per_node=2 -m examples.train_pipeline --pp 2

More ranks than stages add data parallelism; on GPUs the same command runs with NCCL.
"""

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

import gbfunc as gb
import gbfunc.dist as gbd
from examples import launch
from examples.gpt import GPT, loss_fn


def main() -> None:
    parser = launch.parser(__doc__)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()

    mesh = gbd.init_mesh(pp=args.pp)
    device = launch.local_device()
    cfg, _, plan = launch.small_gpt(layers=4)  # the whole model's plan, on every stage
    index = mesh.get_local_rank("pp")
    with torch.device(device):
        module = GPT(cfg, stage=(index, args.pp))  # this stage's blocks only
    generator = gbd.StageGenerator(plan, module)
    stage = PipelineStage(module, index, args.pp, device, group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches, loss_fn=loss_fn)

    gparams = gb.init(plan, seed=0, device=device)
    sync = gbd.GradSync(gb.trainable_leaves(gparams), mesh)  # sum over stages, mean over dp
    opt = torch.optim.AdamW(gb.optim.param_groups(gparams, plan, free_lr=1e-2))

    batches = launch.batches(cfg, args.global_batch, mesh, device)
    last = index == args.pp - 1
    for step, (x, y) in zip(range(args.steps), batches, strict=False):
        generator.load(gparams)  # phase 1: this stage's weights, no graph
        losses: list[torch.Tensor] = []
        inputs = (x,) if index == 0 else ()  # phase 2: all micro-batches
        if last:  # the first stage too, where it is the only one (--pp 1)
            schedule.step(*inputs, target=y, losses=losses)
        else:
            schedule.step(*inputs)
        generator.backward(gparams)  # phase 3: stage gradients into the g-nets
        sync.wait()
        opt.step()
        opt.zero_grad()
        if last and mesh.get_local_rank("dp") == 0 and step % 10 == 0:
            print(f"step {step:4d}  loss {torch.stack(losses).mean().item():.4f}", flush=True)
    dist.barrier()  # every rank done before any tears down (see launch.train)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
