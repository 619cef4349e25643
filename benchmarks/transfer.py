"""Do the default rates hold where nobody tuned them? (issue 54, item 2)

Chosen before any run (2026-11-28, 04:10 UTC), none used by an earlier run here:

- `email` (text, code): the running Python's source of the `email` package, every `.py` file
  in sorted order (about 380k characters; `lr_rule`'s held-out corpus is five other modules).
- `package-docs` (text, prose): the descriptions in the installed distributions' `METADATA`
  (their READMEs), in the order of their names, cut to the main corpus's length; since
  2026-11-30 without gbfunc's own (its README), which made the corpus change with each edit.
- `digits-rows` (image): the digits MLP 64-800-10 (`equal_params`' task) with a genome no
  sweep here used: ReLU row g-nets, 32x32 tiles, 8 hidden units, 8 weights per evaluation.

For each, over 3 seeds: gbfunc at `gb.optim.param_groups`' default rates times `scale` in
(1/3, 1/2, 1, 2, 3) (the free tensors at the main job's dense rate), and the narrow model of
as many parameters at each of its rates (the transformer: 0.06 and 0.03, the best and the
third of `equal_params`' sweep at ~20x, where 0.1 came second, and 0.1 and 0.2, added where
0.06 was the best of the first two on both corpora; the MLP: `equal_params`' four). The text
tasks are the main job's character transformer and hashed genome at ~20x, 800 steps, batch
32; every arm warms up over a quarter of the steps (`gb.optim.schedule`'s default) on
`equal_params`' protocol.
The report gives each configuration's mean, standard error and seed spread, the default
against each scale paired by seed (a paired t-test at 5%, `examples.seeds`), the best scale
so ranked, and the default against the narrow model at its best rate, paired by seed too;
rows whose recorded corpora differ are not paired (`same_text`).

    python -m benchmarks.transfer --tasks digits-rows email package-docs   # 2 processes
    python -m benchmarks.transfer --tasks package-docs --scales 1 --lrs 0.06  # a part
    python -m benchmarks.transfer --report-only
"""

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import statistics
import sysconfig
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from importlib import metadata
from pathlib import Path

import torch
from torch import Tensor

import gbfunc as gb
from benchmarks import equal_params as ep, lr_rule
from benchmarks._meta import RESULTS, header_md, markdown_table, write_results
from examples.data import CharCorpus, pydoc_text
from examples.seeds import Stat
from examples.tasks import CharLMConfig, MLPConfig

SCALES = (1 / 3, 1 / 2, 1.0, 2.0, 3.0)
SEEDS = (0, 1, 2)
NARROW_LRS = {"text": (0.03, 0.06, 0.1, 0.2), "image": (0.003, 0.01, 0.03, 0.1)}


def email_text() -> str:
    """The `email` package's source, file by file in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"]) / "email"
    return "\n".join(p.read_text() for p in sorted(root.rglob("*.py")))


def package_docs_text() -> str:
    """The installed distributions' descriptions, by name, cut to the main corpus's length:
    each distribution once (the first `sys.path` finds), and not gbfunc's own, whose
    description is this repository's README: with it, every README edit changed the corpus."""
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions():
        found.setdefault(dist.metadata["Name"].lower().replace("_", "-"), dist)
    found.pop("gbfunc", None)
    text = "\n".join(found[name].metadata.get_payload() or "" for name in sorted(found))
    return text[: len(pydoc_text())]


TEXTS = {"email": email_text, "package-docs": package_docs_text}


@functools.cache
def text(name: str) -> str:
    """The text of corpus `name`, read once per process."""
    return TEXTS[name]()


@functools.cache
def corpus(name: str) -> CharCorpus:
    return CharCorpus.from_text(text(name))


def fingerprint(name: str) -> str:
    """The corpus `name` as this machine builds it: its length and the start of its SHA-1.
    Both corpora come from the running Python's installation (`package-docs` from whatever
    distributions are installed), so rows are comparable only where this agrees."""
    raw = text(name)
    return f"{len(raw):,} characters, sha1 {hashlib.sha1(raw.encode()).hexdigest()[:12]}"


def text_task(name: str) -> ep.Task:
    return dataclasses.replace(
        ep.TASKS["charlm"],
        name=f"character transformer, {name} corpus",
        build=lambda width: ep.charlm_model(width, corpus(name)),
        data=lambda: ep.charlm_data(corpus(name)),
    )


TASKS = {  # name: (kind, task, genome, the free tensors' rate)
    "email": ("text", "email", lr_rule.TASKS["charlm"].genomes[3][2], CharLMConfig().lr_dense),
    "package-docs": (
        "text",
        "package-docs",
        lr_rule.TASKS["charlm"].genomes[3][2],
        CharLMConfig().lr_dense,
    ),
    "digits-rows": ("image", "mlp", ep.ROWS_GENOME, MLPConfig().lr_dense),
}


def warmup(task: ep.Task) -> int:
    """Every arm warms up over a quarter of the steps (`gb.optim.schedule`'s default)."""
    return max(1, task.steps // 4)


def train_gbfunc(
    task: ep.Task,
    options: dict,
    seed: int,
    data: tuple,
    free_lr: float,
    factor: Callable[[str | None, Tensor | None], float],
) -> tuple[float, float, int]:
    """gbfunc's arm of `options` trained on `task` with each g-net leaf at its default rate
    times `factor(its leaf name, the leaf)` (`None, None` for a rate outside the stacks: task
    embeddings) and the free tensors at `free_lr`, warmed up as every arm (`warmup`):
    validation loss, accuracy, and the stored parameters."""
    trained, plan = ep.gbfunc_arm(task, "transfer", options, seed, data)
    stacks = trained.tree["stacks"].values()
    leaves = {id(t): (leaf, t) for named in stacks for leaf, t in named.items()}
    default = lr_rule.rates(trained.tree, plan, "default")
    scaled = {key: rate * factor(*leaves.get(key, (None, None))) for key, rate in default.items()}
    trained = lr_rule.at_rates(trained, plan, scaled, free_lr)
    loss, acc = ep.train(trained, 1.0, data, task.steps, task.batch, seed, warmup=warmup(task))
    return loss, acc, gb.report(plan).stored_params


def run(task_name: str, arm: str, value: float, seed: int) -> dict:
    """One run: `arm` "gbfunc" at `scale=value`, or "narrow" at rate `value`."""
    torch.set_num_threads(1)
    kind, base, options, free_lr = TASKS[task_name]
    task = text_task(base) if kind == "text" else ep.TASKS[base]
    data = task.data()
    if arm == "gbfunc":
        loss, acc, params = train_gbfunc(task, options, seed, data, free_lr, lambda *_: value)
    else:
        narrow = ep.arms_at(task, "transfer", options, seed, data)[1]
        params = narrow.params
        loss, acc = ep.train(narrow, value, data, task.steps, task.batch, seed, warmup=warmup(task))
    row = {
        "task": task_name,
        "arm": arm,
        "value": value,
        "seed": seed,
        "params": params,
        "val_loss": loss,
        "val_acc": acc,
    }
    return {**row, "corpus": fingerprint(base)} if kind == "text" else row


def jobs(task_name: str, seeds: Sequence[int] = SEEDS) -> list[tuple[str, str, float, int]]:
    kind = TASKS[task_name][0]
    arms = [("gbfunc", s) for s in SCALES] + [("narrow", lr) for lr in NARROW_LRS[kind]]
    return [(task_name, arm, value, seed) for arm, value in arms for seed in seeds]


def scores(rows: list[dict], task_name: str, arm: str, value: float) -> dict[int, float]:
    """`arm` at `value` (gbfunc's scale, the narrow model's rate) on `task_name`: its score by
    seed (validation loss in nats for text, accuracy in % for images)."""
    metric = "val_loss" if TASKS[task_name][0] == "text" else "val_acc"
    unit = 1.0 if metric == "val_loss" else 100.0
    return {r["seed"]: r[metric] * unit for r in _configuration(rows, task_name, arm, value)}


def corpus_by_seed(
    rows: list[dict], task_name: str, arm: str, value: float
) -> dict[int, str | None]:
    """`arm` at `value` on `task_name`: the corpus each seed's row read (`fingerprint`; None
    where the row predates the record)."""
    return {r["seed"]: r.get("corpus") for r in _configuration(rows, task_name, arm, value)}


def _configuration(rows: list[dict], task_name: str, arm: str, value: float) -> list[dict]:
    """The rows of `arm` at `value` on `task_name`, one per seed run."""
    return [r for r in rows if r["task"] == task_name and r["arm"] == arm and r["value"] == value]


def same_text(a: str | None, b: str | None) -> bool:
    """Whether two rows may be paired: unless both recorded their corpus and the two differ
    (package-docs held the installed gbfunc's README until 2026-11-30, so it changed with its
    edits; the corpus also follows the installed distributions)."""
    return a is None or b is None or a == b


def paired_gap(rows: list[dict], task_name: str, a: float, b: float, b_arm: str = "gbfunc") -> Stat:
    """gbfunc at scale `a` minus `b_arm` at `b` (gbfunc's scale or the narrow model's rate)
    over the seeds both ran (the same batches at a seed, and for two scales the same init, so
    the seed's own luck cancels), with its label (`examples.seeds`)."""
    ours, theirs = scores(rows, task_name, "gbfunc", a), scores(rows, task_name, b_arm, b)
    read_a = corpus_by_seed(rows, task_name, "gbfunc", a)
    read_b = corpus_by_seed(rows, task_name, b_arm, b)
    seeds = sorted(s for s in ours.keys() & theirs.keys() if same_text(read_a[s], read_b[s]))
    if not seeds:
        return Stat(math.nan, math.nan, math.nan, 0)
    return Stat.of([ours[s] - theirs[s] for s in seeds])


def summary(rows: list[dict], task_name: str) -> list[dict]:
    """Per configuration of `task_name`: the score's mean, s.e. and spread over seeds."""
    metric = "val_loss" if TASKS[task_name][0] == "text" else "val_acc"
    scale = 1.0 if metric == "val_loss" else 100.0
    groups: dict[tuple[str, float], list[float]] = {}
    for r in sorted(rows, key=lambda r: r["seed"]):
        if r["task"] == task_name:
            groups.setdefault((r["arm"], r["value"]), []).append(r[metric] * scale)
    out = []
    for (arm, value), scores in sorted(groups.items()):
        sd = statistics.stdev(scores) if len(scores) > 1 else math.nan  # one seed: no s.e.
        out.append(
            {
                "arm": arm,
                "value": value,
                "seeds": len(scores),
                "mean": statistics.mean(scores),
                "se": sd / len(scores) ** 0.5,
                "spread": max(scores) - min(scores),
                "scores": scores,
            }
        )
    return out


def report(rows: list[dict]) -> str:
    text = header_md("Default rates where nobody tuned them: two corpora and an image genome")
    text += "\n" + __doc__.split("\n\n", 1)[1].split("    python -m")[0]
    for task_name in TASKS:
        found = summary(rows, task_name)
        if not found:
            text += f"\n## {task_name}\n\nNot run.\n"
            continue
        lower = TASKS[task_name][0] == "text"
        unit = "nats" if lower else "%"
        cells = [
            [
                r["arm"],
                f"scale {r['value']:.3g}" if r["arm"] == "gbfunc" else f"rate {r['value']:g}",
                ", ".join(f"{s:.4f}" if lower else f"{s:.2f}" for s in r["scores"]),
                f"{r['mean']:.4f}" if lower else f"{r['mean']:.2f}",
                f"{r['se']:.4f}" if lower else f"{r['se']:.2f}",
                f"{r['spread']:.4f}" if lower else f"{r['spread']:.2f}",
            ]
            for r in found
        ]
        columns = [
            ("arm", "l"),
            ("setting", "l"),
            (f"per seed ({unit})", "l"),
            ("mean", "r"),
            ("s.e.", "r"),
            ("spread", "r"),
        ]
        text += f"\n## {task_name}\n\n" + markdown_table(columns, cells)
        if lower:
            text += corpora(rows, task_name)
        text += verdict(found, lower, rows, task_name)
    return text


def corpora(rows: list[dict], task_name: str) -> str:
    """Which corpus the rows of `task_name` trained on (`fingerprint`), as a list line."""
    counts = Counter(r.get("corpus", "not recorded") for r in rows if r["task"] == task_name)
    found = "; ".join(f"{k} ({n} rows)" for k, n in counts.items())
    return f"\n- corpus: {found}\n"


def _mean(row: dict) -> float:
    return row["mean"]


def verdict(found: list[dict], lower: bool, rows: list[dict], task_name: str) -> str:
    """The default against every other scale, paired by seed over the seeds both ran (means
    over different seeds would rank configurations by their seeds' luck), the best scale so
    ranked, and the default against the narrow model's best rate, paired by seed as well."""
    best = min if lower else max
    gb_rows = [r for r in found if r["arm"] == "gbfunc"]
    narrow = [r for r in found if r["arm"] == "narrow"]
    default = next((r for r in gb_rows if r["value"] == 1.0), None)
    if default is None:
        return ""
    lines = [
        f"\n- the default (scale 1): {default['mean']:.4g} +- {default['se']:.2g} (spread "
        f"{default['spread']:.3g}, {default['seeds']} seeds)"
    ]
    gaps: dict[float, Stat] = {}  # default - scale, paired, for every scale with a shared seed
    for scale in (r["value"] for r in gb_rows if r["value"] != 1.0):
        gap = paired_gap(rows, task_name, 1.0, scale)
        if gap.n == 0:
            continue
        gaps[scale] = gap
        se = f" +- {gap.se:.4f}" if gap.n > 1 else ""
        lines.append(
            f"- paired over the {gap.n} seeds both ran: default - scale {scale:.3g} = "
            f"{gap.mean:+.4f}{se} ({gap.label})"
        )
    sign = 1 if lower else -1  # a scale is ahead where default - scale has this sign
    ranked = {v: g for v, g in gaps.items() if g.n > 1 and sign * g.mean > 0}
    if ranked:
        top = max(ranked, key=lambda v: sign * ranked[v].mean)
        gap = ranked[top]
        lines.append(
            f"- the best scale, paired with the default: {top:.3g} (default - best: "
            f"{gap.mean:+.4f} +- {gap.se:.4f} over {gap.n} seeds, {gap.label})"
        )
    else:
        lines.append("- the best scale, paired with the default: the default (no scale ahead)")
    if narrow:
        rival = best(narrow, key=_mean)
        params = {r["arm"]: r["params"] for r in rows if r["task"] == task_name}
        gap = paired_gap(rows, task_name, 1.0, rival["value"], "narrow")
        se = f" +- {gap.se:.4f}" if gap.n > 1 else ""
        lines.append(
            f"- the narrow model at its best rate, {rival['value']:g}: {rival['mean']:.4g} +- "
            f"{rival['se']:.2g} (spread {rival['spread']:.3g}); gbfunc's default - narrow, "
            f"paired over the {gap.n} seeds both ran: {gap.mean:+.4f}{se} ({gap.label}); "
            f"trainable parameters gbfunc {params.get('gbfunc', 0):,}, "
            f"narrow {params.get('narrow', 0):,}"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rows", type=Path, default=RESULTS / "transfer.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "transfer.md")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--scales", nargs="+", type=float, help="only these of SCALES")
    parser.add_argument("--lrs", nargs="+", type=float, help="only these narrow rates")
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=list(SEEDS), help="seeds to run (adds to --rows)"
    )
    args = parser.parse_args()
    rows = json.loads(args.rows.read_text()) if args.rows.exists() else []
    if not args.report_only:
        done = {(r["task"], r["arm"], r["value"], r["seed"]) for r in rows}
        todo = [
            j for t in args.tasks for j in jobs(t, args.seeds) if j not in done and _chosen(j, args)
        ]
        with ProcessPoolExecutor(args.processes) as pool:
            for row in pool.map(_run, todo):
                rows.append(row)
                print(row, flush=True)
                args.rows.write_text(json.dumps(rows, indent=1) + "\n")
    write_results(args.out, report(rows))


def _chosen(job: tuple[str, str, float, int], args: argparse.Namespace) -> bool:
    """Whether `--scales` / `--lrs` keep `job` (a shorter run, said so in the report)."""
    _, arm, value, _ = job
    chosen = args.scales if arm == "gbfunc" else args.lrs
    return chosen is None or any(abs(value - c) < 1e-3 for c in chosen)


def _run(job: tuple[str, str, float, int]) -> dict:
    return run(*job)


if __name__ == "__main__":
    main()
