"""Shared by the benchmark scripts: provenance of results files, tables, compiling, memory."""

import argparse
import contextlib
import csv
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    import gbfunc as gb

RESULTS = Path(__file__).resolve().parent / "results"


def provenance() -> dict[str, Any]:
    """The command, the code (commit), the machine (cores, CPU, threads, torch) and the date."""
    return {
        "command": "python " + _invocation(),
        "code": code_version(),
        "machine": f"{len(os.sched_getaffinity(0))} CPU cores ({cpu_model()}, "
        f"{torch.backends.cpu.get_cpu_capability()}), {platform.machine()}, "
        f"{torch.get_num_threads()} torch threads",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def code_version() -> str:
    """The repository's commit, and the tracked files other than the benchmarks' results that
    differ from it (a rerun rewrites its results file), so that a result made from an
    uncommitted tree names what was uncommitted; a copy of the tree without `.git` (a device
    machine's) says so."""
    root = Path(__file__).resolve().parents[1]
    try:
        head, changes = (
            subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
            ).stdout
            for args in (
                ["rev-parse", "--short", "HEAD"],
                ["status", "--porcelain", "-uno", "--", ".", ":(exclude)benchmarks/results"],
            )
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    dirty = changed_paths(changes)
    return f"commit {head.strip()}" + (f" with uncommitted changes to: {dirty}" if dirty else "")


def changed_paths(porcelain: str, limit: int = 8) -> str:
    """The paths named by `git status --porcelain` output, comma-separated: the first `limit`,
    then how many more ("a.py, b.py and 3 more"); a rename names its new path; "" for none.

    Each porcelain line is two status letters, a space and the path, so `porcelain` must not
    have been stripped (an unstaged change's line starts with a space).
    """
    paths = [line[3:].split(" -> ")[-1] for line in porcelain.splitlines() if line.strip()]
    more = len(paths) - limit
    return ", ".join(paths[:limit]) + (f" and {more} more" if more > 0 else "")


def cpu_model() -> str:
    """The CPU's model name (Linux), which with torch's vector ISA decides CPU timings: machines
    "of the same kind" here have been AVX-512 and AVX2 hosts, 2x apart on a matmul."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _invocation() -> str:
    """The arguments after `python`: `-m package.module ...` as typed, or the script's path."""
    if sys.orig_argv[1:2] == ["-m"]:
        return shlex.join(sys.orig_argv[1:])
    return shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]])


def provenance_line(p: dict[str, Any] | None = None) -> str:
    """The provenance `p` (default: this run's) in one line, for plot titles and CSV comments."""
    p = provenance() if p is None else p
    return f"{p['command']} | {p['machine']}, torch {p['torch']} | {p['date']}"


# The docs site shows a figure 688 CSS px wide (96 px per inch): drawn at most 7.2 in wide, its
# point sizes read at their nominal size there; at 200 dpi it stays sharp on 2x screens. 7.15, not
# 7.2: a PNG records whole pixels per metre, and 1440 px at 200 dpi reads back as 7.20001 in.
FIGURE_WIDTH = 7.15
FIGURE_DPI = 200


def stamp(fig: "Figure", line: str, chars: int = 115) -> float:
    """Write the provenance `line` at the foot of `fig` in 7 pt grey, its ` | `-separated
    parts wrapped to lines of at most `chars` characters (115 fit 7 in); returns the fraction
    of the figure's height it takes, to keep the plots clear of it."""
    lines: list[str] = []
    for part in line.split(" | "):
        if lines and len(lines[-1]) + 3 + len(part) <= chars:
            lines[-1] += " | " + part
        else:
            lines.append(part)
    fig.text(0.01, 0.008, "\n".join(lines), fontsize=7, color="0.35", ha="left", va="bottom")
    return (len(lines) * 7 * 1.3 / 72 + 0.08) / fig.get_figheight()


def save_figure(fig: "Figure", path: Path) -> None:
    """`fig` as a PNG at `FIGURE_DPI`, its dpi recorded, in a 256-colour palette (no dithering):
    line plots look the same and the file is about a third of matplotlib's RGBA one."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=FIGURE_DPI, facecolor="white")
    image = Image.open(buf).convert("RGB")
    palette = image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    palette.save(path, optimize=True, dpi=(FIGURE_DPI, FIGURE_DPI))


NOTES = "## Notes"  # the heading (and its suffix, e.g. "(moved from benchmarks/README.md)")


def write_results(path: Path, text: str) -> None:
    """Write a results file, keeping the hand-written notes at its end (from the `NOTES`
    heading on): a rerun replaces what the script printed, not the history kept beside it."""
    notes = ""
    if path.is_file():
        old = path.read_text()
        at = old.find(f"\n{NOTES}")
        notes = old[at:] if at >= 0 else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n" + notes if notes else text)


def header_md(title: str) -> str:
    """A markdown title followed by the provenance lines."""
    p = provenance()
    return (
        f"# {title}\n\n"
        f"- command: `{p['command']}`\n"
        f"- code: {p['code']}\n"
        f"- machine: {p['machine']}; Python {p['python']}, torch {p['torch']}\n"
        f"- date: {p['date']}\n"
        "- written by the script; not edited by hand\n"
    )


def markdown_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table: `columns` are `(title, "l" or "r")`, each row its formatted cells."""
    lines = [
        "| " + " | ".join(title for title, _ in columns) + " |",
        "|" + "|".join("---:" if align == "r" else "---" for _, align in columns) + "|",
        *("| " + " | ".join(cells) + " |" for cells in rows),
    ]
    return "\n".join(lines) + "\n"


def benchmark_parser(doc: str, **switches: str) -> argparse.ArgumentParser:
    """A benchmark's command line, described by `doc`'s first line: `--threads` (default 2)
    and a `--NAME` flag (underscores written as hyphens) with its help per switch."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    for name, text in switches.items():
        parser.add_argument(f"--{name.replace('_', '-')}", action="store_true", help=text)
    return parser


def cpu_benchmark_args(doc: str, out: str, **switches: str) -> argparse.Namespace:
    """The command line of a one-machine CPU benchmark (`benchmark_parser`'s and `--out`,
    default `RESULTS / out`), with torch set to its threads."""
    parser = benchmark_parser(doc, **switches)
    parser.add_argument("--out", type=Path, default=RESULTS / out)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    return args


def compile_static(fn: Callable) -> Callable:
    """`torch.compile(fn, fullgraph=True, dynamic=False)` on a private copy of `fn`'s code.

    A benchmark compiles one `def` for every variant, where a training script compiles one:
    - Dynamo keeps compiled graphs on the code object, so with a shared one each call would
      evaluate the guards of the variants compiled before it; the copy gives each its own.
    - Dynamo remembers the shapes it saw per function (file, line, name), so the second
      variant's shapes would make it recompile with symbolic sizes, and inductor's code for
      symbolic tile shapes ran 3-6x slower. `dynamic=False` keeps every graph static.
    """
    private = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    return torch.compile(private, fullgraph=True, dynamic=False)


def generation_flops(plan: "gb.Plan") -> int:
    """FLOPs of one forward generation of every weight of `plan`: `Stack.tile_flops` per tile."""
    return sum(stack.num_tiles * stack.tile_flops for stack in plan.stacks)


def write_json(path: Path, rows: list[dict[str, Any]], **extra: Any) -> None:
    """`{"provenance": ..., **extra, "rows": rows}` as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"provenance": provenance(), **extra, "rows": rows}
    path.write_text(json.dumps(body, indent=1) + "\n")


def write_csv(path: Path, rows: list[dict[str, Any]], source: dict[str, Any] | None = None) -> None:
    """`rows` as CSV, one column per key, under a `#` comment with the provenance `source`.

    `source` defaults to this run's provenance; a file rewritten from saved JSON passes the
    provenance saved with it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        f.write(f"# {provenance_line(source)}\n")
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes held by torch's CPU allocator while `fn()` runs, above what was held before.

    Read from `torch.profiler`'s memory events (every allocation and free of a tensor
    storage, eager or from compiled code); Python objects and allocator caching are not
    counted. `fn` runs twice under the profiler and the second call is measured: the profiler
    records no size for the free of a block allocated before it started, so a measured call
    must free only blocks allocated inside the profile (a training step frees the previous
    step's gradients).
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        with record_function(_MEASURED):
            fn()
    events = prof.profiler.kineto_results.events()
    measured = next(e for e in events if e.name() == _MEASURED)
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = sum(n for t, n in memory if t < measured.start_ns())
    start = peak = live
    for _, nbytes in (m for m in memory if measured.start_ns() <= m[0] <= measured.end_ns()):
        live += nbytes
        peak = max(peak, live)
    return peak - start


_MEASURED = "benchmarks.measured_call"


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct CPU storages behind `tensors` (views and ties counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class _Tee(io.TextIOBase):
    """A text stream writing to the terminal and to a buffer."""

    def __init__(self, terminal: io.TextIOBase) -> None:
        self.terminal, self.buffer = terminal, io.StringIO()

    def write(self, text: str) -> int:
        self.terminal.write(text)
        return self.buffer.write(text)

    def flush(self) -> None:
        self.terminal.flush()


@contextlib.contextmanager
def recorded(path: Path, title: str) -> Iterator[None]:
    """Print as usual, and write everything printed to `path` under a provenance header.

    The results file is exactly what the run printed, so nothing in it is edited by hand.
    """
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    write_results(
        path, header_md(title) + "\n```\n" + tee.buffer.getvalue().strip("\n") + "\n```\n"
    )
