"""What `gb.apply` does per call besides generating: time and dispatched ops, on CPU.

A plan of 10 stacks over tiny weights (10 linear layers of 4-44 units, 8x8 tiles, g-nets of
4-13 hidden units), so that the arithmetic is negligible and what is left is the work around
it: code tables, terms, placement tables, checks, autograd and Python. Two paths:

- `torch`: the pure-torch path, eager (`compile=False`);
- `triton, no launch`: the Triton path's wrappers with the kernel launches replaced by no-ops,
  that is everything `gb.apply(backend="triton")` does on a GPU but the kernels themselves.
  Triton runs on CPU only through its interpreter, so without CUDA this script enables it;
- on a GPU (`--device cuda`, in `benchmarks/gpu_check.sh`) also `triton`, kernels launched:
  the whole call, against the target of 50 µs for 10 stacks.

Printed first, the call captured: `gb.apply` (and, for the backward, `torch.func.grad` of a
sum of its weights) inside `torch.compile(fullgraph=True)`, with `mode="reduce-overhead"`
(CUDA graphs) on a GPU, where the default path is Triton's. Eager Python cannot reach 50 µs
for 10 stacks; a captured call replays without it.

Each aten op dispatched is counted (`TorchDispatchMode`); "launching" ops leave out views
(`view`, `slice`, `expand`, ...), which on a GPU launch no kernel. On a GPU each launching op
costs a kernel launch (microseconds), so their count per call is what a device-independent
test can bound (`tests/test_overhead.py`); the CPU times here are the Python and dispatch cost.

    python -m benchmarks.bench_overhead [--device cuda]
"""

import os

import torch

if not torch.cuda.is_available():  # before triton is imported (a script, not gbfunc)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

import gbfunc as gb
from benchmarks._meta import RESULTS, recorded

VIEWS = frozenset(
    [
        "view",
        "_unsafe_view",
        "reshape",
        "slice",
        "select",
        "expand",
        "unsqueeze",
        "squeeze",
        "transpose",
        "t",
        "permute",
        "as_strided",
        "alias",
        "detach",
        "split",
        "split_with_sizes",
        "unbind",
        "_reshape_alias",
    ]
)
DIMS = (24, 20, 28, 16, 32, 12, 36, 8, 40, 4, 44)


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def launching(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in VIEWS)


def ten_stacks(device: str = "cpu") -> tuple[gb.Plan, dict]:
    """The benchmark's plan (one stack per layer: each has its own hidden width) and gparams."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(DIMS[i], DIMS[i + 1]) for i in range(10)))
    overrides = {f"{i}.weight": {"hidden": 4 + i} for i in range(10)}
    plan = gb.plan(model, tile=(8, 8), overrides=overrides)
    return plan, gb.init(plan, seed=0, device=device)


class _NoLaunch:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def no_kernel_launches() -> Iterator[None]:
    """The Triton path without its two kernels: every wrapper runs, nothing is launched.

    The ops hand the kernels to `wrap_triton`, which takes only Triton's own kernel objects:
    here it passes the stand-in through."""
    from gbfunc.kernels.generate import _op as forward_op, kernel as forward
    from gbfunc.kernels.generate_backward import _op as backward_op, kernel as backward

    replaced = [
        (forward, "_generate_kernel", _NoLaunch()),
        (backward, "_generate_backward_kernel", _NoLaunch()),
        (forward_op, "wrap_triton", lambda kernel: kernel),
        (backward_op, "wrap_triton", lambda kernel: kernel),
    ]
    saved = [getattr(module, name) for module, name, _ in replaced]
    for module, name, stand_in in replaced:
        setattr(module, name, stand_in)
    try:
        yield
    finally:
        for (module, name, _), original in zip(replaced, saved, strict=True):
            setattr(module, name, original)


def call(plan: gb.Plan, gparams: dict, backend: str, backward: bool) -> None:
    """One `gb.apply`, and with `backward` the backward of its weights' sum into gradients
    set to None first, as a training loop's `zero_grad()` leaves them (accumulating into
    last call's added an op per leaf to the counts)."""
    weights = gb.apply(gparams, plan, backend=backend, compile=False)
    if backward:
        for leaf in gb.trainable_leaves(gparams):
            leaf.grad = None
        torch.stack([w.sum() for w in weights.values()]).sum().backward()


def captured(plan: gb.Plan, backward: bool, device: str) -> Callable[[dict], object]:
    """`gb.apply` (or `grad` of the sum of its weights) compiled fullgraph, with CUDA graphs
    on a GPU; backend "auto" (Triton's kernels on CUDA, torch on CPU)."""

    def weights(gparams: dict) -> dict:
        return gb.apply(gparams, plan)

    def total(gparams: dict) -> torch.Tensor:
        return torch.stack([w.sum() for w in weights(gparams).values()]).sum()

    mode = "reduce-overhead" if device == "cuda" else None
    return torch.compile(torch.func.grad(total) if backward else weights, fullgraph=True, mode=mode)


def median_us(run: Callable[[], object], rounds: int, inner: int, device: str) -> float:
    """Median µs per call of `run` over `rounds` of `inner` calls, after 5 warm-up calls (caches,
    autograd's and the compiler's first-call work), the device synchronised around each round."""
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    for _ in range(5):
        run()
    times = []
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            run()
        sync()
        times.append((time.perf_counter() - start) / inner * 1e6)
    return statistics.median(times)


def measure(
    backend: str, backward: bool, rounds: int, inner: int, device: str = "cpu"
) -> tuple[float, OpCounter]:
    """Median µs per eager call (`median_us`), and the ops of one call."""
    plan, gparams = ten_stacks(device)
    us = median_us(lambda: call(plan, gparams, backend, backward), rounds, inner, device)
    with OpCounter() as counter:
        call(plan, gparams, backend, backward)
    return us, counter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_overhead.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    plan, gparams = ten_stacks(args.device)
    gparams = tree_map(lambda x: x.detach(), gparams)  # plain tensors, as `grad` takes them
    paths = [("torch", False), ("triton", False)] + [("triton", True)] * (args.device == "cuda")
    with recorded(args.out, "gb.apply's work around the generation, per call"):
        print(f"plan: {len(plan.stacks)} stacks, {gb.report(plan).generated_weights:,} weights\n")
        how = "fullgraph, mode='reduce-overhead'" if args.device == "cuda" else "fullgraph"
        print(f"| captured call (torch.compile, {how}) | µs per call ({args.device}) |")
        print("|---|---|")
        for backward in (False, True):
            run = partial(captured(plan, backward, args.device), gparams)
            us = median_us(run, args.rounds, args.inner, args.device)
            print(f"| {'forward and backward' if backward else 'forward'} | {us:.0f} |")
        print()
        print(
            f"| path | pass | µs per call ({args.device}) | aten ops | launching ops | per stack |"
        )
        print("|---|---|---|---|---|---|")
        for backend, launched in paths:
            for backward in (False, True):
                stubbed = backend == "triton" and not launched
                launches = no_kernel_launches() if stubbed else contextlib.nullcontext()
                with launches:
                    us, counter = measure(backend, backward, args.rounds, args.inner, args.device)
                name = backend + (", no launch" if stubbed else "")
                pass_ = "forward and backward" if backward else "forward"
                ops, launching = sum(counter.ops.values()), counter.launching()
                print(
                    f"| {name} | {pass_} | {us:.0f} | {ops} | {launching} | "
                    f"{launching / len(plan.stacks):.1f} |"
                )
        print(
            "\nlaunching ops: the aten ops other than views; on a GPU each is a kernel launch. "
            "The Triton path's own kernels, 1 (forward) and 1 (backward) per stack, are "
            "counted here as the ops `generate` and `generate_backward`."
        )


if __name__ == "__main__":
    main()
