"""Microbenchmark of weight generation per stack size: how close each path gets to the roofline.

One stack of default g-nets (tile 64 x 64, 32 hidden ReLU units) generates an `nn.Linear`
weight. On the CPU it times the torch path eagerly and `torch.compile`d, forward and
forward+backward, beside a naive baseline (vmapped per-tile MLPs with batched matmuls that
materialise `(T, TH*TW, H)`). Each row prints weights/s, bytes saved for backward per weight
(`torch.autograd.graph.saved_tensors_hooks`) and the fraction of this machine's roofline,

    roofline time = max(flops / sgemm FLOP/s, bytes written / write bandwidth),

with both peaks measured by this script in the same run. With CUDA it also times the Triton
kernels and the torch path, eager and compiled (`triton.testing.do_bench`), in TFLOP/s and
GB/s against peaks measured the same way on the GPU.

    python -m benchmarks.bench_generation                 # CPU, one thread: ~1 minute
    python -m benchmarks.bench_generation --threads 2 --sizes 512 2048 --hidden 64 --depth 2
    python -m benchmarks.bench_generation --skip-cpu      # the GPU half alone (gpu_check.sh)

Writes what it prints to `benchmarks/results/bench_generation.md` (`--out`) under the command,
machine and date.
"""

import argparse
import importlib.util
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the Triton kernels need the interpreter, before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch import Tensor, nn
from torch.func import vmap

import gbfunc as gb
from benchmarks._meta import RESULTS, compile_static, recorded
from gbfunc._genome import stack_codes
from gbfunc._spec import Terms, activate, stack_terms
from gbfunc._tiling import assemble


def best_times(fns: dict[str, Callable[[], object]], budget: float) -> dict[str, float]:
    """Best wall time of each function, timed in rounds (one run of each per round).

    Two warm-up runs each (compilation), then rounds for about `budget` seconds per function.
    The best run, not the median, and round-robin: on a shared machine the other runs time
    the neighbours, and a burst of their load hits every path alike.
    """
    for fn in fns.values():
        fn()
        fn()
    best = dict.fromkeys(fns, float("inf"))
    start, rounds = time.perf_counter(), 0
    while rounds < 3 or (time.perf_counter() - start < budget * len(fns) and rounds < 30):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
        rounds += 1
    return best


def cpu_peaks() -> tuple[float, float]:
    """Measured sgemm FLOP/s (1024^3 fp32 matmul) and write bandwidth (fill of 256 MiB), B/s."""
    x, y = torch.randn(1024, 1024), torch.randn(1024, 1024)
    buffer = torch.empty(64 * 2**20)
    t = best_times({"mm": lambda: torch.mm(x, y), "fill": lambda: buffer.fill_(1.0)}, budget=1.0)
    return 2 * 1024**3 / t["mm"], buffer.nbytes / t["fill"]


def naive(plan: gb.Plan, gparams: dict) -> Tensor:
    """Baseline: one plain MLP per tile over the full code matrix, vmapped (batched matmuls)."""
    (stack,), (param,) = plan.stacks, plan.generated
    leaves = gparams["stacks"][stack.key]
    row, col = stack_codes(
        stack.tile, stack.window, stack.genome, stack.columns, torch.float32, None
    )
    codes = torch.cat(
        [row[:, None].expand(-1, col.shape[0], -1), col[None].expand(row.shape[0], -1, -1)], -1
    ).flatten(0, 1)  # (TH * Q, R + C)
    act = stack.genome.activation

    def tile(w_in, b_in, w_hidden, b_hidden, w_out, b_out):
        h = activate(codes @ w_in + b_in, act)  # (TH * Q, H): materialised for every tile
        for layer in range(0 if w_hidden is None else w_hidden.shape[0]):
            h = activate(h @ w_hidden[layer] + b_hidden[layer], act)
        return h @ w_out + b_out

    args = [leaves.get(n) for n in ("w_in", "b_in", "w_hidden", "b_hidden", "w_out", "b_out")]
    in_dims = tuple(None if x is None else 0 for x in args)
    tiles = vmap(tile, in_dims=in_dims)(*args)  # (T, TH * Q, P)
    return assemble(param, stack, tiles.reshape(stack.num_tiles, stack.tile[0], -1))


def gradients(weight: Tensor, leaves: list[Tensor], seed: Tensor) -> tuple[Tensor, ...]:
    """The leaves' gradients given the weight's, `seed` (made once: a p-net's backward hands
    it over in a step; filling a new one took 0.7 ms of the 1M-weight row's 4.8)."""
    return torch.autograd.grad(weight, leaves, seed)


def run_cpu(args: argparse.Namespace) -> None:
    has_triton = importlib.util.find_spec("triton") is not None
    triton_saved = saved_by_triton(args) if has_triton else None
    flops_peak, write_peak = cpu_peaks()
    print(
        f"CPU ({torch.get_num_threads()} threads): sgemm {flops_peak / 1e9:.1f} GFLOP/s, ", end=""
    )
    print(f"write bandwidth {write_peak / 1e9:.1f} GB/s (measured now)")
    print(f"ms: the median over {args.repeats} repeats of the best run; spread: their range")
    header = f"{'weights':>9} {'pass':<8} {'path':<13} {'ms':>9} {'spread':>13} {'Mweights/s':>11}"
    print(header + f" {'saved B/w':>10} {'roofline':>9} {'vs naive':>9}")
    for size in args.sizes:
        plan, gparams = setup(size, args, "cpu")
        leaves = list(gparams["stacks"][plan.stacks[0].key].values())
        numel = plan.generated[0].numel
        flops = plan.stacks[0].num_tiles * plan.stacks[0].tile_flops
        tiles = plan.stacks[0].num_tiles
        print(f"-- Linear({size}, {size}): {tiles} tiles, {flops / numel:.0f} FLOPs/weight forward")
        paths = cpu_paths(plan, gparams)
        seed = torch.ones(plan.generated[0].shape)
        for label, work, written in (
            ("fwd", 1, numel * 4),
            ("fwd+bwd", 3, numel * 4 + sum(x.nbytes for x in leaves)),
        ):
            fns = {k: timed(fn, label, leaves, seed) for k, fn in paths.items()}
            repeats = [separately(fns, args.budget) for _ in range(args.repeats)]
            times = {k: statistics.median(r[k] for r in repeats) for k in fns}
            for name, fn in paths.items():
                t = times[name]
                lo, hi = (f(r[name] for r in repeats) * 1e3 for f in (min, max))
                roofline = max(work * flops / flops_peak, written / write_peak) / t
                saved = gb.memory.saved_bytes(fn) / numel
                print(
                    f"{numel:>9} {label:<8} {name:<13} {t * 1e3:>9.2f} {f'{lo:.2f}-{hi:.2f}':>13} "
                    f"{numel / t / 1e6:>11.1f} {saved:>10.1f} {roofline:>8.1%} "
                    f"{times['naive vmap'] / t:>8.2f}x"
                )
    if triton_saved is not None:
        print(f"Triton path (interpreted here, untimed): saves {triton_saved:.1f} B/weight", end="")
        print(" for backward")


def saved_by_triton(args: argparse.Namespace) -> float:
    """Bytes per weight the Triton path saves for backward (interpreted on CPU: not timed)."""
    plan, gparams = setup(128, args, "cpu")
    saved = gb.memory.saved_bytes(lambda: gb.apply(gparams, plan, backend="triton")["weight"])
    return saved / 128**2


def separately(fns: dict[str, Callable[[], object]], budget: float) -> dict[str, float]:
    """`best_times` of gbfunc's paths, interleaved, then of the naive baseline on its own: its
    128 bytes per weight flush the caches, and interleaved, whichever path ran after it paid
    (forward at 1M weights, one thread: 1.60 ms after it, 1.2 alone)."""
    baseline = {k: fn for k, fn in fns.items() if k == "naive vmap"}
    ours = {k: fn for k, fn in fns.items() if k not in baseline}
    return best_times(ours, budget) | best_times(baseline, budget)


def timed(
    fn: Callable[[], Tensor], label: str, leaves: list[Tensor], seed: Tensor
) -> Callable[[], object]:
    """The forward alone, or the forward and the gradients of every g-net leaf."""
    return fn if label == "fwd" else lambda: gradients(fn(), leaves, seed)


def cpu_paths(plan: gb.Plan, gparams: dict) -> dict[str, Callable[[], Tensor]]:
    """The generated weight by the torch path (eager, compiled) and by the naive baseline."""
    compiled = compile_static(lambda g: gb.apply(g, plan, backend="torch")["weight"])
    return {
        "torch eager": lambda: gb.apply(gparams, plan, backend="torch")["weight"],
        "torch compile": lambda: compiled(gparams),
        "naive vmap": lambda: naive(plan, gparams),
    }


def setup(size: int, args: argparse.Namespace, device: str) -> tuple[gb.Plan, dict]:
    model = nn.Linear(size, size, device="meta")
    plan = gb.plan(model, tile=(args.tile, args.tile), hidden=args.hidden, depth=args.depth)
    return plan, gb.init(plan, seed=0, device=device)


def run_gpu(args: argparse.Namespace) -> None:
    import triton.testing  # only with CUDA

    from gbfunc.kernels.generate import kernel

    def ms(fn: Callable[[], object]) -> float:
        return triton.testing.do_bench(fn)

    x, y = torch.randn(8192, 8192, device="cuda"), torch.randn(8192, 8192, device="cuda")
    flops_peak = 2 * 8192**3 / ms(lambda: torch.mm(x, y)) * 1e3
    buffer = torch.empty(256 * 2**20, device="cuda")
    write_peak = buffer.nbytes / ms(lambda: buffer.fill_(1.0)) * 1e3
    name = torch.cuda.get_device_name()
    print(
        f"\n{name}: fp32 sgemm {flops_peak / 1e12:.1f} TFLOP/s, write {write_peak / 1e9:.0f} GB/s"
    )
    print("ms: triton.testing.do_bench's mean; weights by one stack, fp32")
    header = f"{'weights':>10} {'pass':<8} {'path':<14} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>7}"
    print(f"{header} {'roofline':>9} {'vs torch compile':>17}")
    for size in args.gpu_sizes:
        plan, gparams = setup(size, args, "cuda")
        leaves = list(gparams["stacks"][plan.stacks[0].key].values())
        numel, flops = plan.generated[0].numel, plan.stacks[0].num_tiles * plan.stacks[0].tile_flops
        for label, fns in gpu_paths(plan, gparams, kernel.generate).items():
            work, written = (
                (1, numel * 4) if label == "fwd" else (3, numel * 4 + sum(x.nbytes for x in leaves))
            )
            times = {path: ms(fn) * 1e-3 for path, fn in fns.items()}
            for path, t in times.items():
                roofline = max(work * flops / flops_peak, written / write_peak) / t
                tflops, gbps = work * flops / t / 1e12, written / t / 1e9
                row = f"{numel:>10} {label:<8} {path:<14} {t * 1e3:>8.3f} {tflops:>8.2f}"
                print(row + f" {gbps:>7.0f} {roofline:>8.1%} {times['torch compile'] / t:>16.2f}x")


def gpu_paths(plan: gb.Plan, gparams: dict, launch: Callable) -> dict[str, dict[str, Callable]]:
    """`gb.apply` per backend (torch eager and compiled), forward and forward+backward; also
    the bare forward launch."""
    stack, params = plan.stacks[0], plan.generated
    leaves = gparams["stacks"][stack.key]
    terms = Terms(
        *(None if t is None else t.detach().contiguous() for t in stack_terms(stack, leaves))
    )

    def weight(backend: str) -> Callable[[dict], Tensor]:
        return lambda g: gb.apply(g, plan, backend=backend)["weight"]

    seed = torch.ones(params[0].shape, device="cuda")

    def fwd_bwd(generate: Callable[[dict], Tensor]) -> Callable[[], tuple[Tensor, ...]]:
        return lambda: gradients(generate(gparams), list(leaves.values()), seed)

    fused, eager = weight("triton"), weight("torch")
    compiled = compile_static(eager)
    return {
        "fwd": {
            "triton kernel": lambda: launch(terms, stack, params),
            "triton": lambda: fused(gparams),
            "torch": lambda: eager(gparams),
            "torch compile": lambda: compiled(gparams),
        },
        "fwd+bwd": {
            "triton": fwd_bwd(fused),
            "torch": fwd_bwd(eager),
            "torch compile": fwd_bwd(compiled),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[256, 1024], help="CPU: Linear(n, n)"
    )
    parser.add_argument("--gpu-sizes", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--skip-cpu", action="store_true", help="time the GPU half alone")
    parser.add_argument("--tile", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--budget", type=float, default=1.5, help="seconds of timing per CPU row")
    parser.add_argument(
        "--repeats", type=int, default=3, help="CPU: times each row this many times, for the spread"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads; on a shared machine, parallel regions wait for descheduled threads",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_generation.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with recorded(args.out, "Weight generation per stack size vs the roofline"):
        if not args.skip_cpu:
            run_cpu(args)
        if torch.cuda.is_available():
            run_gpu(args)
        else:
            print("\nNo CUDA device: Triton kernels not timed (they run only interpreted here).")


if __name__ == "__main__":
    main()
