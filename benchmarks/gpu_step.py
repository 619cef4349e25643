"""One training step on a GPU: gbfunc against the same model trained directly, eager and
compiled, on the MLP and on a GPT-2-small-shaped model, at ~10x and ~100x.

    python -m benchmarks.gpu_step                 # CUDA: results/gpu_step.md
    python -m benchmarks.gpu_step --modes eager   # one mode (gpu_check.sh: eager, then compiled)
    python -m benchmarks.gpu_step --dry-run       # CPU, tiny shapes: checks the script runs

A step is: generate the weights (gbfunc only), forward, loss, backward, AdamW update, timed
with the device synchronised. Compiled steps are one `torch.compile(fullgraph=True)` of the
functional step (`grad_and_value` and `gb.optim.adamw_update`); the GPU path's kernels run
inside them (`gb.explain` names each stack's path in the output). Ratios are against the
plain step of the same run.
"""

import argparse
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import gbfunc as gb
from benchmarks._meta import RESULTS, recorded
from benchmarks.bench_step import dense_steps, gb_steps, median_ms, mlp
from examples.gpt import GPT, GPTConfig, loss_fn


def workloads(dry_run: bool, device: torch.device) -> list[tuple[str, nn.Module, tuple]]:
    """`(name, model, (inputs, targets))`: GPT-2 small's shapes (the target's workload, first
    for a run cut short), then the MLP; tiny on a dry run."""
    gen = torch.Generator().manual_seed(0)
    batch = 8 if dry_run else 128
    image = (torch.randn(batch, 784, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
    cfg = GPTConfig(64, 32, 2, 2, 16) if dry_run else GPTConfig(50304, 768, 12, 12, 1024)
    sequences = 2 if dry_run else 8
    ids = torch.randint(0, cfg.vocab, (sequences, cfg.seq + 1), generator=gen)
    text = (ids[:, :-1], ids[:, 1:])
    return [
        (f"GPT-2 small's shapes ({cfg.layers}x{cfg.dim}, seq {cfg.seq})", GPT(cfg), text),
        ("MLP 784-512-512-10", mlp(), image),
    ]


def plan_at(model: nn.Module, target: float) -> gb.Plan:
    """The model's plan at `target` generated weights per g-net parameter (GPT-2's free
    embeddings alone cap its whole-model ratio near 3x); with shared g-nets where the default
    genome cannot reach it."""
    try:
        return gb.plan(model, compression=target, compression_of="generated")
    except ValueError:
        return gb.plan(model, compression=target, compression_of="generated", share=True)


def loss_of(model: nn.Module) -> Callable:
    return loss_fn if isinstance(model, GPT) else nn.functional.cross_entropy


def that_run(steps: dict[str, Callable]) -> dict[str, Callable]:
    """The steps whose first call (and compile) succeeds; each first call's seconds are printed
    as it ends, each failure with its error and left out, so that one step that cannot compile
    still leaves the others' times."""
    kept = {}
    for name, step in steps.items():
        start = time.perf_counter()
        try:
            step()
            print(f"{name}: first call {time.perf_counter() - start:.1f} s", flush=True)
        except Exception as error:
            traceback.print_exc(limit=-12)  # its end, for the log
            lines = str(error).strip().splitlines()
            message = lines[0][:300] if lines else ""
            print(f"{name}: failed: {type(error).__name__}: {message}")
        else:
            kept[name] = step
    return kept


def wait_for(pids: list[int], poll_s: float = 1.0) -> None:
    """Block until none of `pids` runs (gone or a zombie): gpu_check.sh runs the tests beside
    this benchmark's compiles, and its timed rounds must have the GPU to themselves."""

    def running(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    start = time.perf_counter()
    if any(running(pid) for pid in pids):
        while any(running(pid) for pid in pids):
            time.sleep(poll_s)
        print(f"waited {time.perf_counter() - start:.0f} s for processes {pids}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, one round")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_step.md")
    parser.add_argument("--only", default="", help="the workloads whose name contains this")
    parser.add_argument("--targets", type=float, nargs="+", help="generated-weight ratios")
    parser.add_argument(
        "--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"],
        help="the steps timed, one mode after the other",
    )  # fmt: skip
    parser.add_argument(
        "--wait-for", type=int, nargs="*", default=[], metavar="PID",
        help="processes whose end each mode's timed rounds wait for (compiles may overlap)",
    )  # fmt: skip
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("needs CUDA; --dry-run checks the script on CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    rounds, inner = (1, 1) if args.dry_run else (10, 5)
    torch.manual_seed(0)
    with recorded(args.out, "One training step on a GPU: gbfunc vs the model trained directly"):
        print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
        print(f"torch {torch.__version__}; rounds: {rounds} x {inner} steps")
        for name, model, batch in workloads(args.dry_run, device):
            if args.only not in name:
                continue
            model = model.to(device)
            batch = tuple(t.to(device) for t in batch)
            loss = loss_of(model)
            plain_eager, plain_compiled = dense_steps(model, batch, loss)
            steps = {"plain eager": plain_eager.run, "plain compiled": plain_compiled.run}
            targets = args.targets or ((2, 4) if args.dry_run else (10, 100))  # tiny: low
            for target in targets:
                plan = plan_at(model, target)
                label = f"gbfunc {gb.report(plan).compression:.0f}x ({target:g}x gen.)"
                eager, compiled = gb_steps(model, plan, batch, loss, device=device)
                steps[f"{label} eager"], steps[f"{label} compiled"] = eager.run, compiled.run
                paths = gb.explain(gb.init(plan, device=device), plan).route.stacks
                print(f"{name}, {label}: stacks on {sorted(set(paths))}")
            sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
            for mode in args.modes:  # each mode's table printed as soon as it is timed
                ready = that_run({k: v for k, v in steps.items() if k.endswith(mode)})
                wait_for(args.wait_for)
                ms, _ = median_ms(ready, rounds, inner, sync)
                print(f"\n## {name}, {mode}\n{'step':34s} {'ms':>8s}  x plain", flush=True)
                for step, value in ms.items():
                    base = ms.get(f"plain {mode}")
                    ratio = f"{value / base:6.2f}" if base else "     -"
                    print(f"{step:34s} {value:8.2f}  {ratio}")


if __name__ == "__main__":
    main()
