"""How long `torch.compile` takes to compile one training step: gbfunc against plain.

The step is `bench_step`'s compiled one (generate, forward, loss, `grad`, AdamW, one
`torch.compile(fullgraph=True)`) on a GPT-2-shaped model (vocabulary 50,304, width 768, 12
heads, sequence 64) at `--layers` blocks, gbfunc at 10x generated weights per g-net
parameter (`gpu_step.plan_at`), on CPU. Each measurement is the first call's seconds in a
fresh process with an empty inductor cache (a warm cache hides inductor's share, not
dynamo's), plain then gbfunc, side by side.

    python -m benchmarks.compile_time                  # 2 and 12 layers, about 5 minutes
    python -m benchmarks.compile_time --layers 2       # about 1 minute
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks._meta import RESULTS, recorded

ARMS = ("plain", "gbfunc")


def first_call(arm: str, layers: int) -> float:
    """Seconds of the first call of `arm`'s compiled step at `layers` blocks (in this process)."""
    from benchmarks.bench_step import dense_steps, gb_steps
    from benchmarks.gpu_step import loss_of, plan_at
    from examples.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(50304, 768, layers, 12, 64)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (1, cfg.seq + 1))
    batch = (ids[:, :-1], ids[:, 1:])
    if arm == "plain":
        _, compiled = dense_steps(model, batch, loss_of(model))
    else:
        device = torch.device("cpu")
        _, compiled = gb_steps(model, plan_at(model, 10), batch, loss_of(model), device=device)
    start = time.perf_counter()
    compiled.run()
    return time.perf_counter() - start


def measured(arm: str, layers: int) -> float:
    """`first_call` in a fresh process with empty caches of its own: inductor's, and the one
    gbfunc builds its CPU loops into (a new user builds them on the first call, too)."""
    with tempfile.TemporaryDirectory() as cache:
        loops = os.path.join(cache, "gbfunc")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "GBFUNC_CACHE_DIR": loops}
        call = f"first_call({arm!r}, {layers})"
        code = f"from benchmarks.compile_time import first_call; print({call})"
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
        )
        if out.returncode:
            raise RuntimeError(f"{arm} at {layers} layers failed:\n{out.stderr[-2000:]}")
        return float(out.stdout.strip().splitlines()[-1])


def report(seconds: dict[tuple[str, int], float]) -> None:
    """One row per depth: each arm's seconds and gbfunc's over plain."""
    print("| layers | plain (s) | gbfunc (s) | gbfunc / plain |")
    print("|---:|---:|---:|---:|")
    for layers in sorted({layers for _, layers in seconds}):
        plain, ours = seconds["plain", layers], seconds["gbfunc", layers]
        print(f"| {layers} | {plain:.1f} | {ours:.1f} | {ours / plain:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12])
    parser.add_argument("--out", type=Path, default=RESULTS / "compile_time.md")
    args = parser.parse_args()
    with recorded(args.out, "Compiling one training step: gbfunc against plain"):
        seconds = {}
        for layers in args.layers:
            for arm in ARMS:
                took = seconds[arm, layers] = measured(arm, layers)
                print(f"{arm}, {layers} layers: first call {took:.1f} s", flush=True)
        print()
        report(seconds)


if __name__ == "__main__":
    main()
