"""An eager CPU training step in a fresh process: glibc's heap trimming against fixed thresholds.

glibc's malloc adapts two thresholds as a process runs: a block freed that was larger than the
mmap threshold raises it, and the trim threshold follows at twice that. Whenever more than the
trim threshold lies free at the top of the heap, glibc returns it to the kernel, and the next
step faults those pages back in, one minor page fault per 4 KiB. A step that frees several MiB
at once (generated weights, their gradients, a tile MLP's chunks) can pay that every step; a
process whose earlier work freed a larger block (a dataset, a big init) does not. Each genome's
eager step and the plain model's run here in fresh processes, twice: under glibc's defaults
and with both thresholds fixed through `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_`
(set together: either one alone turns the adaptation off and leaves the other at its small
default). Steps alternate in rounds; faults are counted over the timed steps.

    python -m benchmarks.bench_allocator               # bench_step's MLP genomes
    python -m benchmarks.bench_allocator --quick       # outputs 16 only, fewer rounds

Writes what it prints to `benchmarks/results/bench_allocator.md`.
"""

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

import gbfunc as gb
from benchmarks._meta import RESULTS, benchmark_parser, recorded
from benchmarks.bench_step import MLP_GENOMES, Timing, cross_entropy, dense_steps, gb_steps, mlp

FIXED = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}
QUICK_GENOME = "outputs 16, tile 128"


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(genome: str, rounds: int, inner: int) -> dict[str, float]:
    """In this process: the genome's eager step against the plain one, alternating, with the
    minor page faults per step of each."""
    torch.manual_seed(0)
    batch = (torch.randn(128, 784), torch.randint(0, 10, (128,)))
    model = mlp()
    plan = gb.plan(model, **MLP_GENOMES[genome])
    steps = {
        "gbfunc": gb_steps(model, plan, batch, cross_entropy)[0],
        "plain": dense_steps(mlp(), batch, cross_entropy)[0],
    }
    for _ in range(10):  # warm up: first calls compile, and the heap settles
        for step in steps.values():
            step()
    ms: dict[str, list[float]] = {name: [] for name in steps}
    faults = dict.fromkeys(steps, 0)
    for _ in range(rounds):
        for name, step in steps.items():
            before, start = _faults(), time.perf_counter()
            for _ in range(inner):
                step()
            ms[name].append((time.perf_counter() - start) / inner * 1e3)
            faults[name] += _faults() - before
    timing = Timing.of(ms["gbfunc"], ms["plain"])
    per_step = rounds * inner
    return {
        "gbfunc ms": timing.ms,
        "ratio": timing.ratio,
        "gbfunc faults": faults["gbfunc"] / per_step,
        "plain faults": faults["plain"] / per_step,
    }


def in_fresh_process(genome: str, fixed: bool, rounds: int, inner: int, threads: int) -> dict:
    """`measure` in a new interpreter, under glibc's defaults or with `FIXED`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    if fixed:
        env |= FIXED
    child = [sys.executable, "-m", "benchmarks.bench_allocator", "--child", genome]
    child += ["--rounds", str(rounds), "--inner", str(inner), "--threads", str(threads)]
    out = subprocess.run(child, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = benchmark_parser(__doc__, quick=f"{QUICK_GENOME!r} only, fewer rounds")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_allocator.md")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--inner", type=int, default=10, help="steps per round")
    parser.add_argument(
        "--child", metavar="GENOME", help="measure GENOME in this process, print it as JSON"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child is not None:  # one of the fresh processes
        print(json.dumps(measure(args.child, args.rounds, args.inner)))
        return
    genomes = [QUICK_GENOME] if args.quick else list(MLP_GENOMES)
    rounds, inner = (5, 5) if args.quick else (args.rounds, args.inner)
    with recorded(args.out, "An eager CPU step in a fresh process: glibc trimming vs fixed"):
        print(f"MLP 784-512-512-10, batch 128; {rounds} rounds x {inner} steps per process")
        print(f"fixed: {' '.join(f'{k}={v}' for k, v in FIXED.items())}\n")
        print("| genome | default ms | x plain | faults/step | fixed ms | x plain | faults/step |")
        print("|---|---|---|---|---|---|---|")
        for genome in genomes:
            default, fixed = (
                in_fresh_process(genome, f, rounds, inner, args.threads) for f in (False, True)
            )
            cells = [
                f"{r['gbfunc ms']:.2f} | {r['ratio']:.2f} | "
                f"{r['gbfunc faults']:.0f} (plain {r['plain faults']:.0f})"
                for r in (default, fixed)
            ]
            print(f"| {genome} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
