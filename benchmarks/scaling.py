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
    python -m benchmarks.scaling --replot benchmarks/results/scaling.json   # the plot only
"""

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import gbfunc as gb
from benchmarks._meta import (
    FIGURE_WIDTH,
    RESULTS,
    header_md,
    held_bytes,
    markdown_table,
    peak_bytes,
    provenance_line,
    save_figure,
    stamp,
    write_json,
    write_results,
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


def plot(rows: list[dict[str, Any]], path: Path, stamp_line: str) -> None:
    """Step time, its ratio to dense and peak memory vs model parameters, one line per
    (variant, mode): a colour per variant, solid compiled, dotted eager; the legend in the
    fourth cell of the 2 x 2 grid and `stamp_line` at the foot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, grid = plt.subplots(2, 2, figsize=(FIGURE_WIDTH, 6.4), layout="constrained")
    time_ax, memory_ax, ratio_ax, legend_ax = grid.flat
    colours = dict(zip(VARIANTS, ("tab:blue", "tab:orange", "tab:green"), strict=True))
    series = dict.fromkeys((r["variant"], r["mode"]) for r in rows)
    for variant, mode in series:
        group = [r for r in rows if r["variant"] == variant and r["mode"] == mode]
        x = [r["model_params"] for r in group]
        style = {
            "ls": "-" if mode == "compiled" else ":",
            "marker": "o" if mode == "compiled" else "s",
            "mfc": None if mode == "compiled" else "white",
            "color": colours.get(variant),
            "label": f"{variant}, {mode}",
        }
        time_ax.plot(x, [r["step_ms"] for r in group], **style)
        ratio_ax.plot(x, [r["x_dense_time"] for r in group], **style)
        memory_ax.plot(x, [r["peak_mib"] for r in group], **style)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax, title, ylabel in (
        (time_ax, "step time", "ms (log scale)"),
        (memory_ax, "peak memory per step", "MiB above the state (log scale)"),
        (ratio_ax, "step time / dense step time\n(same mode)", "× dense"),
    ):
        ax.set(xscale="log", xlabel="model parameters (log scale)", ylabel=ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.tick_params(labelsize=9)
    for ax in (time_ax, memory_ax):
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(NullFormatter())
    ratio_ax.axhline(1, color="gray", lw=1)
    widths = sorted({(r["model_params"], r["width"]) for r in rows})
    legend_ax.axis("off")
    legend_ax.legend(
        *time_ax.get_legend_handles_labels(),
        loc="upper left",
        fontsize=9,
        frameon=False,
        title="widths "
        + ", ".join(str(w) for _, w in widths)
        + ":\n"
        + ", ".join(f"{p / 1e6:.1f}M" for p, _ in widths)
        + " parameters",
        title_fontsize=9,
        alignment="left",
    )
    foot = stamp(fig, stamp_line)
    fig.get_layout_engine().set(rect=(0, foot, 1, 1 - foot))  # left, bottom, width, height
    save_figure(fig, path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="compiled only, fewer rounds")
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--replot", type=Path, metavar="JSON", help="only redraw the plot of a results file"
    )
    args = parser.parse_args()
    if args.replot:
        saved = json.loads(args.replot.read_text())
        plot(saved["rows"], args.replot.with_suffix(".png"), provenance_line(saved["provenance"]))
        return
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
    write_results(
        stem.with_suffix(".md"),
        header_md("Step time and memory vs p-net size") + setup + table(rows),
    )
    write_json(stem.with_suffix(".json"), rows, rounds=rounds, inner=inner)
    plot(rows, stem.with_suffix(".png"), provenance_line())
    print(f"wrote {stem}.{{md,json,png}}")


if __name__ == "__main__":
    main()
