"""The main job: dense and genomic-bottleneck models trained side by side on real data.

Every task uses data that ships with Python or a package, so nothing is downloaded:

- `charlm`: a character-level GPT-like transformer on Python's own help text (`pydoc_data`),
  with the hashed genome at ~20x of the whole model (embeddings and head generated too).
- `digits`: a small CNN on scikit-learn's 8x8 handwritten digits, with the hashed genome at
  ~23x.
- `mlp`: the paper's MLP shape (64-800-10) on the same digits, with the paper's genome
  (neuron labels, generated biases) at ~100x.

For each task and seed the arms start from the same seed, see the same batches in the same
order and train with AdamW and the same schedule: the dense model, its gbfunc twin (g-nets
generate its weights from 20-100x fewer parameters; they have their own learning rate), and
the two obvious alternatives at the twin's size: a *narrow* dense model of the same
architecture whose parameter count is nearest, and a *low-rank* model (every weight as
`U @ V.T`, about as many parameters in all: 1-6% more, each weight's rank rounded) where
rank 1 fits.

Every arm runs over several seeds (the task's `seeds` and `arm_seeds`: on the transformer 3
for gbfunc and the narrow model and 1 for the dense and low-rank ones, which are far from
gbfunc and cost most; 5 on the digits CNN and 3 on the MLP; `--seeds` sets every arm's). A
seed sets the initialisation, the batch order and, on digits, the train/validation split.
The curves are on validation data; the scores the job ranks by are on a test set that no rate
or size was chosen on (`benchmarks.equal_params` chose them on validation data), the same for
every seed: help topics held out whole, none of whose paragraphs occurs in training
(`examples.data.pydoc_held_out`), and 360 digits (`digits_held_out`). The job prints each
arm's mean +- standard error (and the seeds' spread, max - min) of the test loss and
accuracy, and for each gap between gbfunc and another arm the mean of the
per-seed differences +- its standard error, "beyond noise" where a two-sided paired t-test
at 5% rejects "no gap" (|gap| > 4.30 s.e. at 3 seeds, 2.78 at 5) and "within noise" where it
does not ("not ranked (one seed)" where the other arm has one seed). It saves the first
seed's compressed model with `gb.save` and plots the first seed's curves.

Each (task, seed, arm) is one job, and `--jobs` processes run them at `cores / jobs` threads
each (default: one process per core, one thread each: a second thread speeds these small
matmuls up far less than a second process does, and one thread cannot oversubscribe a core).

    python -m examples.main_job                  # all tasks; see README.md for the time
    python -m examples.main_job --task charlm --steps 3000 --device cuda --jobs 1
"""

import argparse
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

import gbfunc as gb
from examples.baselines import smallest_low_rank, weight_matrices
from examples.data import CharCorpus, char_batch, char_windows, digits_held_out, pydoc_held_out
from examples.models import CharTransformer, DigitsCNN, digits_mlp
from examples.seeds import Stat, paired_gap, rule
from examples.tasks import EVAL_TOKENS, CharLMConfig, DigitsConfig, MLPConfig
from examples.training import (
    Arm,
    Batches,
    Curves,
    TrainConfig,
    dense_and_gb,
    evaluate,
    low_rank_arm,
    narrow_arm,
    plot,
    train,
)

HEAVY_FIRST = ("dense", "low rank", "gb", "narrow")  # the order jobs start in, within a task


@dataclass
class Setup:
    """A task built for one seed: its plan, arms, batches, and how to score and describe them."""

    plan: gb.Plan
    arms: list[Arm]
    batches: Callable[[], Batches]
    validate: Callable[[Arm], tuple[float, float]]  # a curve point
    final: Callable[[Arm], tuple[float, float]]  # the final score
    header: list[str]
    title: str
    accuracy: bool = False  # plot an accuracy panel; the summary ranks by accuracy
    baseline: tuple[float, str] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    sample: Callable[[Arm], str] | None = None


@dataclass(frozen=True)
class Job:
    """One arm of one task trained on one seed (`cfg.seed`)."""

    task: str
    cfg: TrainConfig
    arm: str
    out: Path
    device: str
    first: bool  # the task's first seed: save the gb checkpoint, draw a sample
    threads: int | None = None  # torch threads in this job (None: leave as is)
    bar: bool = True


@dataclass(frozen=True)
class ArmRun:
    """What a job produced."""

    task: str
    seed: int
    arm: str
    loss: float
    acc: float
    curves: Curves
    sample: str | None
    seconds: float


@dataclass(frozen=True)
class Result:
    """What a task produced; `test_loss` / `test_acc` map arm name to its test score per seed."""

    task: str
    report: gb.Report
    test_loss: dict[str, list[float]]
    test_acc: dict[str, list[float]]
    checkpoint: Path
    plot: Path
    seconds: float  # the task's jobs' time, summed
    by_accuracy: bool = False  # the summary ranks this task by accuracy

    def loss(self, arm: str) -> Stat:
        return Stat.of(self.test_loss[arm])

    def acc(self, arm: str) -> Stat:
        return Stat.of([100 * a for a in self.test_acc[arm]])

    def loss_gap(self, arm: str, other: str = "gb") -> Stat:
        """`other - arm` in nats, paired by seed."""
        return paired_gap(self.test_loss[other], self.test_loss[arm])

    def acc_gap(self, arm: str, other: str = "gb") -> Stat:
        """`other - arm` in accuracy points, paired by seed."""
        return paired_gap(
            [100 * a for a in self.test_acc[other]], [100 * a for a in self.test_acc[arm]]
        )


def with_baselines(
    model: nn.Module, plan: gb.Plan, narrow: Arm, cfg: TrainConfig, device: torch.device
) -> list[Arm]:
    """Dense, gb, the `narrow` arm, and a low-rank arm of gb's size where rank 1 fits."""
    arms = [*dense_and_gb(model, plan, cfg, device), narrow]
    low_rank = low_rank_arm(model, gb.report(plan).stored_params, cfg, device)
    return arms if low_rank is None else [*arms, low_rank]


def setup_charlm(cfg: CharLMConfig, device: torch.device) -> Setup:
    """The character-level transformer and its arms; see the module docstring."""
    corpus = CharCorpus.from_parts(*pydoc_held_out())
    train_ids, val_ids = corpus.train.to(device), corpus.val.to(device)
    assert corpus.test is not None
    test_x, test_y = char_windows(corpus.test.to(device), cfg.context)
    entropy = corpus.unigram_entropy()
    torch.manual_seed(cfg.seed)
    model = CharTransformer(corpus.vocab_size, cfg.context, cfg.width, cfg.depth, cfg.heads)
    model = model.to(device)
    plan = gb.plan(model, **cfg.plan)
    narrow = narrow_arm(
        lambda w: CharTransformer(corpus.vocab_size, cfg.context, w, cfg.depth, cfg.heads),
        gb.report(plan).stored_params,
        range(cfg.heads, cfg.width + 1, cfg.heads),
        cfg,
        device,
    )
    arms = with_baselines(model, plan, narrow, cfg, device)
    val_x, val_y = char_windows(val_ids, cfg.context)
    # Curve points use evenly spaced validation windows; the final score every test window.
    pick = torch.linspace(0, len(val_x) - 1, min(cfg.eval_windows, len(val_x))).long()
    eval_batch = max(1, EVAL_TOKENS // cfg.context)

    def batches() -> Batches:
        gen = torch.Generator().manual_seed(cfg.seed)
        while True:
            yield char_batch(train_ids, cfg.batch, cfg.context, gen)

    def validate(arm: Arm) -> tuple[float, float]:
        return evaluate(arm.model, arm.params(), val_x[pick], val_y[pick], eval_batch)

    def final(arm: Arm) -> tuple[float, float]:
        return evaluate(arm.model, arm.params(), test_x, test_y, eval_batch)

    header = [
        f"[charlm] {len(corpus.train):,} train / {len(corpus.val):,} val / "
        f"{len(corpus.test):,} test characters (by topic), "
        f"vocabulary {corpus.vocab_size}, unigram entropy {entropy:.3f} nats; plan {dict(cfg.plan)}"
    ]
    title = f"char transformer on pydoc topics (gb: {gb.report(plan).compression:.0f}x whole model)"
    return Setup(
        plan,
        arms,
        batches,
        validate,
        final,
        header,
        title,
        baseline=(entropy, "unigram entropy"),
        meta={"chars": corpus.chars},
        sample=lambda arm: sample(arm.model, arm.params(), corpus, cfg),
    )


@torch.no_grad()
def sample(
    model: nn.Module, params: dict[str, Tensor], corpus: CharCorpus, cfg: CharLMConfig, n: int = 120
) -> str:
    """`n` characters drawn at temperature 0.8 after a prompt from the validation text."""
    gen = torch.Generator().manual_seed(cfg.seed)
    prompt = cfg.context // 2
    ids = corpus.val[:prompt].to(next(iter(params.values())).device)
    for _ in range(n):
        logits = functional_call(model, params, (ids[None, -cfg.context :],))[0, -1]
        probs = torch.softmax(logits.float().cpu() / 0.8, -1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen).to(ids.device)])
    return corpus.decode(ids[prompt:].cpu())


def setup_digits(cfg: DigitsConfig, device: torch.device) -> Setup:
    """The digits CNN and its arms; see the module docstring."""
    torch.manual_seed(cfg.seed)
    model = DigitsCNN(cfg.channels, cfg.hidden).to(device)
    plan = gb.plan(model, **cfg.plan)
    scale = cfg.hidden / cfg.channels[0]  # the narrow CNN keeps the stages' proportions
    narrow = narrow_arm(
        lambda w: DigitsCNN((w, 2 * w), round(scale * w)),
        gb.report(plan).stored_params,
        range(1, cfg.channels[0] + 1),
        cfg,
        device,
    )
    arms = with_baselines(model, plan, narrow, cfg, device)
    header = [
        f"[digits] 1077 train / 360 val / 360 test images (8x8, 10 classes); plan {dict(cfg.plan)}"
    ]
    return digits_setup("CNN", arms, plan, cfg, device, header)


def setup_mlp(cfg: MLPConfig, device: torch.device) -> Setup:
    """The digits MLP with the paper's genome and its arms; see the module docstring."""
    torch.manual_seed(cfg.seed)
    model = digits_mlp(cfg.hidden).to(device)
    plan = gb.plan(model, **cfg.plan)
    narrow = narrow_arm(digits_mlp, gb.report(plan).stored_params, range(1, 200), cfg, device)
    arms = with_baselines(model, plan, narrow, cfg, device)
    header = [f"[mlp] 64-{cfg.hidden}-10 on digits; plan {dict(cfg.plan)}"]
    return digits_setup("MLP 64-800-10", arms, plan, cfg, device, header)


def digits_setup(
    what: str,
    arms: list[Arm],
    plan: gb.Plan,
    cfg: TrainConfig,
    device: torch.device,
    header: list[str],
) -> Setup:
    """Batches and scores of a digits task: the seed's train/validation split, the test set."""
    x_train, y_train, x_val, y_val, x_test, y_test = (
        t.to(device) for t in digits_held_out(seed=cfg.seed)
    )

    def batches() -> Batches:
        gen = torch.Generator().manual_seed(cfg.seed)
        while True:
            index = torch.randint(len(x_train), (cfg.batch,), generator=gen).to(device)
            yield x_train[index], y_train[index]

    def validate(arm: Arm) -> tuple[float, float]:
        return evaluate(arm.model, arm.params(), x_val, y_val, len(x_val))

    def final(arm: Arm) -> tuple[float, float]:
        return evaluate(arm.model, arm.params(), x_test, y_test, len(x_test))

    title = f"{what} on scikit-learn digits (gb: {gb.report(plan).compression:.0f}x whole model)"
    return Setup(plan, arms, batches, validate, final, header, title, accuracy=True)


SETUPS: dict[str, tuple[Callable[[Any, torch.device], Setup], type[TrainConfig]]] = {
    "charlm": (setup_charlm, CharLMConfig),
    "digits": (setup_digits, DigitsConfig),
    "mlp": (setup_mlp, MLPConfig),
}


def checkpoint_path(out: Path, task: str) -> Path:
    return out / f"{task}_gb.safetensors"


def run_job(job: Job) -> ArmRun:
    """Build the task for the job's seed, train the one arm, score it (and save, if first)."""
    if job.threads is not None:
        torch.set_num_threads(job.threads)
    started = time.perf_counter()
    cfg = job.cfg
    setup = SETUPS[job.task][0](cfg, torch.device(job.device))
    arm = next(a for a in setup.arms if a.name == job.arm)
    desc = f"{job.task} seed {cfg.seed} {arm.name}"
    curves = train([arm], setup.batches(), setup.validate, cfg, desc, bar=job.bar)
    loss, acc = setup.final(arm)
    text = setup.sample(arm) if job.first and setup.sample is not None else None
    if job.first and arm.name == "gb":
        meta = {"task": job.task, "seed": cfg.seed, "config": asdict(cfg), **setup.meta}
        gb.save(checkpoint_path(job.out, job.task), arm.tree, setup.plan, step=cfg.steps, meta=meta)
    return ArmRun(
        job.task, cfg.seed, arm.name, loss, acc, curves, text, time.perf_counter() - started
    )


def run_jobs(jobs: Sequence[Job], processes: int) -> list[ArmRun]:
    """Every job, in this process (`processes` 1) or in a pool of spawned processes."""
    done: list[ArmRun] = []

    def report(run: ArmRun) -> None:
        done.append(run)
        print(
            f"[{run.task}] seed {run.seed} {run.arm}: test loss {run.loss:.4f}, "
            f"accuracy {100 * run.acc:.2f}% ({run.seconds:.0f} s; {len(done)}/{len(jobs)} jobs)",
            flush=True,
        )

    if processes == 1:
        for job in jobs:
            report(run_job(job))
        return done
    # Spawned, not forked: a forked child of a process that has used torch's thread pool can
    # hang in it. `examples.main_job.run_job` by name, so that `-m` runs pickle it too.
    from examples import main_job

    with ProcessPoolExecutor(processes, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(main_job.run_job, job) for job in jobs]
        for future in as_completed(futures):
            report(future.result())
    return done


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def fmt(stat: Stat, digits: int, unit: str = "") -> str:
    """`mean +- s.e.` (or the one value, said to be one seed's), at `digits` decimals."""
    if stat.n == 1:
        return f"{stat.mean:.{digits}f}{unit} (1 seed)"
    return f"{stat.mean:.{digits}f} +- {stat.se:.{digits}f}{unit}"


def signed(stat: Stat, digits: int, unit: str = "") -> str:
    """A gap: `+mean +- s.e.` and its label."""
    se = "" if stat.n == 1 else f" +- {stat.se:.{digits}f}"
    return f"{stat.mean:+.{digits}f}{se}{unit} {stat.label}"


def finish(
    task: str,
    setup: Setup,
    runs: list[ArmRun],
    out: Path,
) -> Result:
    """Print every arm's scores over the seeds and gbfunc's gaps, plot the first seed, package."""
    names = [a.name for a in setup.arms]
    by_arm = {n: sorted((r for r in runs if r.arm == n), key=lambda r: r.seed) for n in names}
    loss = {n: [r.loss for r in by_arm[n]] for n in names}
    acc = {n: [r.acc for r in by_arm[n]] for n in names}
    rep = gb.report(setup.plan)
    checkpoint = checkpoint_path(out, task)
    result = Result(
        task,
        rep,
        loss,
        acc,
        checkpoint,
        out / f"{task}_curves.png",
        sum(r.seconds for r in runs),
        setup.accuracy,
    )
    first = {n: by_arm[n][0] for n in names}
    for n in names:
        if first[n].sample is not None:
            print(f"[{task}] {n:8s} sample (seed {first[n].seed}): {first[n].sample!r}")
    curves = Curves.empty(names)
    curves.val_steps = first[names[0]].curves.val_steps
    for n in names:
        curves.train[n] = first[n].curves.train[n]
        curves.val_loss[n] = first[n].curves.val_loss[n]
        curves.val_acc[n] = first[n].curves.val_acc[n]
    title = f"{setup.title}, seed {first[names[0]].seed}"
    plot(curves, result.plot, title, baseline=setup.baseline, accuracy=setup.accuracy)
    seeds = sorted({r.seed for r in runs})
    counts = {n: len(by_arm[n]) for n in names}
    same = len(set(counts.values())) == 1
    how_many = (
        f"{counts[names[0]]} seeds per arm"
        if same
        else ", ".join(f"{n} {plural(c, 'seed')}" for n, c in counts.items())
    )
    print(
        f"[{task}] test scores over seeds {seeds[0]}-{seeds[-1]} ({how_many}): "
        "mean +- standard error (spread: max - min over the seeds)"
    )
    for n in names:
        ls, ac = result.loss(n), result.acc(n)
        spread = (f" ({ls.spread:.4f})", f" ({ac.spread:.2f})") if ls.n > 1 else ("", "")
        print(
            f"[{task}]   {n:8s}  loss {fmt(ls, 4)}{spread[0]}  "
            f"accuracy {fmt(ac, 2, '%')}{spread[1]}"
        )
    pairs = [result.loss_gap(n).n for n in names if n != "gb"]
    print(
        f"[{task}] gbfunc's gaps, paired by seed (mean +- s.e. of the per-seed differences; "
        f"{rule(pairs)}):"
    )
    for n in names:
        if n != "gb":
            lg, ag = result.loss_gap(n), result.acc_gap(n)
            print(
                f"[{task}]   gb - {n:8s} ({plural(lg.n, 'seed')})  loss {signed(lg, 4)}; "
                f"accuracy {signed(ag, 2, ' points')}"
            )
    sizes = ", ".join(f"{a.name} {a.trainable():,}" for a in setup.arms)
    missing = ""
    if "low rank" not in names:
        smallest = smallest_low_rank(setup.arms[0].model, weight_matrices(setup.arms[0].model))
        missing = f"; no low rank: rank 1 for every weight needs {smallest:,}"
    print(f"[{task}] trainable parameters: {sizes} (narrow: the width nearest gb's count{missing})")
    saved = (
        f"checkpoint {checkpoint} (seed {first['gb'].seed}; "
        f"{checkpoint.stat().st_size / 2**20:.2f} MiB; dense fp32 "
        f"{rep.dense_params * 4 / 2**20:.2f} MiB)"
    )
    print(
        f"[{task}] compression: {rep.generated_compression:.1f}x on the generated weights, "
        f"{rep.compression:.1f}x on the whole model; {saved}; plot {result.plot}"
    )
    return result


def summary_lines(r: Result) -> list[str]:
    """Two lines of the final summary: the arms' means, and gbfunc's gaps with their labels."""
    names = list(r.test_loss)
    seeds = {len(v) for v in r.test_loss.values()}
    n = f"{seeds.pop()} seeds" if len(seeds) == 1 else f"{max(seeds)} seeds where not said"
    if r.by_accuracy:
        means = "  ".join(f"{a} {fmt(r.acc(a), 2, '%')}" for a in names)
        gaps = ", ".join(f"vs {a} {signed(r.acc_gap(a), 2, ' points')}" for a in names if a != "gb")
        what = "test accuracy"
    else:
        means = "  ".join(f"{a} {fmt(r.loss(a), 3)}" for a in names)
        gaps = ", ".join(f"vs {a} {signed(r.loss_gap(a), 3, ' nats')}" for a in names if a != "gb")
        what = "test loss"
    return [
        f"  {r.task:6s}  {r.report.generated_compression:4.1f}x generated "
        f"({r.report.compression:4.1f}x whole model), {n}, {what}: {means}  "
        f"({r.seconds:.0f} s of jobs)",
        f"  {'':6s}  gb {gaps}",
    ]


def main(argv: Sequence[str] | None = None) -> list[Result]:
    """Parse the command line, run the chosen tasks over their seeds and print a summary."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("charlm", "digits", "mlp", "all"), default="all")
    parser.add_argument("--steps", type=int, help="training steps of each task (default: its own)")
    parser.add_argument(
        "--seeds", type=int, help="seeds of every arm (default: the task's own, per arm)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    cores = usable_cores()
    parser.add_argument(
        "--jobs",
        type=int,
        help=f"processes training arms at once (default on cpu: one per core, here {cores}, "
        "at one thread each; 1 on a GPU)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each arm's loss (default: off, measured no faster on 2 CPU cores)",
    )
    parser.add_argument("--out", type=Path, default=Path("runs"), help="checkpoints and plots")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    options = {"steps": args.steps, "compile": args.compile, "seeds": args.seeds}
    overrides: dict[str, Any] = {k: v for k, v in options.items() if v is not None}
    if args.seeds is not None:
        overrides["arm_seeds"] = {}  # every arm
    tasks = ("charlm", "digits", "mlp") if args.task == "all" else (args.task,)
    configs = {task: replace(SETUPS[task][1](), **overrides) for task in tasks}
    return run_tasks(configs, args.out, device, args.jobs)


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the OS has one: Linux), else
    the machine's."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def gap_seeds(results: Sequence[Result]) -> list[int]:
    """How many seeds each of `results`' gaps is paired over."""
    return [r.loss_gap(n).n for r in results for n in r.test_loss if n != "gb"]


def run_tasks(
    configs: dict[str, TrainConfig], out: Path, device: torch.device, processes: int | None = None
) -> list[Result]:
    """Run the tasks (`{name: config}`) over their seeds, print each's scores and a summary.

    `processes` train jobs at once, at `cores / processes` threads each (default on a CPU: one
    per core); 1 trains in this process, with progress bars.
    """
    cores = usable_cores()
    processes = processes or (cores if device.type == "cpu" else 1)
    threads = max(1, cores // processes) if device.type == "cpu" else None
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    setups, jobs = {}, []
    for task, cfg in configs.items():
        setup = setups[task] = SETUPS[task][0](cfg, device)
        print("\n".join(setup.header))
        print(gb.report(setup.plan))
        # The costly arms first, so that the cheap ones fill the processes' last gaps.
        for arm in sorted(setup.arms, key=lambda a: HEAVY_FIRST.index(a.name)):
            for seed in range(cfg.seed, cfg.seed + cfg.arm_seeds.get(arm.name, cfg.seeds)):
                first = seed == cfg.seed
                job_cfg = replace(cfg, seed=seed)
                jobs.append(
                    Job(task, job_cfg, arm.name, out, str(device), first, threads, processes == 1)
                )
    how = f"{processes} process(es)" + (f" x {threads} thread(s)" if threads is not None else "")
    print(f"{len(jobs)} jobs (one arm, one seed each) on {how}", flush=True)
    runs = run_jobs(jobs, processes)
    results = [finish(t, setups[t], [r for r in runs if r.task == t], out) for t in configs]
    seconds = time.perf_counter() - started
    print(
        f"\nsummary: {seconds:.0f} s on {device} ({how}); mean +- s.e. over the seeds; "
        f"gb's gaps paired by seed; {rule(gap_seeds(results))}"
    )
    for r in results:
        print("\n".join(summary_lines(r)))
    return results


if __name__ == "__main__":
    main()
