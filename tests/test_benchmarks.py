"""The benchmark scripts' own logic: provenance, summaries, findings, and tiny runs of each."""

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

import gbfunc as gb
from benchmarks import peers, scaling
from benchmarks._meta import NOTES, recorded, write_results
from gbfunc.cpu._relu_loops import sums_usable


def test_recorded_writes_what_was_printed_under_the_provenance(tmp_path, capsys):
    path = tmp_path / "out" / "result.md"
    with recorded(path, "A title"):
        print("| a | b |")
        print("row 2")
    assert "row 2" in capsys.readouterr().out  # still printed
    text = path.read_text()
    assert text.startswith("# A title\n")
    for field in ("- command: `python ", "- code: ", "- machine: ", "torch ", "- date: 20"):
        assert field in text
    assert text.endswith("```\n| a | b |\nrow 2\n```\n")


def test_a_rerun_keeps_the_notes_kept_at_the_end_of_a_results_file(tmp_path):
    path = tmp_path / "result.md"
    with recorded(path, "A title"):
        print("first run")
    notes = f"{NOTES} (moved from benchmarks/README.md)\n\n- what the first run showed\n"
    path.write_text(path.read_text() + "\n" + notes)
    with recorded(path, "A title"):
        print("second run")
    text = path.read_text()
    assert "second run" in text
    assert "first run" not in text.split(NOTES)[0]
    assert text.endswith(f"```\n\n{notes}")
    write_results(tmp_path / "new.md", "# fresh\n")  # a file without notes: as given
    assert (tmp_path / "new.md").read_text() == "# fresh\n"


def test_peers_table_reports_failures_and_fallbacks():
    ok = peers.Contender("plain MLP", params=100, loss0=2.3)
    slow = peers.Contender("peer A", params=10, loss0=2.4, notes={"compiled": "graph breaks"})
    broken = peers.Contender("peer B", failed={"eager": "ImportError: no module", "compiled": "x"})
    times = {"plain MLP|eager": 2.0, "plain MLP|compiled": 1.0, "peer A|eager": 4.0}
    times["peer A|compiled"] = 3.0
    peaks = {(n, m): 1.0 for n in ("plain MLP", "peer A") for m in peers.MODES}
    text = peers.render([ok, slow, broken], times, peaks)
    assert "| peer A | 10 | 10.0x | 2.400 | 4.00 | 2.00 | 1.0 | 3.00* | 3.00* | 1.0 |" in text
    assert "| peer B | - | - | - | failed | - | - | failed | - | - |" in text
    assert "- peer B, eager: ImportError: no module" in text
    assert "- * peer A, compiled: graph breaks" in text


@pytest.mark.slow
def test_gpu_step_reports_a_step_that_fails_and_times_the_others(capsys):
    """A step that cannot compile (as on the H200 of 2026-11-28) is named with its error and
    left out of the timings; the others still run."""
    from benchmarks.gpu_step import that_run

    def fails() -> None:
        raise RuntimeError("RuntimeError when making fake tensor call\ndetails")

    calls = []
    kept = that_run({"plain eager": lambda: calls.append(1), "gbfunc 10x compiled": fails})
    assert list(kept) == ["plain eager"]
    assert calls == [1]
    printed = capsys.readouterr().out
    assert "gbfunc 10x compiled: failed: RuntimeError: RuntimeError when making fake" in printed


def test_equal_params_trains_every_family_at_each_budget_from_the_same_start():
    """A tiny run of the CNN task: each genome's baselines sized to its parameter count, and
    every learning rate of an arm started from the same tensors (two equal rates, equal rows)."""
    from dataclasses import replace

    from benchmarks import equal_params

    task = equal_params.TASKS["cnn"]
    lrs = {family: (0.01, 0.01) for family in task.lrs}
    task = replace(task, genomes=task.genomes[2:], lrs=lrs, arm_lrs={}, batch=8)
    rows = equal_params.run(task, seeds=1, steps=2)
    arms = {(r["ratio"], r["family"]) for r in rows}
    assert arms == {
        ("dense", "dense"),
        *(("~23x, hashed genome", f) for f in ("gbfunc", "narrow", "low rank", "hashed")),
        *(("~135x, hashed genome", f) for f in ("gbfunc", "narrow", "hashed")),  # no rank 1
    }
    for ratio in ("~23x, hashed genome", "~135x, hashed genome"):
        group = {r["family"]: r for r in rows if r["ratio"] == ratio}
        ours = group["gbfunc"]["params"]
        assert group["hashed"]["params"] == pytest.approx(ours, rel=0.01)
        assert abs(group["narrow"]["params"] / ours - 1) < 0.35
    for first, second in zip(rows[::2], rows[1::2], strict=True):
        assert (first["family"], first["ratio"]) == (second["family"], second["ratio"])
        # Equal to rounding: with 2 threads, scatter-adds in the backward sum in any order.
        assert first["val_loss"] == pytest.approx(second["val_loss"], rel=1e-5)
        assert math.isfinite(first["val_loss"])
        assert 0 <= first["val_acc"] <= 1


def test_results_csv_has_the_provenance_and_a_column_per_key(tmp_path):
    import csv

    from benchmarks._meta import write_csv

    rows = [{"ratio": "~20x", "lr": 0.1}, {"ratio": "~100x", "lr": 0.3, "seed": 1}]
    source = {"command": "python -m x", "machine": "m", "torch": "t", "date": "d"}
    path = tmp_path / "r.csv"
    write_csv(path, rows, source)
    first, *body = path.read_text().splitlines()
    assert first == "# python -m x | m, torch t | d"
    read = list(csv.DictReader(body))
    assert read == [
        {"ratio": "~20x", "lr": "0.1", "seed": ""},
        {"ratio": "~100x", "lr": "0.3", "seed": "1"},
    ]


@pytest.mark.slow
def test_scaling_measures_every_variant(monkeypatch):
    monkeypatch.setattr(scaling, "peak_bytes", lambda fn: (fn(), 2**20)[1])
    rows = scaling.measure(128, ("eager",), rounds=1, inner=1)
    assert [r["variant"] for r in rows] == list(scaling.VARIANTS)
    dense = rows[0]
    assert dense["x_dense_time"] == 1
    assert dense["trainable_params"] == dense["model_params"]
    assert all(r["trainable_params"] < dense["model_params"] / 3 for r in rows[1:])


def test_equal_params_picks_each_arms_best_lr_by_its_mean_over_seeds():
    from benchmarks.equal_params import findings, summarise

    def row(family, lr, seed, acc, params):
        return {
            "ratio": "~100x" if family != "dense" else "dense",
            "family": family,
            "arm": family,
            "params": params,
            "compression": 60_010 / params,
            "lr": lr,
            "seed": seed,
            "val_acc": acc,
            "seconds": 1.0,
        }

    rows = [row("dense", 1e-3, s, 0.97, 60_010) for s in range(2)]
    rows += [row("gbfunc", 0.1, 0, 0.99, 598), row("gbfunc", 0.1, 1, 0.81, 598)]  # mean 0.90
    rows += [row("gbfunc", 0.3, 0, 0.96, 598), row("gbfunc", 0.3, 1, 0.94, 598)]  # mean 0.95
    rows += [row("narrow", 0.03, 0, 0.94, 610), row("narrow", 0.03, 1, 0.92, 610)]
    summary = summarise(rows)
    ours = next(s for s in summary if s["family"] == "gbfunc")
    assert ours["lr"] == 0.3
    assert ours["score"] == pytest.approx(0.95)
    assert ours["lrs"] == [0.1, 0.3]
    assert ours["seeds"] == 2
    assert ours["spread"] == pytest.approx(0.02)
    text = findings(summary)
    assert "(gbfunc 598 params, 95.00%, mean of 2 seeds, spread 2.00)" in text
    assert "+2.00 pt vs narrow (610 params; spread 2.00)" in text
    assert "low rank infeasible" in text
    assert "hashed infeasible" in text
    assert "no width within" not in text  # 610 is within 10% of 598


def test_equal_params_rewrites_only_the_margins_of_a_results_file(tmp_path):
    """`--margins`: the margins section is told anew from the saved runs; the header, the
    table and the hand-written notes stay as they were."""
    import json

    from benchmarks.equal_params import MARGINS, rewrite_margins

    def row(family, seed, acc):
        return {"ratio": "~20x", "family": family, "arm": family, "params": 100,
                "compression": 20.0, "lr": 0.1, "seed": seed, "val_loss": 1.0,
                "val_acc": acc, "seconds": 1.0}  # fmt: skip

    rows = [row("gbfunc", 0, 0.90), row("gbfunc", 1, 0.94), row("narrow", 0, 0.91)]
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"rows": rows, "summary": [{"metric": "val_acc"}]}))
    kept = "# title\n\n- code: abc\n\n| table |\n"
    notes = "\n## Notes\n\nBy hand.\n"
    saved.with_suffix(".md").write_text(kept + MARGINS + "- **~20x** old line\n" + notes)
    rewrite_margins(saved)
    text = saved.with_suffix(".md").read_text()
    assert text.startswith(kept + MARGINS)
    assert text.endswith(notes)
    assert "old line" not in text
    assert "92.00%, mean of 2 seeds, spread 4.00): +1.00 pt vs narrow (100 params)" in text


def test_lr_leaves_reports_each_variant_against_the_default_paired_by_seed(capsys):
    from benchmarks.lr_leaves import report

    scores = {"default": {0: 96.0, 1: 97.0}, "w_in": {0: 97.0, 1: 97.5}}
    report(scores, 2.0)
    printed = capsys.readouterr().out
    assert "| default | 96.50 | 0.50 | - |" in printed
    assert "| w_in | 97.25 | 0.25 | +0.75 +- 0.25 |" in printed
    assert "2 seeds" in printed


def test_lr_leaves_family_reports_each_genome_against_its_default_paired_by_seed(
    capsys, monkeypatch
):
    from benchmarks import lr_leaves

    monkeypatch.setattr(lr_leaves, "FAMILY", {"a": {}, "b": {}})
    scores = {
        ("a", 1.0): {0: 96.0, 1: 97.0},
        ("a", 2.0): {0: 97.0, 1: 97.5},
        ("a", 3.0): {0: 95.0, 1: 97.0},
        ("b", 1.0): {0: 90.0, 1: 90.0},
        ("b", 2.0): {0: 91.0, 1: 93.0},
        ("b", 3.0): {0: 90.0, 1: 90.0},
    }
    lr_leaves.report_family(scores)
    printed = capsys.readouterr().out
    assert "| a | 96.50 | +0.75 +- 0.25 | -0.50 +- 0.50 |" in printed
    assert "| b | 90.00 | +2.00 +- 1.00 | +0.00 +- 0.00 |" in printed
    assert "2 seeds" in printed


def test_lr_no_tables_reports_each_factor_against_the_default_paired_by_seed(capsys):
    from benchmarks import lr_no_tables

    image, text = "digits CNN, tiled genome", "character transformer, tiled genome"
    scores = {
        ("cnn", 1.0): {0: 96.0, 1: 97.0},
        ("cnn", 3.0): {0: 97.0, 1: 97.5},
        ("charlm", 1.0): {0: 2.0, 1: 2.1, 2: 2.2},
        ("charlm", 2.0): {0: 2.3, 1: 2.4, 2: 2.5},
    }
    lr_no_tables.report(scores)
    printed = capsys.readouterr().out
    assert f"| {image} | 1x | 96.500 % | 0.500 | 1.000 | - |" in printed
    assert f"| {image} | 3x | 97.250 % | 0.250 | 0.500 | +0.750 +- 0.250 % (within" in printed
    # three seeds each 0.3 nats worse: no spread in the gap, beyond noise
    assert f"| {text} | 2x | 2.400 nats | 0.058 | 0.200 | +0.300 +- 0.000 nats (beyond" in printed
    assert "digits MLP" not in printed  # p-nets without scores are left out


def test_lr_leaves_budgets_report_each_budget_against_its_default_paired_by_seed(capsys):
    from benchmarks import equal_params as ep
    from benchmarks.lr_leaves import report_budgets

    scores = {
        (1, 1.0): {0: 96.0, 1: 97.0},
        (1, 2.0): {0: 97.0, 1: 97.5},
        (2, 1.0): {0: 97.0, 1: 97.0},
        (2, 2.0): {0: 97.0, 1: 97.0},
    }
    report_budgets(scores, 2.0)
    printed = capsys.readouterr().out
    steps = ep.TASKS["mlp"].steps
    assert f"| {steps} | 96.50 | 97.25 | +0.75 +- 0.25 |" in printed
    assert f"| {2 * steps} | 97.00 | 97.00 | +0.00 +- 0.00 |" in printed
    assert "2 seeds" in printed


def test_compile_time_reports_each_depth_with_gbfunc_over_plain(capsys):
    from benchmarks.compile_time import report

    report({("plain", 2): 40.0, ("gbfunc", 2): 30.0, ("plain", 12): 100.0, ("gbfunc", 12): 110.0})
    printed = capsys.readouterr().out.splitlines()
    assert printed[2:] == ["| 2 | 40.0 | 30.0 | 0.75 |", "| 12 | 100.0 | 110.0 | 1.10 |"]


def test_equal_params_table_gives_a_standard_deviation_only_over_several_seeds():
    """One seed has no spread to show: its score is marked as one seed's, not '± 0.0000'."""
    from benchmarks import equal_params

    def row(arm, scores):
        return [
            {"ratio": "~20x", "family": "gbfunc", "arm": arm, "params": 10, "compression": 20.0,
             "lr": 0.1, "seconds": 1.0, "val_loss": score}
            for score in scores
        ]  # fmt: skip

    summary = equal_params.summarise(row("one", [1.5]) + row("three", [1.0, 1.2, 1.4]), "val_loss")
    text = equal_params.table(summary)
    assert "| 1.5000 (1 seed) |" in text
    assert "| 1.2000 ± 0.2000 |" in text


def test_equal_params_plot_draws_each_genome_and_each_baseline_once(tmp_path, monkeypatch):
    """Two ratios can share a baseline (same parameter count): one point, and no crash."""
    from benchmarks import equal_params

    def row(ratio, family, arm, params, score):
        return {
            "ratio": ratio,
            "family": family,
            "arm": arm,
            "params": params,
            "lr": 0.1,
            "metric": "val_acc",
            "score": score,
            "score_std": 0.01,
        }

    summary = [
        row("dense", "dense", "dense", 60_010, 0.97),
        row("~20x", "gbfunc", "g-nets H=47", 3_106, 0.97),
        row("~20x", "low rank", "U V^T", 3_348, 0.60),
        row("~20x, hashed genome", "gbfunc", equal_params.HASHED, 3_112, 0.98),
        row("~20x, hashed genome", "low rank", "U V^T", 3_348, 0.60),
    ]
    drawn = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.errorbar

    def spy(self, x, y, *args, **kwargs):
        drawn.append((kwargs["label"], list(x)))
        return original(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", spy)
    equal_params.plot(summary, tmp_path / "p.png", "task", "stamp")
    assert sorted(drawn) == [
        ("gbfunc", [3_106]),
        ("gbfunc, hashed genome", [3_112]),
        ("low rank", [3_348]),
    ]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_equal_params_command_names_its_files_by_its_options_and_writes_all_four(
    tmp_path, monkeypatch
):
    """The command line, with training replaced by a committed run's rows."""
    from benchmarks import equal_params

    saved = json.loads((equal_params.RESULTS / "equal_params_cnn.json").read_text())
    calls = []

    def run(task, seeds, steps, distill, families):
        calls.append((task.name, seeds, steps, distill, families))
        return saved["rows"]

    monkeypatch.setattr(equal_params, "run", run)
    argv = ["equal_params", "--task", "cnn", "--seeds", "2", "--out", str(tmp_path)]
    monkeypatch.setattr("sys.argv", [*argv, "--families", "gbfunc", "narrow"])
    equal_params.main()
    task = equal_params.TASKS["cnn"]
    assert calls == [(task.name, 2, task.steps, False, ("gbfunc", "narrow"))]
    stem = tmp_path / "equal_params_cnn_2_seeds_gbfunc_narrow"
    for suffix in (".md", ".json", ".csv", ".png"):
        assert stem.with_suffix(suffix).stat().st_size > 0, suffix
    text = stem.with_suffix(".md").read_text()
    assert "- 2 seed(s), " in text
    assert "## Margins (positive: gbfunc is better)" in text


def test_equal_params_on_a_loss_metric_keeps_the_lowest_and_signs_margins_for_gbfunc():
    from benchmarks.equal_params import findings, summarise

    def row(family, lr, loss, params):
        ratio = "dense" if family == "dense" else "~20x"
        return {"ratio": ratio, "family": family, "arm": family, "params": params,
                "compression": 1.0, "lr": lr, "seed": 0, "val_loss": loss, "val_acc": 0.5,
                "seconds": 1.0}  # fmt: skip

    rows = [row("dense", 1e-2, 1.25, 440_000), row("gbfunc", 1e-2, 1.90, 20_000)]
    rows += [row("gbfunc", 2e-2, 1.70, 20_000), row("narrow", 1e-2, 1.75, 21_000)]
    summary = summarise(rows, "val_loss")
    ours = next(s for s in summary if s["family"] == "gbfunc")
    assert ours["lr"] == 2e-2
    assert ours["score"] == pytest.approx(1.70)
    assert "+0.050 nats vs narrow (21,000 params)" in findings(summary)


def test_distillation_is_half_the_cross_entropy_when_the_student_matches_its_teacher():
    import torch

    from benchmarks.equal_params import distill

    logits = torch.randn(4, 7, 10)
    ce = torch.tensor(2.0)
    assert float(distill(ce, logits, logits.clone())) == pytest.approx(1.0, abs=1e-6)
    assert float(distill(ce, logits, torch.zeros_like(logits))) > 1.0


def test_low_rank_baseline_holds_its_budget_and_the_dense_scale():
    import torch
    from torch import nn

    from examples.baselines import low_rank, tree_count

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 10))
    tree, to_params = low_rank(model, ["0.weight", "2.weight"], 2000, seed=0)
    factors = tree_count(tree) - 210  # the biases stay free
    assert 0.8 * 2000 <= factors <= 1.2 * 2000
    params = to_params(tree)
    assert params["0.weight"].shape == (200, 64)
    assert params["2.weight"].shape == (10, 200)
    std = float(params["0.weight"].detach().std())
    assert std == pytest.approx(float(model[0].weight.detach().std()), rel=0.3)


def test_hashed_baseline_shares_its_budget_of_values_by_a_fixed_hash():
    import torch
    from torch import nn

    from examples.baselines import hashed, tree_count

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 200), nn.ReLU(), nn.Linear(200, 10))
    tree, to_params = hashed(model, ["0.weight", "2.weight"], 500, seed=1)
    assert tree_count(tree) == 500 + 200 + 10  # the values, and the free biases
    assert tree["0.weight.pool"].numel() + tree["2.weight.pool"].numel() == 500
    params = to_params(tree)
    assert params["0.weight"].shape == (200, 64)
    values = set(tree["0.weight.pool"].abs().tolist())
    assert set(params["0.weight"].abs().unique().tolist()) <= values
    again, _ = hashed(model, ["0.weight", "2.weight"], 500, seed=1)
    torch.testing.assert_close(to_params(again)["2.weight"], params["2.weight"])  # fixed hash
    params["0.weight"].sum().backward()
    assert tree["0.weight.pool"].grad is not None


def test_recipes_trains_one_genome_under_the_protocol(capsys):
    from benchmarks import recipes

    options = {"tile": "full", "hidden": 3, "overrides": {"1.weight": {"col_labels": [8, 8]}}}
    plan = json.dumps(options)
    recipes.main(["--task", "mlp", "--plan", plan, "--lrs", "0.1", "0.3", "--steps", "3"])
    out = capsys.readouterr().out
    assert "trainable parameters" in out
    assert out.count("val acc") == 2


def test_recipe_gains_scale_rows_and_columns_and_are_counted():
    import torch
    from torch import nn

    from benchmarks.equal_params import Arm
    from benchmarks.recipes import with_gains

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 5))
    plan = gb.plan(model, tile="full", hidden=2)
    gparams = gb.init(plan, seed=0)
    arm = Arm("gbfunc", "g", model, gparams, lambda t: gb.apply(t, plan), 100, {"free": 0.1})
    scaled = with_gains(arm, plan)
    assert scaled.params == 100 + (4 + 3) + (5 + 4)
    assert scaled.lr_scales["gains"] == 0.1
    plain = arm.to_params(arm.tree)
    for name, w in scaled.to_params(scaled.tree).items():  # gains start at 1
        torch.testing.assert_close(w, plain[name])
    with torch.no_grad():
        scaled.tree["gains"]["0.weight"]["rows"][1] = 2.0
        scaled.tree["gains"]["0.weight"]["cols"][2] = 3.0
    w = scaled.to_params(scaled.tree)["0.weight"]
    torch.testing.assert_close(w[1, 2], 6 * plain["0.weight"][1, 2])
    torch.testing.assert_close(w[0, 1], plain["0.weight"][0, 1])
    w.sum().backward()
    assert scaled.tree["gains"]["2.weight"]["cols"].grad is None  # not used by 0.weight
    assert scaled.tree["gains"]["0.weight"]["rows"].grad is not None


def test_bench_fsdp_peak_counts_resident_tensors_and_the_steps_high_water_mark():
    import torch

    from benchmarks.bench_fsdp import _peak_bytes

    resident = torch.zeros(1_000_000)  # 4 MB alive throughout

    def step() -> None:
        a = torch.ones(2_500_000)  # 10 MB
        b = a * 2  # 10 MB more: the peak, 20 MB above the start
        del a, b
        torch.ones(250_000)  # 1 MB after both were freed

    peak = _peak_bytes(step, [resident, resident[:10]])  # a view counts once
    assert 24_000_000 <= peak < 24_500_000


def test_bench_unit_split_compares_gbfuncs_rule_with_the_two_it_chooses_between():
    """gbfunc's rule vectorises either every unit or whole registers only, so the benchmark's
    two other columns are the alternatives it picks from."""
    from benchmarks.bench_unit_split import RULES, every_unit, whole_registers

    assert list(RULES.values())[:2] == [every_unit, whole_registers]
    seen = set()
    for hidden in range(1, 41):
        row_terms = torch.zeros(1, 1, hidden)
        choice = RULES["gbfunc's rule"](row_terms)
        assert choice in (every_unit(row_terms), whole_registers(row_terms))
        seen.add(choice == every_unit(row_terms) != whole_registers(row_terms))
    assert seen == {True, False}  # both alternatives occur


def test_bench_unit_split_switches_the_c_loop_on_and_off_where_gbfunc_would_run_it():
    """Its stand-ins for `sums_usable` call the library's loop helpers by name: a rename there
    broke the benchmark (`_relu_loops._function`, gone since bad0050) without a test noticing."""
    from benchmarks.bench_unit_split import _always, _never

    for units in (4, 32):
        assert _always(units, torch.float32, "cpu") == sums_usable(units, torch.float32, "cpu")
        assert not _never(units, torch.float32, "cpu")


def test_bench_step_ratios_are_per_round_so_that_the_machines_drift_cancels():
    """A machine twice as fast in later rounds moves the medians of both steps, not the ratio
    of each round, which times both within about a second."""
    from benchmarks.bench_step import Timing

    plain = [4.0, 4.0, 2.0, 2.0, 2.0]
    gbfunc = [6.0, 6.0, 3.0, 3.0, 3.6]
    timing = Timing.of(gbfunc, plain)
    assert timing.ms == 3.6  # the median step
    assert timing.ratio == 1.5  # rounds' ratios 1.5, 1.5, 1.5, 1.5, 1.8
    assert timing.quartiles == "1.50-1.65"
    assert Timing.of([6.0, 6.0, 6.0, 3.0, 3.0], plain).ratio == 1.5  # medians: 6.0 / 2.0 = 3.0


def test_bench_step_divides_each_variant_by_the_plain_step_of_its_mode():
    # "... eager uncompiled" holds "compiled": it was divided by the plain compiled step.
    from benchmarks.bench_step import baseline

    assert baseline("row g-nets eager uncompiled") == "plain eager"
    assert baseline("row g-nets eager") == "plain eager"
    assert baseline("row g-nets compiled") == "plain compiled"
    assert baseline("plain compiled") == "plain compiled"


def test_step_budget_takes_the_steps_excess_over_its_target_off_the_generation():
    from benchmarks.step_budget import generation_budget, sgemm_gflops

    # A 6 ms step on a 4 ms plain step (1.5x), its generation 2.5 ms: 1.25x needs 1 ms less.
    assert generation_budget(2.5, 1.5, 1.25, 4.0) == pytest.approx(1.5)
    assert generation_budget(2.5, 1.5, 1.5, 4.0) == pytest.approx(2.5)  # on target already
    assert generation_budget(0.5, 2.0, 1.0, 4.0) < 0  # the rest of the step alone is over
    assert sgemm_gflops(2 * 1024**3 / 1e9 * 1e3 / 100) == pytest.approx(100)  # 100 GFLOP/s


def _budget_generation():
    """A small plan, its g-nets, weight gradients and step_budget's (eager, compiled) passes."""
    from torch import nn

    from benchmarks.step_budget import generation_steps

    torch.manual_seed(0)
    plan = gb.plan(nn.Sequential(nn.Linear(20, 12), nn.ReLU(), nn.Linear(12, 3)), tile=(8, 8))
    gparams = gb.init(plan)
    cotangents = {p.name: torch.randn(p.shape) for p in plan.generated}
    return plan, gparams, cotangents, generation_steps(plan, gparams, cotangents)


def test_step_budget_generation_pass_leaves_the_gradients_of_its_linear_loss():
    plan, gparams, cotangents, (eager, _) = _budget_generation()
    eager()
    eager()  # gradients are reset between calls, not accumulated
    fresh = gb.init(plan)
    params = gb.apply(fresh, plan)
    sum((params[n] * g).sum() for n, g in cotangents.items()).backward()
    for key, leaves in fresh["stacks"].items():
        for name, leaf in leaves.items():
            torch.testing.assert_close(gparams["stacks"][key][name].grad, leaf.grad)


@pytest.mark.slow
def test_step_budget_compiled_generation_returns_the_weights_with_their_gradients():
    """The compiled pass computes the weights, as a step does: a gradient alone would let
    inductor drop the forward's output (a third of torchGB's generation)."""
    plan, gparams, cotangents, (eager, compiled) = _budget_generation()
    eager()
    grads, weights = compiled()
    want = gb.apply(gparams, plan)
    for name in cotangents:
        torch.testing.assert_close(weights[name], want[name])
    for key, leaves in gparams["stacks"].items():
        for name, leaf in leaves.items():
            torch.testing.assert_close(grads["stacks"][key][name], leaf.grad)


def test_tile_choice_forces_the_squarest_tile_and_restores_the_search():
    from benchmarks import tile_choice
    from benchmarks.bench_step import mlp

    model = mlp()
    squarest = tile_choice.planned(model, "squarest", {"compression": 10})
    searched = tile_choice.planned(model, "searched", {"compression": 10})
    assert tile_choice.tiles(squarest) == "74x74, 10x74"
    assert tile_choice.tiles(searched) != tile_choice.tiles(squarest)
    assert tile_choice.tiles(
        gb.plan(model, compression=10, compression_of="generated")
    ) == tile_choice.tiles(searched)
    with pytest.raises(RuntimeError), tile_choice.squarest_tiles():
        raise RuntimeError  # restored however the block ends
    assert tile_choice.tiles(
        gb.plan(model, compression=10, compression_of="generated")
    ) == tile_choice.tiles(searched)


def test_tile_choice_scores_each_choice_at_its_best_mean_rate(monkeypatch, capsys):
    from benchmarks import equal_params, tile_choice

    accuracy = {(0.01, 0): 0.5, (0.01, 1): 0.9, (0.03, 0): 0.8, (0.03, 1): 0.7}  # means .7, .75
    monkeypatch.setattr(
        equal_params, "train", lambda arm, lr, data, steps, batch, seed: (1.0, accuracy[lr, seed])
    )
    monkeypatch.setattr(tile_choice, "QUALITY", (("mlp", {"compression": 20}, (0.01, 0.03), 2),))
    tile_choice.quality()
    rows = [line for line in capsys.readouterr().out.splitlines() if "| accuracy" in line]
    assert [row.split(" | ")[2] for row in rows] == ["squarest", "searched"]
    for row in rows:
        assert "| 0.03 of (0.01, 0.03) | accuracy 0.7500 ± 0.0707 (0.8000, 0.7000)" in row


def test_tile_choice_baselines_train_a_narrow_and_a_low_rank_arm_at_the_plans_count(
    monkeypatch, capsys
):
    from benchmarks import equal_params, tile_choice

    trained = []

    def train(arm, lr, data, steps, batch, seed):
        trained.append((arm.family, lr, seed, arm.tree))  # kept alive: ids stay distinct
        return 1.0, {"narrow": 0.6, "low rank": 0.4}[arm.family] + lr

    monkeypatch.setattr(equal_params, "train", train)
    monkeypatch.setattr(tile_choice, "QUALITY", (("mlp", {"compression": 20}, (0.1,), 2),))
    tile_choice.baselines()
    out = capsys.readouterr().out
    assert "| narrow | width " in out
    assert "| low rank | U V^T |" in out
    lrs = equal_params.TASKS["mlp"].lrs
    assert f"{lrs['narrow'][-1]} of {lrs['narrow']} | accuracy" in out  # the best mean's rate
    assert len(trained) == 2 * 2 * len(lrs["narrow"])  # families x seeds x rates
    assert len({id(t[-1]) for t in trained}) == len(trained)  # a fresh arm for every run
    count = gb.report(gb.plan(equal_params.TASKS["mlp"].build(None), compression=20))
    narrow = next(line for line in out.splitlines() if "| narrow |" in line)
    assert abs(int(narrow.split(" | ")[3].replace(",", "")) / count.stored_params - 1) < 0.1


def _stand_in_wheel(folder: Path) -> Path:
    """A pure-Python wheel of one empty package, `gbfunc_wheel_probe`, built without pip."""
    import base64
    import hashlib
    import zipfile

    info = "gbfunc_wheel_probe-0.0.0.dist-info"
    files = {
        "gbfunc_wheel_probe/__init__.py": "",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gbfunc-wheel-probe\nVersion: 0.0.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    digest = lambda text: base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest())
    record = "".join(
        f"{name},sha256={digest(text).decode().rstrip('=')},{len(text.encode())}\n"
        for name, text in files.items()
    )
    folder.mkdir()
    wheel = folder / "gbfunc_wheel_probe-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in {**files, f"{info}/RECORD": record + f"{info}/RECORD,,\n"}.items():
            archive.writestr(name, text)
    return wheel


def test_gpu_step_waits_for_processes_to_end_and_takes_a_zombie_for_ended():
    """Its timed rounds wait for the tests gpu_check.sh runs beside it; a child that ended but
    was not yet reaped (a zombie, as bash's children can be) has ended."""
    import threading

    from benchmarks.gpu_step import wait_for

    child = subprocess.Popen(["sleep", "0.5"])
    start = time.perf_counter()
    waiter = threading.Thread(target=wait_for, args=([child.pid],), kwargs={"poll_s": 0.05})
    waiter.start()
    waiter.join(timeout=20)
    assert not waiter.is_alive()  # the zombie did not hold it
    assert time.perf_counter() - start >= 0.4
    assert child.poll() == 0
    wait_for([child.pid])  # reaped: gone at once


@pytest.mark.slow
def test_the_gpu_script_runs_every_part_on_cpu_in_a_dry_run(tmp_path):
    """`gpu_check.sh --dry-run`: gpu_step's eager steps, the compile tests and the rest of the
    kernel tests it names (both beside gpu_step's compiled steps, which wait for them before
    timing), bench_generation, the peers (their wheels installed from a folder, here a
    stand-in's) and bench_overhead all run (tiny, on CPU), in that order, and write their
    files, so a lent GPU's minutes go to measuring."""
    root = Path(__file__).resolve().parents[1]
    environment = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environment["GBFUNC_PEER_WHEELS"] = str(_stand_in_wheel(tmp_path / "wheels").parent)
    results = tmp_path / "results"
    done = subprocess.run(
        ["bash", str(root / "benchmarks" / "gpu_check.sh"), "--dry-run", str(results)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (
        "gpu_step eager exit 0, compile tests exit 0, kernel tests exit 0, gpu_step compiled "
        "exit 0, bench_generation exit 0, peers exit 0, bench_overhead exit 0"
    ) in done.stdout
    parts = [line[3:5] for line in done.stdout.splitlines() if line.startswith("== ")]
    assert parts == ["a.", "b.", "c.", "d.", "e.", "f.", "g."]
    summary = (results / "gpu_tests.log").read_text()
    assert "compile tests: exit 0: " in summary
    assert "the rest of the kernel tests: exit 0: " in summary
    assert " passed" in (results / "gpu_tests_compile.log").read_text()
    assert " passed" in (results / "gpu_tests_kernels.log").read_text()
    for mode, other in (("eager", "compiled"), ("compiled", "eager")):
        steps = (results / ("gpu_step_eager.md" if mode == "eager" else "gpu_step.md")).read_text()
        assert f"## GPT-2 small's shapes (2x32, seq 16), {mode}" in steps
        assert f"gbfunc 2x (2x gen.) {mode}" in steps
        assert f" {other}" not in steps.split("## GPT-2")[1]
    assert (results / "bench_generation_gpu.md").exists()
    log = (results / "gpu_check.log").read_text()
    assert "installed: gbfunc_wheel_probe-0.0.0.dist-info" in log
    table = (results / "peers_gpu.md").read_text()
    assert "- rounds: 1 x 1 steps" in table
    for row in ("| plain MLP |", "| gbfunc, torchGB genome", "| hyper-nn", "| hypnettorch"):
        assert row in table
    rows = json.loads((results / "peers_gpu.json").read_text())["rows"]
    assert rows[1]["compiled_ms"] > 0
    overhead = (results / "bench_overhead_gpu.md").read_text()
    assert "| triton, no launch | forward |" in overhead
    assert "| captured call (torch.compile, fullgraph) |" in overhead


def test_the_gpu_scripts_time_limits_fit_ten_minutes_of_device_time():
    """The limits of the parts that run one after another, without the dry run's, sum to at
    most 560 s: the installs and start fit in the rest of the 600 s a lent GPU gives one
    command; the two run beside gpu_step end within its limit."""
    import re

    script = (Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh").read_text()
    gpu = script.split("dry=0")[0]
    limits = {name: int(s) for name, s in re.findall(r"^(T_[A-Z_]+)=(\d+)", gpu, re.M)}
    assert set(limits) == {
        "T_STEP_EAGER", "T_COMPILE", "T_KERNELS", "T_STEP", "T_GENERATION", "T_WHEELS",
        "T_PEERS", "T_OVERHEAD",
    }  # fmt: skip
    beside = ("T_COMPILE", "T_KERNELS")
    assert sum(v for name, v in limits.items() if name not in beside) <= 560
    assert all(limits[name] <= limits["T_STEP"] for name in beside)
    for name in limits:
        assert f"${name} " in script  # each is used


def test_the_gpu_script_refuses_parts_it_does_not_have(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.sh"
    done = subprocess.run(
        ["bash", str(script), "--dry-run", "--parts", "ah", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--parts takes letters a to g (the parts), not 'ah'" in done.stderr
    assert not (tmp_path / "gpu_check.log").exists()  # refused before anything ran


def test_lr_sensitivity_is_what_the_committed_sweeps_say(tmp_path):
    """The table the docs quote is recomputed from the sweeps' runs, line for line."""
    from benchmarks import lr_sensitivity

    lr_sensitivity.main(["--out", str(tmp_path / "lr.md")])
    rows = [line for line in (tmp_path / "lr.md").read_text().splitlines() if line.startswith("|")]
    committed = (lr_sensitivity.RESULTS / "lr_sensitivity.md").read_text().splitlines()
    assert len(rows) == 14
    assert rows == [line for line in committed if line.startswith("|")]


def test_lr_rule_report_sets_the_default_beside_the_best_swept_rate(capsys):
    """Accuracy: highest wins; loss: lowest wins; split rules are listed but never 'swept'."""
    from benchmarks import lr_rule

    def rows(task, scores):
        return [
            {"part": "p", "task": task, "compression": 5.0, "rule": rule, "seed": seed,
             "val_acc": value, "val_loss": value}
            for rule, values in scores.items()
            for seed, value in enumerate(values)
        ]  # fmt: skip

    lr_rule.report(
        rows("mlp", {"default": [0.90, 0.92], 0.1: [0.95, 0.93], 0.3: [0.99, 0.10]})
        + rows("charlm", {"default": [1.60, 1.62], 0.02: [1.59, 1.60], 0.04: [1.70, 1.50]})
        + [{**r, "rule": [0.1, 0.03]} for r in rows("mlp", {"x": [0.99]})]
    )
    summary = capsys.readouterr().out.split("\n\n")[0]
    assert "| p | mlp | 5.0x | 91 +- 1 | 0.1 | 94 +- 1 | 3 +- 2 | no |" in summary
    charlm = "| p | charlm | 5.0x | 1.61 +- 0.01 | 0.02 | 1.595 +- 0.005 | 0.015 +- 0.005 | yes |"
    assert charlm in summary


def test_lr_rule_rerun_replaces_the_runs_it_repeats_in_place():
    from benchmarks import lr_rule

    def row(rule, seed, acc, compression=5.0):
        return {"part": "main", "task": "mlp", "compression": compression, "rule": rule,
                "seed": seed, "val_acc": acc}  # fmt: skip

    rows = [row("default", 0, 0.1), row(0.3, 0, 0.2), row("default", 1, 0.3), row([1, 2], 0, 4)]
    fresh = [row("default", 1, 0.9), row("default", 0, 0.8), row("default", 0, 0.7, 9.0)]
    assert lr_rule.replaced(rows, fresh) == [
        row("default", 0, 0.8), row(0.3, 0, 0.2), row("default", 1, 0.9), row([1, 2], 0, 4),
        row("default", 0, 0.7, 9.0),
    ]  # fmt: skip


def test_lr_rule_without_tables_runs_relu_genomes_without_tables_at_each_rule():
    """The part sweeps ReLU genomes that have no hashed tables (every other ReLU genome of
    lr_rule has them), each at the default and the swept rates, over the part's seeds."""
    from benchmarks import lr_rule

    jobs = lr_rule.jobs(["without-tables"])
    assert {part for part, *_ in jobs} == {"without-tables"}
    genomes = {(task, json.dumps(options, sort_keys=True)) for _, task, options, _, _ in jobs}
    assert len(genomes) == 5  # two CNN genomes, two MLP genomes, the transformer's
    for _, _, options, _, _ in jobs:
        assert not options.get("hashed")
        assert options.get("activation", "relu") == "relu"
    digits = [(task, rule, seed) for _, task, _, rule, seed in jobs if task != "charlm"]
    assert len(digits) == 4 * (1 + len(lr_rule.SWEPT["without tables"])) * 10
    text = {rule for _, task, _, rule, _ in jobs if task == "charlm"}
    assert text == {"default", *lr_rule.TEXT_WITHOUT_TABLES_SWEPT}


def test_bench_memory_init_sets_each_inits_peak_beside_its_largest_stack(monkeypatch, capsys):
    from torch import nn

    from benchmarks import bench_memory

    layer = {"layer": (lambda: nn.Linear(512, 512), {"tile": (16, 16), "hidden": 8})}
    monkeypatch.setattr(bench_memory, "init_workloads", lambda: layer)
    bench_memory.run_init()
    label, *cells = capsys.readouterr().out.strip().splitlines()[-1].split()
    largest, held, peak, ratio, meta = map(float, cells)
    assert (label, largest, meta) == ("layer", 1.0, 0.0)  # 512 x 512 in float32; nothing
    assert held < peak < 3 * largest
    assert ratio == pytest.approx(peak / largest, abs=0.01)


def test_transfer_reports_the_default_against_the_best_scale_and_the_narrow_model():
    from benchmarks import transfer

    rows = [
        {
            "task": "email",
            "arm": "gbfunc",
            "value": v,
            "seed": s,
            "params": 100,
            "val_loss": loss + 0.01 * s,
            "val_acc": 0.5,
            "corpus": "10 characters, sha1 abc",
        }
        for v, loss in ((1 / 3, 1.9), (1.0, 1.8), (3.0, 1.7))
        for s in range(3)
    ] + [
        {
            "task": "email",
            "arm": "narrow",
            "value": lr,
            "seed": s,
            "params": 110,
            "val_loss": loss,
            "val_acc": 0.5,
        }
        for lr, loss in ((0.03, 1.85), (0.06, 1.75))
        for s in range(3)
    ]
    (default,) = [r for r in transfer.summary(rows, "email") if r["value"] == 1.0]
    assert default["mean"] == pytest.approx(1.81)
    assert default["spread"] == pytest.approx(0.02)
    assert default["se"] == pytest.approx(0.01 / 3**0.5)
    text = transfer.report(rows)
    # Paired over the seeds both ran: scale 3 ahead by 0.1 at every seed (s.e. 0), 1/3 behind.
    assert "default - scale 3 = +0.1000 +- 0.0000 (beyond noise)" in text
    assert "default - scale 0.333 = -0.1000 +- 0.0000 (beyond noise)" in text
    assert "the best scale, paired with the default: 3 (default - best: +0.1000" in text
    assert "the narrow model at its best rate, 0.06: 1.75" in text
    # Paired by seed too: 0.05, 0.06 and 0.07 behind the narrow model, s.e. 0.01 / sqrt(3).
    assert (
        "gbfunc's default - narrow, paired over the 3 seeds both ran: +0.0600 +- 0.0058 "
        "(beyond noise)" in text
    )
    assert "## digits-rows\n\nNot run." in text
    assert "- corpus: 10 characters, sha1 abc (9 rows); not recorded (6 rows)" in text
    assert len(transfer.jobs("email")) == 3 * (5 + 4)  # five scales, four narrow rates
    # a row of another recorded corpus is not paired (package-docs changed with the README)
    other = [dict(r, corpus="10 characters, sha1 def") for r in rows if r["value"] == 3.0]
    moved = [r for r in rows if r["value"] != 3.0] + other
    assert transfer.paired_gap(moved, "email", 1.0, 3.0).n == 0
    assert transfer.paired_gap(moved, "email", 1.0, 0.06, "narrow").n == 3


def test_transfers_prose_corpus_leaves_out_gbfunc_s_own_readme():
    # It held this repository's README (gbfunc's description, once per copy that `sys.path`
    # found): every README edit changed the corpus, and seeds run before and after an edit
    # did not reproduce.
    from benchmarks import transfer

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    text = transfer.package_docs_text()
    assert readme.splitlines()[2] not in text
    assert text == transfer.package_docs_text()


def test_bench_paths_forces_each_neighbour_of_a_variant_and_checks_it_equals_the_variant(
    monkeypatch,
):
    """The variants section on tiny g-nets, traced op by op (as tests/test_paths.py has it)
    instead of compiled: each forced neighbour runs, alone, and equals the chosen variant;
    the library's `forward_form` and `reads_units_major_columns` are restored after."""
    from torch import nn

    from benchmarks.bench_paths import VariantCase, compare_variants
    from gbfunc.cpu._relu_loops import layer_usable
    from gbfunc.generate import _traced_forms

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    saved = _traced_forms.forward_form, _traced_forms.reads_units_major_columns
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    tanh = {"hidden": 5, "activation": "tanh"}
    many_units = {"tile": (4, 4), "outputs": 2, **tanh, "hidden": 40}
    cases = [
        VariantCase("by-columns", "wide", {"tile": (4, 16), **tanh}, ("by-units",)),
        VariantCase("by-units", "narrow", {"tile": (4, 2), **tanh}, ("by-columns",)),
        VariantCase("unrolled", "few", {"tile": (4, 4), "outputs": 2, **tanh}, ("units-major",)),
        VariantCase("units-major", "many units", many_units, ("unrolled",)),
    ]
    if layer_usable(8, 2, torch.float32, "cpu"):  # the C loops built
        relu = {"tile": (4, 4), "outputs": 2, "hidden": 8}
        cases.append(VariantCase("c-loops", "relu", relu, ("unrolled", "units-major")))
    for case in cases:
        timings, differences = compare_variants(case, model, 1, 1, compiler=lambda fn: fn)
        assert list(timings) == [case.variant, *case.neighbours]
        assert timings[case.variant].ratios == [1.0]
        assert differences[case.variant] == (0.0, 0.0)
        assert all(max(d) <= 1e-4 for d in differences.values())
    assert (_traced_forms.forward_form, _traced_forms.reads_units_major_columns) == saved


def test_stability_draws_the_tables_from_their_own_seed_and_the_rest_from_the_genomes():
    from benchmarks.stability import _genome_of

    plan = gb.plan(torch.nn.Linear(16, 16), tile=(8, 8), share=True, hidden=8, hashed=6)
    mixed, of_1, of_0 = _genome_of(plan, 1, 0), gb.init(plan, seed=1), gb.init(plan, seed=0)
    (key,) = mixed["stacks"]
    for name, leaf in mixed["stacks"][key].items():
        source = of_0 if name == gb.optim.TABLE_LEAF else of_1
        assert torch.equal(leaf, source["stacks"][key][name]), name
    table = gb.optim.TABLE_LEAF
    assert not torch.equal(of_1["stacks"][key][table], of_0["stacks"][key][table])
    assert not torch.equal(of_1["stacks"][key]["w_in"], of_0["stacks"][key]["w_in"])


def test_bench_allocator_runs_each_process_under_glibcs_defaults_or_both_thresholds(
    monkeypatch,
):
    """A stray `MALLOC_*` variable of the caller's would measure neither setting; one threshold
    alone turns glibc's adaptation off, so the fixed run sets both."""
    from benchmarks import bench_allocator

    envs = []

    def run(command, env, **_):
        envs.append(env)
        assert command[1:4] == ["-m", "benchmarks.bench_allocator", "--child"]
        return subprocess.CompletedProcess(command, 0, stdout='noise\n{"ratio": 2.0}\n')

    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    monkeypatch.setattr(bench_allocator.subprocess, "run", run)
    for fixed in (False, True):
        assert bench_allocator.in_fresh_process("g", fixed, 1, 1, 2) == {"ratio": 2.0}
    default, fixed = ({k: v for k, v in e.items() if k.startswith("MALLOC_")} for e in envs)
    assert default == {}
    assert fixed == bench_allocator.FIXED
    assert set(fixed) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}


def test_bench_allocator_charges_page_faults_to_the_step_that_made_them(monkeypatch):
    from benchmarks import bench_allocator

    def touching() -> None:  # 64 MiB: above glibc's largest mmap threshold, mapped every call
        torch.ones(16 << 20)

    monkeypatch.setattr(bench_allocator, "gb_steps", lambda *_: (touching, None))
    monkeypatch.setattr(bench_allocator, "dense_steps", lambda *_: (lambda: None, None))
    result = bench_allocator.measure(bench_allocator.QUICK_GENOME, rounds=2, inner=2)
    assert result["gbfunc faults"] >= 16  # at least one per 2 MiB huge page
    assert result["plain faults"] < result["gbfunc faults"] / 4
    assert result["ratio"] > 1
