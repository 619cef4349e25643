"""The figures of the docs' results section (docs/when-to-use.md) and of README.md's "Why"
are read from the committed results files.

Each sentence of the section that states a measured figure is listed in `FIGURES` with where
the figure comes from: a cell of a results file (found by the cells that identify its line),
a range over a table's column, a difference or ratio of such cells, or the communication
model of `benchmarks/bench_comm.py`. The test reads each value and checks the page's figure
to the precision it is written with, so a rerun that changes a result fails here until the
page says the new number. The section, and the README's "Why", may hold no other digits than
these figures and the settings in `SETUP`, so a new figure cannot go unchecked.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from examples.seeds import Stat, critical, paired_gap

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def flat(text: str) -> str:
    """`text` as one line, without emphasis and link targets."""
    text = re.sub(r"\]\([^)]*\)", "]", text).replace("**", "")
    return " ".join(text.split())


def section() -> str:
    """The results section of docs/when-to-use.md (the page's last)."""
    text = (ROOT / "docs" / "when-to-use.md").read_text()
    return flat(text[text.index("Three numbers;") :])


def index_why() -> str:
    """The docs home page's "Why": the README's figures, in the same words."""
    text = (ROOT / "docs" / "index.md").read_text()
    return flat(text[text.index("**Why.**") : text.index("```python")])


def readme_why() -> str:
    """README.md's "Why": a few of the section's figures, in the same words."""
    text = (ROOT / "README.md").read_text()
    return flat(text[text.index("## Why") : text.index("## Install")])


def cells(source: str, *keys: str) -> list[str]:
    """The cells of the one line of `source` holding every key: `|`-separated in a markdown
    table, else separated by runs of two or more spaces (the fixed-width tables)."""
    lines = (RESULTS / source).read_text().splitlines()
    found = [line for line in lines if all(k in line for k in keys)]
    assert len(found) == 1, f"{source}: {len(found)} lines hold all of {keys}"
    line = found[0].strip()
    if line.startswith("|"):
        return [c.strip() for c in line.strip("|").split("|")]
    return re.split(r"\s{2,}", line)


def number(text: str, last: bool = False) -> float:
    """The first (or last) decimal number in `text`, thousands separators dropped."""
    found = re.findall(r"\d[\d,]*(?:\.\d+)?", text)
    assert found, f"no number in {text!r}"
    return float(found[-1 if last else 0].replace(",", ""))


def cell(source: str, keys: tuple[str, ...], column: int, last: bool = False) -> float:
    return number(cells(source, *keys)[column], last)


def plain_mlp_eager() -> float:
    """The plain MLP's eager step (ms, median) in `bench_step.md`."""
    block = (RESULTS / STEP).read_text().split(MLP, 1)[1].split("\n\n")[0]
    (row,) = [line for line in block.splitlines() if line.startswith("plain model")]
    return number(re.split(r"\s{2,}", row)[2])


def uncompiled_over_plain_eager(keys: tuple[str, ...]) -> float:
    """An MLP genome's eager step with `compile=False` over the plain eager step, both medians
    of `bench_step.md`."""
    return cell(STEP, keys, 7) / plain_mlp_eager()


def column(source: str, heading: str, index: int) -> list[float]:
    """Column `index` of a fixed-width table's genome rows (all but the header and the plain
    model) under the heading that starts with `heading`."""
    text = (RESULTS / source).read_text()
    block = text[text.index(heading) :].split("\n\n")[0].splitlines()
    rows = [re.split(r"\s{2,}", line.strip()) for line in block[2:]]
    return [number(r[index]) for r in rows if len(r) > index and not r[0].startswith("plain")]


STEP, STEP_XEON, MEMORY = "bench_step.md", "bench_step_xeon.md", "bench_memory.md"
MLP, TRANSFORMER = "## MLP", "## main job's character transformer"
ROW_GNETS = ("row g-nets, hidden 8, tile 128",)
TORCHGB = ("default genome (torchGB), tile 128",)
HASHED = ("hashed genome, tile full, 20x",)
HIDDEN8 = ("hidden 8, tile 64  ",)
CNN, MLP_QUALITY = "equal_params_cnn.md", "equal_params.md"
HASHED_CNN, HASHED_LM = "~23x, hashed genome", "~20x, hashed genome"
CHARLM, CHARLM_3_SEEDS = (
    "equal_params_charlm.md",
    "equal_params_charlm_hashed_genome_3_seeds_gbfunc_narrow.md",
)


def gpu(size_and_pass: str) -> float:
    """`gb.apply(backend="triton")` against the compiled torch path, from the GPU run."""
    return cell("bench_generation_gpu.md", (size_and_pass, "triton  "), -1)


def cnn(row: str, arm: str, column: int = 6) -> float:
    return cell(CNN, (f"| {row} | {arm} |",), column)


def cnn_sd(row: str, arm: str) -> float:
    """The standard deviation over seeds of an arm's accuracy (`mean ± s.d.`)."""
    return cell(CNN, (f"| {row} | {arm} |",), 6, last=True)


def charlm(row: str, arm: str, source: str = CHARLM) -> float:
    return cell(source, (f"| {row} | {arm} |",), 6)


def charlm_sd(row: str, arm: str) -> float:
    return cell(CHARLM_3_SEEDS, (f"| {row} | {arm} |",), 6, last=True)


def mlp(arm: str, last: bool = False) -> float:
    """The paper's MLP at ~100x: an arm's mean accuracy (or, `last`, its s.d. over seeds)."""
    return cell(MLP_QUALITY, (f"| ~100x | {arm} |",), 6, last)


def paired(source: str, ours: tuple[str, str], theirs: tuple[str, str]) -> Stat:
    """Arm `ours` minus arm `theirs` of an equal_params results file (each `(ratio, family)` at
    its best rate, as the file's summary says), paired by seed (`examples.seeds`); positive
    where `ours` is better: points of accuracy, or nats of loss below."""
    saved = json.loads((RESULTS / source).read_text())
    metric = saved["summary"][0]["metric"]
    sign = 100.0 if metric == "val_acc" else -1.0

    def by_seed(ratio: str, family: str) -> dict[int, float]:
        (lr,) = [s["lr"] for s in saved["summary"] if (s["ratio"], s["family"]) == (ratio, family)]
        arm = [
            r for r in saved["rows"] if (r["ratio"], r["family"], r["lr"]) == (ratio, family, lr)
        ]
        return {r["seed"]: sign * r[metric] for r in arm}

    a, b = by_seed(*ours), by_seed(*theirs)
    seeds = sorted(a.keys() & b.keys())
    return paired_gap([a[s] for s in seeds], [b[s] for s in seeds])


# The section's gaps between arms at equal parameters: (phrase, results file, gbfunc's arm, the
# other arm); the phrase states the gap, its s.e. and its label.
GAPS = [
    (
        "1.3 ± 0.6 points (s.e.) ahead, within noise",
        "equal_params_cnn.json",
        ("~23x, hashed genome", "gbfunc"),
        ("~23x, hashed genome", "narrow"),
    ),
    (
        "0.042 ± 0.008 nats (s.e.) below it, beyond noise",
        "equal_params_charlm_hashed_genome_3_seeds_gbfunc_narrow.json",
        ("~20x, hashed genome", "gbfunc"),
        ("~20x, hashed genome", "narrow"),
    ),
    (
        "1.9 ± 1.0 points (s.e.) ahead, within noise",
        "equal_params.json",
        ("~100x", "gbfunc"),
        ("~100x", "narrow"),
    ),
]


def gap_figures() -> list["Figure"]:
    """Two `Figure`s per gap of `GAPS`: its mean and its standard error."""
    return [
        Figure(phrase, figure, lambda g=(source, ours, theirs), k=k: getattr(paired(*g), k))
        for phrase, source, ours, theirs in GAPS
        for figure, k in zip(re.findall(r"\d+\.\d+", phrase), ("mean", "se"), strict=True)
    ]


def comm_mib(strategy: str) -> float:
    """Bytes per rank per step of GPT-2 small on 8 ranks, 100x100 tiles, embeddings generated."""
    import torch

    import gbfunc as gb
    from benchmarks.bench_comm import GPT2_SMALL, replicated_traffic, torchgb_traffic
    from examples.gpt import GPT

    with torch.device("meta"):
        plan = gb.plan(GPT(GPT2_SMALL), tile=(100, 100), embeddings=True)
    traffic = {"replicated": replicated_traffic, "torchgb": torchgb_traffic}[strategy]
    return traffic(plan, 8).per_rank / 2**20


MAIN_JOB = "main_job_xeon.md"  # on an Intel Xeon host, like the machines here


def main_job(task: str, arm: str, index: int, results: str = MAIN_JOB) -> float:
    """The main job's seeds run (`results`): number `index` of an arm's line (loss mean, s.e.,
    spread, accuracy mean, s.e., spread), or of gb's gap line to `arm` when `arm` starts with
    `gb - ` (loss gap, s.e., accuracy gap, s.e.; signs dropped)."""
    lines = (RESULTS / results).read_text().splitlines()
    gap = arm.startswith("gb - ")
    prefix = f"[{task}]   gb - {arm[5:]:8s} (" if gap else f"[{task}]   {arm:8s}  loss"
    found = [line for line in lines if line.startswith(prefix)]
    assert len(found) == 1, f"{results}: {len(found)} lines of {task} {arm}"
    return float(re.findall(r"\d+\.\d+", found[0])[index])


@dataclass(frozen=True)
class Figure:
    """`text` (as in the section) states `figure`, which `read` returns from the results."""

    text: str
    figure: str
    read: Callable[[], float]


def trainable(task: str, arm: str) -> int:
    """The arm's trainable parameters, as the main job printed them for `task`."""
    text = (RESULTS / MAIN_JOB).read_text()
    line = re.search(rf"\[{task}\] trainable parameters: .*", text)[0]
    return int(re.search(rf"{arm} ([\d,]+)", line)[1].replace(",", ""))


def main_job_figures(*phrases: tuple[str, str, str, int], results: str = MAIN_JOB) -> list[Figure]:
    """One `Figure` per number of each `(task, arm, phrase, first)`: the phrase's numbers
    are numbers `first`, `first + 1`, ... of the arm's line in the main job's output
    (`results`)."""
    return [
        Figure(phrase, number, lambda t=task, a=arm, i=first + k: main_job(t, a, i, results))
        for task, arm, phrase, first in phrases
        for k, number in enumerate(re.findall(r"\d+\.\d+", phrase))
    ]


FIGURES = [
    # The main job's narrow arms against gbfunc's trainable parameters
    Figure(
        "12% more on the transformer",
        "12",
        lambda: 100 * (trainable("charlm", "narrow") / trainable("charlm", "gb") - 1),
    ),
    Figure(
        "14% fewer on the CNN",
        "14",
        lambda: 100 * (1 - trainable("digits", "narrow") / trainable("digits", "gb")),
    ),
    # The main job's noise rule (examples.seeds): Student's t at 2 and 4 degrees of freedom
    Figure("above 4.30 standard errors at 3 seeds", "4.30", lambda: critical(3)),
    Figure("seeds, 2.78 at 5)", "2.78", lambda: critical(5)),
    # Step time and memory
    Figure("matrix 1.96x as fast as", "1.96", lambda: gpu("67108864 fwd ")),
    Figure("1.66x forward and backward", "1.66", lambda: gpu("67108864 fwd+bwd")),
    Figure("at 0.79x its speed", "0.79", lambda: gpu("1048576 fwd+bwd")),
    Figure("at 11.4x, takes 1.07x", "11.4", lambda: cell(STEP, ROW_GNETS, 1)),
    Figure("at 11.4x, takes 1.07x", "1.07", lambda: cell(STEP, ROW_GNETS, 5)),
    Figure("and 1.13x eagerly, where", "1.13", lambda: cell(STEP, ROW_GNETS, 3)),
    Figure("genome at 27.6x takes", "27.6", lambda: cell(STEP, TORCHGB, 1)),
    Figure("takes 1.26x compiled", "1.26", lambda: cell(STEP, TORCHGB, 5)),
    Figure("and 1.31x eagerly", "1.31", lambda: cell(STEP, TORCHGB, 3)),
    # compile=False over the plain eager step, as medians (the file's own ratio in that column
    # was over the plain compiled step: bench_step's baseline bug, see its notes)
    Figure("(10.0x without compiling", "10.0", lambda: uncompiled_over_plain_eager(TORCHGB)),
    Figure("compiling, 52.89 ms against", "52.89", lambda: cell(STEP, TORCHGB, 7)),
    Figure("ms against 5.30 ms)", "5.30", plain_mlp_eager),
    Figure("1.19x compiled and 1.26x eagerly", "1.19", lambda: cell(STEP_XEON, TORCHGB, 5)),
    Figure("1.19x compiled and 1.26x eagerly", "1.26", lambda: cell(STEP_XEON, TORCHGB, 3)),
    Figure("4.10 ms eagerly, 3.36 ms compiled", "4.10", lambda: cell(STEP_XEON, HIDDEN8, 2)),
    Figure("4.10 ms eagerly, 3.36 ms compiled", "3.36", lambda: cell(STEP_XEON, HIDDEN8, 4)),
    Figure(
        "0.28-0.59x the plain model's on the MLP eagerly",
        "0.28",
        lambda: min(column(MEMORY, MLP, 4)),
    ),
    Figure(
        "0.28-0.59x the plain model's on the MLP eagerly",
        "0.59",
        lambda: max(column(MEMORY, MLP, 4)),
    ),
    Figure(
        "0.96-0.99x on the transformer",
        "0.96",
        lambda: min(column(MEMORY, TRANSFORMER, 4) + column(MEMORY, TRANSFORMER, 7)),
    ),
    Figure(
        "0.96-0.99x on the transformer",
        "0.99",
        lambda: max(column(MEMORY, TRANSFORMER, 4) + column(MEMORY, TRANSFORMER, 7)),
    ),
    # Quality at equal parameters, each arm at its best rate (mean and s.d. over 3 seeds)
    Figure("reached 98.8 ± 0.4% (s.d.) against", "98.8", lambda: cnn(HASHED_CNN, "gbfunc")),
    Figure("reached 98.8 ± 0.4% (s.d.) against", "0.4", lambda: cnn_sd(HASHED_CNN, "gbfunc")),
    Figure(
        "against 97.5 ± 0.7% (s.d.) for a narrower CNN", "97.5", lambda: cnn(HASHED_CNN, "narrow")
    ),
    Figure(
        "against 97.5 ± 0.7% (s.d.) for a narrower CNN", "0.7", lambda: cnn_sd(HASHED_CNN, "narrow")
    ),
    Figure(
        "with 14% fewer parameters",
        "14",
        lambda: 100 * (1 - cnn(HASHED_CNN, "narrow", 3) / cnn(HASHED_CNN, "gbfunc", 3)),
    ),
    Figure("(97.8% with", "97.8", lambda: cnn("~23x", "narrow")),
    Figure(
        "with 16% more",
        "16",
        lambda: 100 * (cnn("~23x", "narrow", 3) / cnn(HASHED_CNN, "gbfunc", 3) - 1),
    ),
    Figure("98.6 ± 0.3% (s.d.) for HashedNets", "98.6", lambda: cnn(HASHED_CNN, "hashed")),
    Figure("98.6 ± 0.3% (s.d.) for HashedNets", "0.3", lambda: cnn_sd(HASHED_CNN, "hashed")),
    Figure("68.8 ± 3.1% (s.d.) for low rank", "68.8", lambda: cnn(HASHED_CNN, "low rank")),
    Figure("68.8 ± 3.1% (s.d.) for low rank", "3.1", lambda: cnn_sd(HASHED_CNN, "low rank")),
    Figure("the dense CNN's 97.7 ± 0.4%", "97.7", lambda: cnn("dense", "dense")),
    Figure("the dense CNN's 97.7 ± 0.4%", "0.4", lambda: cnn_sd("dense", "dense")),
    Figure(
        "within 0.2 points of it at ~135x",
        "0.2",
        lambda: cnn("dense", "dense") - cnn("~135x, hashed genome", "gbfunc"),
    ),
    # The character transformer
    Figure(
        "1.61 ± 0.03 nats (s.d.) against",
        "1.61",
        lambda: charlm(HASHED_LM, "gbfunc", CHARLM_3_SEEDS),
    ),
    Figure("1.61 ± 0.03 nats (s.d.) against", "0.03", lambda: charlm_sd(HASHED_LM, "gbfunc")),
    Figure(
        "against 1.65 ± 0.02 (s.d.) for a narrower",
        "1.65",
        lambda: charlm(HASHED_LM, "narrow", CHARLM_3_SEEDS),
    ),
    Figure(
        "against 1.65 ± 0.02 (s.d.) for a narrower", "0.02", lambda: charlm_sd(HASHED_LM, "narrow")
    ),
    Figure("2.59 for low rank", "2.59", lambda: charlm("~20x", "low rank")),
    Figure("the dense model (1.26 nats)", "1.26", lambda: charlm("dense", "dense")),
    # The paper's MLP
    Figure("reaches 96.6 ± 0.2% (s.d.) against", "96.6", lambda: mlp("gbfunc")),
    Figure("reaches 96.6 ± 0.2% (s.d.) against", "0.2", lambda: mlp("gbfunc", last=True)),
    Figure("against 94.6 ± 1.5% (s.d.) for", "94.6", lambda: mlp("narrow")),
    Figure("against 94.6 ± 1.5% (s.d.) for", "1.5", lambda: mlp("narrow", last=True)),
    # Their gaps, paired by seed (mean and s.e.)
    *gap_figures(),
    # The main job over seeds: each phrase's figures, in order, at these places of its line
    *main_job_figures(
        ("charlm", "gb", "gbfunc 1.7722 ± 0.0050 nats (spread 0.0174)", 0),
        (
            "charlm",
            "narrow",
            "against 1.8374 ± 0.0146 (spread 0.0492) for the narrow transformer",
            0,
        ),
        ("charlm", "gb - narrow", "0.0651 ± 0.0144 nats below it, beyond noise", 0),
        ("charlm", "low rank", "(low rank: loss 2.7308,", 0),
        ("mlp", "gb", "gbfunc 96.02 ± 0.33% (spread 1.11)", 3),
        ("mlp", "narrow", "against 94.54 ± 0.74% (spread 2.22) for the narrow MLP", 3),
        ("mlp", "gb - narrow", "1.48 ± 0.72 points above it, within noise", 2),
        ("digits", "gb", "gbfunc 98.33 ± 0.15% (spread 0.83)", 3),
        ("digits", "narrow", "against 97.94 ± 0.23% (spread 1.11) for the narrow CNN", 3),
        ("digits", "gb - narrow", "0.39 ± 0.31 points above it, within noise", 2),
        ("digits", "low rank", "(low rank: 73.11 ± 2.51%, spread 13.89)", 3),
    ),
    # Communication, computed from the plan
    Figure("receives 46 MiB per rank", "46", lambda: comm_mib("replicated")),
    Figure("receives 1246 MiB", "1246", lambda: comm_mib("torchgb")),
    # Limits
    Figure("takes 1.31x the plain MLP step", "1.31", lambda: cell(STEP, TORCHGB, 3)),
    Figure("10.0x with `compile=False`", "10.0", lambda: uncompiled_over_plain_eager(TORCHGB)),
    Figure("1.13x with row g-nets", "1.13", lambda: cell(STEP, ROW_GNETS, 3)),
    Figure(
        "hashed transformer 1.00x",
        "1.00",
        lambda: cell(STEP, ("main job's plan (hashed genome)",), 3),
    ),
    Figure("1.56x eagerly and 1.37x compiled", "1.56", lambda: cell(STEP, HASHED, 3)),
    Figure("1.56x eagerly and 1.37x compiled", "1.37", lambda: cell(STEP, HASHED, 5)),
]

# Settings, labels and statements of method: digits in the section that are not results.
SETUP = [
    "2 x86-64 CPU cores",
    "torch 2.13.0+cpu",
    "MLP 784-512-512-10",
    "128-weight tile row",
    "at ~23x",
    "no width comes within 10%",
    "at ~20x",
    "(one seed)",
    "MLP shape (64-800-10) at ~100x",
    "GPT-2 small on 8 ranks (100x100 tiles",
    "(800 steps for the transformer, 400 for the CNN)",
    "from 5x up",
    "ran 3 seeds",
    "on an H200 GPU",
    "generated a 67M-weight matrix",
    "at 1M weights",
    "fullgraph there (2026-11-28)",  # a date: gpu_tests_triton_op.log's run
    "trained as eager there (2026-11-29",  # a date: gpu_rerun_1129.log's run
    "a paired t-test at 5%",
    "at 3 seeds",
    "`hidden 8, tile 64`",
    "on the digits CNN (5 seeds)",
    "On the character transformer (3 seeds)",
    "on the paper's MLP (3 seeds)",
    "three models at 20-100x fewer",
    "rate, 3 seeds (±",
    "The main job's 5 seeds",
]


@pytest.mark.parametrize("figure", FIGURES, ids=lambda f: f"{f.figure} in {f.text!r}")
def test_a_readme_figure_is_the_committed_result(figure):
    assert figure.text in section(), f"docs/when-to-use.md no longer says {figure.text!r}"
    assert figure.figure in figure.text
    decimals = len(figure.figure.partition(".")[2])
    value = figure.read()
    assert abs(value - float(figure.figure)) <= 0.5 * 10**-decimals + 1e-9, (
        f"the docs say {figure.figure} in {figure.text!r}; the results say {value:.4g}"
    )


@pytest.mark.parametrize("gap", GAPS, ids=lambda g: g[0])
def test_a_paired_gap_of_the_section_has_the_label_of_the_test(gap):
    phrase, source, ours, theirs = gap
    assert phrase in section(), f"docs/when-to-use.md no longer says {phrase!r}"
    assert phrase.endswith(paired(source, ours, theirs).label)


@pytest.mark.parametrize(
    "read", [section, readme_why, index_why], ids=["docs results", "README why", "docs home why"]
)
def test_the_results_section_states_no_unchecked_figure(read):
    text = read()
    covered = [False] * len(text)
    for phrase in dict.fromkeys([f.text for f in FIGURES] + SETUP):
        spans = [m.span() for m in re.finditer(re.escape(phrase), text)]
        assert spans or read is not section, f"not in the section: {phrase!r}"
        for lo, hi in spans:
            covered[lo:hi] = [True] * (hi - lo)
    digits = re.finditer(r"\d+", text)
    unchecked = [text[m.start() - 20 : m.end() + 5] for m in digits if not covered[m.start()]]
    assert not unchecked, f"figures without a source in FIGURES or SETUP: {unchecked}"


def test_bold_figures_of_the_benchmarks_readme_are_in_the_results_its_section_quotes():
    """benchmarks/README.md's tables are quoted unedited (`tests/test_readme.py`); the figures
    its prose puts in bold must be in the results files its section quotes from."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # quoted blocks hold "## " lines
    checked = 0
    for part in re.split(r"\n(?=## )", prose):
        sources = re.findall(r"<!-- from (\S+) -->", part)
        quoted = "".join((ROOT / "benchmarks" / source).read_text() for source in sources)
        for bold in re.findall(r"\*\*(.+?)\*\*", part, flags=re.S):  # in pairs, in order
            for figure in re.findall(r"\d+(?:\.\d+)?", bold):
                assert figure in quoted, f"**{bold}** is in none of {sources or 'no results'}"
                checked += 1
    assert checked >= 5
