"""benchmarks/weight_path.py: the way of one eager `gb.apply` call through gbfunc's modules,
read back against what the script reports, and issue 55's target: through the `torch` path
(eager, and under `torch.func.grad`) a weight crosses at most 6 modules, and through every
path at most 6 units, where each path's native package (and a runner layer that paths share,
the compile cache) counts as its path."""

from itertools import pairwise

import pytest

from benchmarks.weight_path import (
    GENOMES,
    LEAF_UTILITIES,
    ROOT,
    SCENARIOS,
    VIEWS,
    Entry,
    Way,
    import_graph,
    measure,
    module_name,
    report,
    unit_graph,
    unit_of,
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
    """apply, check, dispatch, the path (its runner and the tile MLP's bodies, one unit), the
    spec and the layout: nothing else, no climb."""
    row = measure(genome, scenario)
    assert "torch (eager-recompute)" in row["paths"]
    units, left = row["paths_as_units"], row["excluding_leaf_utilities"]
    assert units["modules"] <= 6, units["chain"]
    assert left["modules"] <= 7, left["chain"]  # the path's two modules counted apart
    assert units["climbs"] == left["climbs"] == 0, left["chain"]


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


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_through_every_path_a_weight_crosses_at_most_six_units(scenario):
    """The same bound with each path's native package counted as its path, hashed tables too:
    the `torch` and `cpu-loops` paths, and the `graph` path (`compile=True` with the loops
    off), whose compile cache calls the compiled function back within the path."""
    row = measure("hashed genome, tile full, 20x", scenario)
    if scenario == "compile, loops off":
        assert "graph (" in row["paths"]
    units = row["paths_as_units"]
    assert units["modules"] <= 6, units["chain"]
    assert units["climbs"] == 0, units["chain"]
    assert not any(module.startswith("gbfunc.cpu.") for module in units["entries_per_module"])


def test_a_path_and_its_native_package_are_one_unit():
    assert unit_of("gbfunc.generate.cpu_loops") == unit_of("gbfunc.cpu._relu_rows")
    assert unit_of("gbfunc.generate.triton") == unit_of("gbfunc.kernels.generate._op")
    assert unit_of("gbfunc.cpuish") == "gbfunc.cpuish"
    assert unit_of("gbfunc.generate.torch_ops") == unit_of("gbfunc.generate._bodies")
    assert unit_of("gbfunc.generate.compiled_mlp") == "gbfunc.generate.compiled_mlp"
    assert unit_of("gbfunc.generate._compiled") is None  # shared: the entering path's layer
    way = Way(
        (
            Entry("gbfunc._dispatch", "route", None),
            Entry("gbfunc.generate.cpu_loops", "stack_weights", 0),
            Entry("gbfunc.cpu._relu_rows", "generate", 1),  # inside the path: no entry
            Entry("gbfunc._spec", "code_tables", 2),  # called from the path
            Entry("gbfunc.cpu._build", "runnable", 2),
        )
    )
    assert way.relabelled(unit_of).entries == (
        Entry("gbfunc._dispatch", "route", None),
        Entry("path cpu-loops", "stack_weights", 0),
        Entry("gbfunc._spec", "code_tables", 1),
    )
    called_back = Way(
        (
            Entry("gbfunc.generate.graph", "generate", None),
            Entry("gbfunc.generate._compiled", "call", 0),
            Entry("gbfunc.generate.graph", "_generated", 1),  # the compiled function, its path's
            Entry("gbfunc._spec", "tile_hash_op", 2),
        )
    )
    assert called_back.relabelled(unit_of).entries == (
        Entry("gbfunc.generate.graph", "generate", None),
        Entry("gbfunc._spec", "tile_hash_op", 0),
    )
    units = unit_graph(import_graph())
    assert "path cpu-loops" not in units["path cpu-loops"]
    assert "gbfunc._spec" in units["path cpu-loops"]  # the loops' op reads the code tables


def test_modules_are_named_as_installed():
    assert module_name(str(ROOT / "gbfunc" / "cpu" / "_relu_rows.py")) == "gbfunc.cpu._relu_rows"
    assert module_name(str(ROOT / "gbfunc" / "generate" / "__init__.py")) == "gbfunc.generate"
    assert module_name(str(ROOT / "kernels" / "_checks.py")) == "gbfunc.kernels._checks"
    assert module_name("/nowhere/gbfunc/_plan.py") is None
