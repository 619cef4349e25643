"""Smoke test of the main job (`examples/main_job.py`): tiny models, a few steps, two seeds,
every output."""

import math
import re
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

import gbfunc as gb
from examples.data import (
    CharCorpus,
    digits_held_out,
    digits_split,
    pydoc_held_out,
    pydoc_text,
)
from examples.main_job import main, run_tasks, usable_cores
from examples.models import CharTransformer, DigitsCNN
from examples.seeds import Stat, critical, paired_gap, rule
from examples.tasks import CharLMConfig, DigitsConfig

TINY_CHARLM = CharLMConfig(
    steps=3, batch=4, context=16, width=32, depth=1, heads=2, eval_every=2, eval_windows=8, seeds=2
)
ARMS = ["dense", "gb", "narrow", "low rank"]


def _table_totals(out: str) -> list[str]:
    """The two total lines of every `gb.report` table printed."""
    return [line for line in out.splitlines() if line.startswith(("generated ", "whole model "))]


def test_data_is_real_and_split() -> None:
    corpus = CharCorpus.from_text(pydoc_text())
    assert corpus.vocab_size > 80
    assert len(corpus.val) / (len(corpus.train) + len(corpus.val)) == pytest.approx(0.1, abs=1e-3)
    assert 3.0 < corpus.unigram_entropy() < 3.5
    x_train, _, x_val, y_val = digits_split()
    assert x_train.shape[1:] == (1, 8, 8)
    assert len(x_train) + len(x_val) == 1797
    assert set(y_val.tolist()) == set(range(10))
    assert float(x_train.max()) == 1.0


def _windows(text: str, n: int) -> set[str]:
    return {text[i : i + n] for i in range(len(text) - n + 1)}


def test_pydoc_test_text_was_neither_trained_nor_chosen_on() -> None:
    train, val, test = pydoc_held_out()
    total = len(train) + len(val) + len(test)
    assert 0.07 < len(test) / total < 0.11
    assert 0.08 < len(val) / total < 0.12
    # Validation is the part of `from_text`'s split that rates were chosen on.
    chosen_on = CharCorpus.from_text(pydoc_text())
    chosen_text = chosen_on.decode(chosen_on.val)
    assert val.endswith(chosen_text[-300:])
    assert 0.85 * len(chosen_text) < len(val) < len(chosen_text) + 10_000  # less repeats
    # No 128-character window of a held-out part occurs in training: `compound` holds the
    # topics `while`, `with` and `try`, which a split by characters put on both sides.
    seen = _windows(train, 128)
    assert not _windows(test, 128) & seen
    assert not _windows(val, 128) & seen
    assert not _windows(test, 128) & _windows(val, 128)
    assert 'The "while" statement is used for repeated execution' in train  # in `compound`
    corpus = CharCorpus.from_parts(train, val, test)
    assert corpus.chars == chosen_on.chars
    assert corpus.test is not None
    assert corpus.decode(corpus.test) == test


def _images(x: torch.Tensor) -> set[tuple[float, ...]]:
    return {tuple(image.flatten().tolist()) for image in x}  # digits has no two alike


def test_digits_test_images_were_not_chosen_on_and_stay_fixed() -> None:
    _, _, chosen_on, _ = digits_split(seed=0)  # equal_params' validation images
    first, second = digits_held_out(seed=0), digits_held_out(seed=1)
    for x_train, _, x_val, _, x_test, y_test in (first, second):
        assert (len(x_train), len(x_val), len(x_test)) == (1077, 360, 360)
        assert set(y_test.tolist()) == set(range(10))
        assert len(_images(x_train) | _images(x_val) | _images(x_test)) == 1797
    assert torch.equal(first[4], second[4])  # the same test set for every seed
    assert not torch.equal(first[2], second[2])  # each seed's own validation split
    assert not _images(first[4]) & _images(chosen_on)


def test_stat_and_paired_gap() -> None:
    stat = Stat.of([1.0, 2.0, 4.0])
    assert stat.mean == pytest.approx(7 / 3)
    assert stat.se == pytest.approx(math.sqrt((16 / 9 + 1 / 9 + 25 / 9) / 2 / 3))
    assert (stat.spread, stat.n) == (3.0, 3)
    # Paired by seed: a constant difference is beyond noise, however spread the arms are.
    gap = paired_gap([1.0, 5.0, 9.0], [0.9, 4.9, 8.9])
    assert gap.mean == pytest.approx(0.1)
    assert gap.se == pytest.approx(0, abs=1e-12)
    assert gap.label == "beyond noise"
    assert Stat.of([0.1, -0.1]).label == "within noise"
    # A paired t-test at 5%: 2.58 s.e. over 3 seeds is within noise (t = 4.30 at 2 degrees of
    # freedom; twice the s.e. labelled it beyond), over 6 seeds beyond (t = 2.57).
    assert critical(3) == pytest.approx(4.303, abs=1e-3)
    assert rule([3, 1, 5, 3]).endswith("(t = 4.30 at 3 seeds, 2.78 at 5)")
    assert rule([1]).endswith("(one seed: no gap is labelled)")
    assert critical(5) == pytest.approx(2.776, abs=1e-3)
    three = Stat(mean=-0.0307, se=0.0119, spread=0.05, n=3)
    assert three.label == "within noise"
    assert Stat(mean=-0.0307, se=0.0119, spread=0.05, n=6).label == "beyond noise"
    assert paired_gap([2.0, 3.0, 4.0], [1.0]).n == 1  # only the seeds both arms have
    assert Stat.of([0.5]).label == "not ranked (one seed)"


def _arm_lines(out: str, task: str) -> dict[str, tuple[float, float, float]]:
    """Each arm's `loss mean +- s.e. (spread)` from the task's score lines."""
    pattern = rf"\[{task}\]   (dense|gb|narrow|low rank) +loss ([\d.]+) \+- ([\d.]+) \(([\d.]+)\)"
    return {m[0]: tuple(map(float, m[1:])) for m in re.findall(pattern, out)}


def _gap_lines(out: str, task: str) -> dict[str, tuple[float, float, str]]:
    """gb's loss gap to each arm: `(mean, s.e., label)`."""
    pattern = (
        rf"\[{task}\]   gb - (dense|narrow|low rank) +\(\d+ seeds?\)  "
        r"loss ([-+][\d.]+) \+- ([\d.]+) (beyond noise|within noise);"
    )
    return {m[0]: (float(m[1]), float(m[2]), m[3]) for m in re.findall(pattern, out)}


def test_charlm_writes_checkpoint_plot_and_table(tmp_path: Path, capsys) -> None:
    (result,) = run_tasks({"charlm": TINY_CHARLM}, tmp_path, torch.device("cpu"), 1)
    out = capsys.readouterr().out
    assert len(_table_totals(out)) == 2
    assert result.plot.is_file()
    assert result.plot.stat().st_size > 10_000
    assert list(result.test_loss) == ARMS
    # The task's own seeds per arm: 2 (TINY_CHARLM.seeds), the dense and low-rank arms 1.
    seeds = {"dense": 1, "gb": 2, "narrow": 2, "low rank": 1}
    assert {name: len(v) for name, v in result.test_loss.items()} == seeds
    assert {name: len(v) for name, v in result.test_acc.items()} == seeds
    values = [x for v in (*result.test_loss.values(), *result.test_acc.values()) for x in v]
    assert all(math.isfinite(x) for x in values)
    assert "(dense 1 seed, gb 2 seeds, narrow 2 seeds, low rank 1 seed)" in out
    # Every arm's mean +- s.e. (spread) over its seeds, as printed and as the result holds them.
    arms = _arm_lines(out, "charlm")
    assert list(arms) == ["gb", "narrow"]
    for name, (mean, se, spread) in arms.items():
        stat = result.loss(name)
        assert (mean, se, spread) == pytest.approx((stat.mean, stat.se, stat.spread), abs=1e-4)
    one = f"[charlm]   dense     loss {result.test_loss['dense'][0]:.4f} (1 seed)"
    assert one in out
    # gb's gap to the narrow arm, paired by seed and labelled as its printed numbers say; to
    # the arms of one seed, the gap without an s.e.
    gaps = _gap_lines(out, "charlm")
    assert list(gaps) == ["narrow"]
    gap, se, label = gaps["narrow"]
    assert gap == pytest.approx(result.loss_gap("narrow").mean, abs=1e-4)
    assert se == pytest.approx(result.loss_gap("narrow").se, abs=1e-4)
    n = result.loss_gap("narrow").n
    assert label == ("beyond noise" if abs(gap) > critical(n) * se else "within noise")
    assert "[charlm]   gb - dense    (1 seed)  loss " in out
    summary = out[out.index("\nsummary:") :]
    # Loss and accuracy, vs dense and low rank; the summary's the loss's.
    assert out.count("not ranked (one seed)") - summary.count("not ranked (one seed)") == 4
    assert "charlm" in summary
    assert "2 seeds where not said" in summary
    assert "gb vs dense" in summary
    assert "vs narrow" in summary
    assert "noise" in summary

    # The checkpoint loads for the same model, with the plan and vocabulary it was trained with.
    corpus = CharCorpus.from_text(pydoc_text())
    cfg = TINY_CHARLM
    model = CharTransformer(corpus.vocab_size, cfg.context, cfg.width, cfg.depth, cfg.heads)
    ckpt = gb.load(result.checkpoint, model)
    assert ckpt.step == cfg.steps
    assert ckpt.meta["chars"] == corpus.chars
    assert ckpt.plan.fingerprint() == gb.plan(model, **cfg.plan).fingerprint()


def test_cli_digits(tmp_path: Path, capsys) -> None:
    args = ["--task", "digits", "--steps", "3", "--seeds", "2", "--no-compile", "--jobs", "1"]
    (result,) = main([*args, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert len(_table_totals(out)) == 2
    assert "summary" in out
    # The rule printed is the one the labels used: 2 seeds (it said "4.30 at 3 seeds").
    assert "|gap| > t s.e. (t = 12.71 at 2 seeds)" in out
    assert "4.30" not in out
    assert result.report.generated_compression >= 20
    assert (tmp_path / "digits_gb.safetensors").is_file()
    assert (tmp_path / "digits_curves.png").is_file()
    # The saved g-nets regenerate a model that scores what the run reported.
    cfg = DigitsConfig()
    ckpt = gb.load(result.checkpoint, DigitsCNN(cfg.channels, cfg.hidden))
    *_, x_test, y_test = digits_held_out()
    with torch.no_grad():
        params = gb.apply(ckpt.gparams, ckpt.plan)
        logits = functional_call(DigitsCNN(cfg.channels, cfg.hidden), params, (x_test,))
    accuracy = float((logits.argmax(-1) == y_test).float().mean())
    assert accuracy == pytest.approx(result.test_acc["gb"][0])  # the checkpoint is seed 0's


def _counts(out: str, task: str) -> dict[str, int]:
    """Each arm's trainable parameters, from the task's `trainable parameters` line."""
    line = next(s for s in out.splitlines() if s.startswith(f"[{task}] trainable parameters"))
    found = re.findall(r"(dense|gb|narrow|low rank) ([\d,]+)", line)
    return {name: int(count.replace(",", "")) for name, count in found}


def test_cli_digits_trains_narrow_and_low_rank_arms_at_gb_size(tmp_path: Path, capsys) -> None:
    # Two processes (the default on a CPU is one per core), spawned, one job each at a time.
    args = ["--task", "digits", "--steps", "2", "--seeds", "2", "--jobs", "2"]
    (result,) = main([*args, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    counts = _counts(out, "digits")
    assert "8 jobs (one arm, one seed each) on 2 process(es)" in out
    assert list(result.test_acc) == ARMS
    assert all(len(v) == 2 for v in result.test_acc.values())
    assert len(_gap_lines(out, "digits")) == 3
    assert counts["gb"] == result.report.stored_params
    assert counts["dense"] == result.report.dense_params
    assert abs(counts["low rank"] / counts["gb"] - 1) <= 0.1  # ranks are rounded per weight
    assert abs(counts["narrow"] / counts["gb"] - 1) <= 0.2  # widths are integers


def test_cli_mlp_says_why_it_has_no_low_rank_arm(tmp_path: Path, capsys) -> None:
    args = ["--task", "mlp", "--steps", "3", "--seeds", "2", "--jobs", "1"]
    (result,) = main([*args, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert list(result.test_acc) == ["dense", "gb", "narrow"]
    assert result.report.compression >= 90  # the paper's genome at ~100x, biases generated
    counts = _counts(out, "mlp")
    assert abs(counts["narrow"] / counts["gb"] - 1) <= 0.1  # the equal-parameter baseline
    # 64-800-10 at rank 1 keeps its 810 biases: (800 + 64) + (10 + 800) + 810 parameters.
    assert "no low rank: rank 1 for every weight needs 2,484" in out
    assert (tmp_path / "mlp_curves.png").is_file()


def test_the_job_counts_cores_where_the_os_has_no_affinity(monkeypatch) -> None:
    """macOS and Windows have no `os.sched_getaffinity`: the README's first command raised
    AttributeError there before parsing its arguments."""
    monkeypatch.delattr("os.sched_getaffinity", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 3)
    assert usable_cores() == 3
