"""Smoke test of the main job (`examples/main_job.py`): tiny models, a few steps, every output."""

import math
import re
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

import gbfunc as gb
from examples.data import CharCorpus, digits_split, pydoc_text
from examples.main_job import main, run_charlm
from examples.models import CharTransformer, DigitsCNN
from examples.tasks import CharLMConfig, DigitsConfig

TINY_CHARLM = CharLMConfig(
    steps=3, batch=4, context=16, width=32, depth=1, heads=2, eval_every=2, eval_windows=8
)


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


def test_charlm_writes_checkpoint_plot_and_table(tmp_path: Path, capsys) -> None:
    result = run_charlm(TINY_CHARLM, tmp_path, torch.device("cpu"))
    out = capsys.readouterr().out
    assert len(_table_totals(out)) == 2
    assert "[charlm] validation loss: dense" in out
    assert result.plot.is_file()
    assert result.plot.stat().st_size > 10_000
    assert all(math.isfinite(v) for v in (*result.val_loss.values(), *result.val_acc.values()))
    # The checkpoint loads for the same model, with the plan and vocabulary it was trained with.
    corpus = CharCorpus.from_text(pydoc_text())
    cfg = TINY_CHARLM
    model = CharTransformer(corpus.vocab_size, cfg.context, cfg.width, cfg.depth, cfg.heads)
    ckpt = gb.load(result.checkpoint, model)
    assert ckpt.step == cfg.steps
    assert ckpt.meta["chars"] == corpus.chars
    assert ckpt.plan.fingerprint() == gb.plan(model, **cfg.plan).fingerprint()


def test_cli_digits(tmp_path: Path, capsys) -> None:
    (result,) = main(["--task", "digits", "--steps", "3", "--no-compile", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert len(_table_totals(out)) == 2
    assert "summary" in out
    assert result.report.generated_compression >= 20
    assert (tmp_path / "digits_gb.safetensors").is_file()
    assert (tmp_path / "digits_curves.png").is_file()
    # The saved g-nets regenerate a model that scores what the run reported.
    cfg = DigitsConfig()
    ckpt = gb.load(result.checkpoint, DigitsCNN(cfg.channels, cfg.hidden))
    _, _, x_val, y_val = digits_split()
    with torch.no_grad():
        params = gb.apply(ckpt.gparams, ckpt.plan)
        logits = functional_call(DigitsCNN(cfg.channels, cfg.hidden), params, (x_val,))
    accuracy = float((logits.argmax(-1) == y_val).float().mean())
    assert accuracy == pytest.approx(result.val_acc["gb"])


def _counts(out: str, task: str) -> dict[str, int]:
    """Each arm's trainable parameters, from the task's `trainable parameters` line."""
    line = next(s for s in out.splitlines() if s.startswith(f"[{task}] trainable parameters"))
    found = re.findall(r"(dense|gb|narrow|low rank) ([\d,]+)", line)
    return {name: int(count.replace(",", "")) for name, count in found}


def test_cli_digits_trains_narrow_and_low_rank_arms_at_gb_size(tmp_path: Path, capsys) -> None:
    (result,) = main(["--task", "digits", "--steps", "2", "--out", str(tmp_path)])
    counts = _counts(capsys.readouterr().out, "digits")
    assert list(result.val_acc) == ["dense", "gb", "narrow", "low rank"]
    assert counts["gb"] == result.report.stored_params
    assert counts["dense"] == result.report.dense_params
    assert abs(counts["low rank"] / counts["gb"] - 1) <= 0.1  # ranks are rounded per weight
    assert abs(counts["narrow"] / counts["gb"] - 1) <= 0.2  # widths are integers


def test_cli_mlp_says_why_it_has_no_low_rank_arm(tmp_path: Path, capsys) -> None:
    (result,) = main(["--task", "mlp", "--steps", "3", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert list(result.val_acc) == ["dense", "gb", "narrow"]
    assert result.report.compression >= 90  # the paper's genome at ~100x, biases generated
    counts = _counts(out, "mlp")
    assert abs(counts["narrow"] / counts["gb"] - 1) <= 0.1  # the equal-parameter baseline
    # 64-800-10 at rank 1 keeps its 810 biases: (800 + 64) + (10 + 800) + 810 parameters.
    assert "no low rank: rank 1 for every weight needs 2,484" in out
    assert (tmp_path / "mlp_curves.png").is_file()
