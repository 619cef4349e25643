"""Step time and memory vs p-net size: how weight generation grows next to the model's own cost.

The p-net is the main job's character transformer (`examples/models.py`, 2 blocks, 4 heads)
at widths 128 to 1024 (0.4M to 25M weights), run at a small batch (8 x 64 characters) so the
model's own cost stays low and the generation's share shows. For each width: the model
trained directly, gbfunc at 20x on the generated weights with the torchGB genome, and row
g-nets (128x128 tiles, 8 hidden units, a tile row per evaluation: 13x). One step is
`benchmarks/bench_step.py`'s (generate, forward, loss, backward, AdamW), timed as medians over
interleaved rounds; peak memory is what a step holds between steps (parameters or g-nets,
gradients, AdamW's state) plus the peak of torch's CPU allocator above that during the step
(`torch.profiler` memory events), as in `benchmarks/bench_memory.py`.

Writes `benchmarks/results/scaling[_quick].{md,json,png}`.

    python -m benchmarks.scaling --quick   # compiled steps only, few rounds: a few minutes
    python -m benchmarks.scaling           # eager and compiled, more rounds
"""

import argparse
import os
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import gbfunc as gb
from benchmarks._meta import (
    RESULTS,
    header_md,
    held_bytes,
    markdown_table,
    peak_bytes,
    provenance_line,
    write_json,
)
from benchmarks.bench_step import cross_entropy, dense_steps, gb_steps, median_ms
from examples.models import CharTransformer

VOCAB, CONTEXT, BATCH, DEPTH, HEADS = 96, 64, 8, 2, 4
WIDTHS = (128, 256, 512, 1024)
VARIANTS: dict[str, dict[str, Any] | None] = {
    "dense": None,
    "gbfunc 20x, torchGB genome": {"compression": 20, "compression_of": "generated"},
    "gbfunc 13x, row g-nets": {"tile": (128, 128), "hidden": 8, "outputs": 128},
}


def measure(width: int, modes: tuple[str, ...], rounds: int, inner: int) -> list[dict[str, Any]]:
    """Rows (variant, mode) at one width: parameters, median step ms, peak MiB."""
    torch.manual_seed(0)
    model = CharTransformer(VOCAB, CONTEXT, width, DEPTH, HEADS)
    idx = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1))
    batch = (idx[:, :-1], idx[:, 1:])
    steps, rows = {}, []
    for label, options in VARIANTS.items():
        if options is None:
            pair = dense_steps(model, batch, cross_entropy)
            trainable = sum(p.numel() for p in model.parameters())
        else:
            plan = gb.plan(model, **options)
            rep = gb.report(plan)
            pair = gb_steps(model, plan, batch, cross_entropy)
            trainable = rep.gnet_params + rep.free_params
        for mode, step in zip(("eager", "compiled"), pair, strict=True):
            if mode in modes:
                steps[(label, mode)] = step
                rows.append(
                    {"width": width, "variant": label, "mode": mode, "trainable_params": trainable}
                )
    times, _ = median_ms({f"{k[0]}|{k[1]}": s for k, s in steps.items()}, rounds, inner)
    dense_params = sum(p.numel() for p in model.parameters())
    for row in rows:
        key = (row["variant"], row["mode"])
        row |= {
            "model_params": dense_params,
            "step_ms": times[f"{key[0]}|{key[1]}"],
            "peak_mib": (held_bytes(steps[key].held()) + peak_bytes(steps[key])) / 2**20,
        }
    for row in rows:
        base = next(r for r in rows if r["variant"] == "dense" and r["mode"] == row["mode"])
        row["x_dense_time"] = row["step_ms"] / base["step_ms"]
        row["x_dense_memory"] = row["peak_mib"] / base["peak_mib"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    columns = [
        ("width", "r"),
        ("model params", "r"),
        ("variant", "l"),
        ("trainable params", "r"),
        ("mode", "l"),
        ("step ms", "r"),
        ("x dense", "r"),
        ("peak MiB", "r"),
        ("x dense", "r"),
    ]
    cells = (
        [
            f"{r['width']}",
            f"{r['model_params']:,}",
            r["variant"],
            f"{r['trainable_params']:,}",
            r["mode"],
            f"{r['step_ms']:.1f}",
            f"{r['x_dense_time']:.2f}",
            f"{r['peak_mib']:.1f}",
            f"{r['x_dense_memory']:.2f}",
        ]
        for r in rows
    )
    return markdown_table(columns, cells)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Step time and peak memory vs model parameters, one line per (variant, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    series = dict.fromkeys((r["variant"], r["mode"]) for r in rows)
    for variant, mode in series:
        group = [r for r in rows if r["variant"] == variant and r["mode"] == mode]
        x = [r["model_params"] for r in group]
        style = {
            "ls": "-" if mode == "compiled" else ":",
            "marker": "o",
            "label": f"{variant}, {mode}",
        }
        axes[0].plot(x, [r["step_ms"] for r in group], **style)
        axes[1].plot(x, [r["x_dense_time"] for r in group], **style)
        axes[2].plot(x, [r["peak_mib"] for r in group], **style)
    titles = ("step time", "step time / dense step time (same mode)", "peak memory per step")
    ylabels = ("ms", "x dense", "MiB above the state")
    for ax, title, ylabel in zip(axes, titles, ylabels, strict=True):
        ax.set(
            xscale="log", xlabel="model parameters (widths 128..1024)", ylabel=ylabel, title=title
        )
        ax.grid(alpha=0.3, which="both")
    axes[0].set_yscale("log")
    axes[2].set_yscale("log")
    axes[1].axhline(1, color="gray", lw=1)
    axes[0].legend(fontsize=8)
    fig.suptitle(provenance_line(), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="compiled only, fewer rounds")
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    modes = ("compiled",) if args.quick else ("eager", "compiled")
    rounds, inner = (3, 2) if args.quick else (7, 3)
    rows = []
    for width in tqdm(args.widths, desc="widths"):
        torch._dynamo.reset()
        rows += measure(width, modes, rounds, inner)
    print("\n" + table(rows))
    stem = args.out / ("scaling_quick" if args.quick else "scaling")
    stem.parent.mkdir(parents=True, exist_ok=True)
    setup = (
        f"- p-net: CharTransformer(vocab {VOCAB}, context {CONTEXT}, depth {DEPTH}, heads {HEADS}),"
        f" batch {BATCH}x{CONTEXT}; rounds {rounds} x {inner}\n\n"
    )
    stem.with_suffix(".md").write_text(
        header_md("Step time and memory vs p-net size") + setup + table(rows)
    )
    write_json(stem.with_suffix(".json"), rows, rounds=rounds, inner=inner)
    plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.{{md,json,png}}")


if __name__ == "__main__":
    main()
