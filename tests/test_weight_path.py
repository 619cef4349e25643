"""benchmarks/weight_path.py: the way of one eager `gb.apply` call through gbfunc's modules,
read back against what the script reports, and issue 55's target where it is met: through
the `torch` path (eager, and under `torch.func.grad`) a weight crosses at most 6 modules.
The other ways' numbers are the script's to report, not asserted."""

from itertools import pairwise

import pytest

from benchmarks.weight_path import (
    GENOMES,
    LEAF_UTILITIES,
    ROOT,
    VIEWS,
    Entry,
    Way,
    import_graph,
    measure,
    module_name,
    report,
)


def test_the_eager_torch_path_way_is_what_the_report_says():
    row = measure("tile 16x16", "eager")
    assert "stack s0_16x16: torch" in row["route"]
    everything = row["all"]
    steps = everything["steps"]
    assert steps[0]["module"] == "gbfunc._apply"
    assert steps[0]["caller"] is None
    assert all(step["caller"] is not None for step in steps[1:])  # one entry from outside
    modules = set(everything["entries_per_module"])
    assert everything["modules"] == len(modules) >= 3
    assert {step["module"] for step in steps} == modules
    assert everything["entries"] == len(steps) == sum(everything["entries_per_module"].values())
    assert everything["chain"].startswith("_apply(")
    graph = import_graph()
    for view in VIEWS:
        kinds = [step["kind"] for step in row[view]["steps"]]
        assert row[view]["climbs"] == kinds.count("climb")
        assert row[view]["sideways"] == kinds.count("sideways")
        assert ("↑" in row[view]["chain"]) == (row[view]["climbs"] > 0)  # repeats are folded
        for step in row[view]["steps"]:
            if step["kind"] == "climb":  # the callee imports the caller, edge by edge
                imports = step["imports"]
                assert imports[0] == step["module"]
                assert imports[-1] == step["caller"]
                assert all(b in graph[a] for a, b in pairwise(imports))
    left = row["excluding_leaf_utilities"]
    assert not set(left["entries_per_module"]) & LEAF_UTILITIES.keys()
    assert set(left["entries_per_module"]) <= modules
    text = report([row])
    assert f"| eager | {row['paths']} | {everything['modules']} | {everything['climbs']} |" in text


@pytest.mark.parametrize("scenario", ["eager", "grad"])
@pytest.mark.parametrize("genome", list(GENOMES))
def test_a_weight_through_the_torch_path_crosses_at_most_six_modules(genome, scenario):
    """apply, check, dispatch, the path, the spec and the layout: nothing else, no climb."""
    row = measure(genome, scenario)
    assert "torch (eager-recompute)" in row["paths"]
    left = row["excluding_leaf_utilities"]
    assert left["modules"] <= 6, left["chain"]
    assert left["climbs"] == 0, left["chain"]


def test_leaving_modules_out_gives_their_calls_to_the_frame_below():
    way = Way(
        (
            Entry("gbfunc._apply", "apply", None),
            Entry("gbfunc._plan", "num_tiles", 0),
            Entry("gbfunc._apply", "helper", 1),  # called back from the plan: folds into apply
            Entry("gbfunc._spec", "tiles", 1),
        )
    )
    left = way.without({"gbfunc._plan"})
    assert left.entries == (
        Entry("gbfunc._apply", "apply", None),
        Entry("gbfunc._spec", "tiles", 0),
    )


def test_modules_are_named_as_installed():
    assert module_name(str(ROOT / "gbfunc" / "cpu" / "_relu_rows.py")) == "gbfunc.cpu._relu_rows"
    assert module_name(str(ROOT / "gbfunc" / "generate" / "__init__.py")) == "gbfunc.generate"
    assert module_name(str(ROOT / "kernels" / "_checks.py")) == "gbfunc.kernels._checks"
    assert module_name("/nowhere/gbfunc/_plan.py") is None
