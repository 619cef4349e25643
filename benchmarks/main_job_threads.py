"""Where the main job's time goes: each arm's training step at 1 and at 2 threads.

Builds a task of `examples/main_job.py` (default: the character transformer, which takes most
of the job's time) for seed 0 and times `--steps` steps of every arm at each thread count,
interleaved (`--rounds` rounds of arm by arm, 1 thread then 2), one warm-up step first, plus
one curve-point evaluation and the final evaluation. The main job runs one process per core
at one thread each when a second thread gains less than a second process
(`benchmarks/results/main_job_time.md`).

    python -m benchmarks.main_job_threads                  # charlm, 8 steps, 2 rounds
    python -m benchmarks.main_job_threads --task digits --threads 1
"""

import argparse
import time

import torch

from examples.main_job import SETUPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=tuple(SETUPS), default="charlm")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    build, config = SETUPS[args.task]
    cfg = config()
    setup = build(cfg, torch.device("cpu"))
    batches = setup.batches()
    xs = [next(batches) for _ in range(args.steps)]
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for arm in setup.arms:
            for threads in args.threads:
                torch.set_num_threads(threads)
                arm.step(*xs[0])
                started = time.perf_counter()
                for x, y in xs:
                    arm.step(x, y)
                per_step = (time.perf_counter() - started) / len(xs)
                times.setdefault((arm.name, threads), []).append(1e3 * per_step)
    torch.set_num_threads(args.threads[0])
    evals = {}
    for arm in setup.arms:
        started = time.perf_counter()
        setup.validate(arm)
        point = time.perf_counter() - started
        started = time.perf_counter()
        setup.final(arm)
        evals[arm.name] = (1e3 * point, 1e3 * (time.perf_counter() - started))
    points = cfg.steps // cfg.eval_every
    for (name, threads), values in times.items():
        rounds = " ".join(f"{v:6.0f}" for v in values)
        print(f"{args.task} {name:8s} {threads} thread(s): {rounds} ms/step")
    for name, (point, final) in evals.items():
        print(
            f"{args.task} {name:8s} evaluation at {args.threads[0]} thread(s): {point:.0f} ms a "
            f"curve point (x{points}), {final:.0f} ms the final one"
        )


if __name__ == "__main__":
    main()
