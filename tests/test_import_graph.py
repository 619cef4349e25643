"""The generation code's imports run one way: the CPU loops and the Triton kernels stand on
the plan, the specification (`gbfunc._spec`) and the tiling (`gbfunc._tiling`: tile-and-cut),
never on the runners above them; the paths (`gbfunc/generate/`) stand below the dispatcher
and `gb.apply`, and the dispatcher reads only what the runners make public.

Read from the source with `ast`, so a new import that runs back up fails here before it
can make a cycle.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What the low packages may import from gbfunc: the plan, the specification and the tiling
# (tile-and-cut, which the kernels' forward reference checks their fused layout against);
# the loops also what torch does to the call (`_tracing`, which imports only torch).
ALLOWED = {
    "gbfunc/cpu": {"gbfunc._plan", "gbfunc._spec", "gbfunc._function", "gbfunc._tracing"},
    "kernels": {"gbfunc._plan", "gbfunc._spec", "gbfunc._tiling", "gbfunc._function"},
}
# The modules of `gbfunc/generate/`, one per path, in the dispatcher's order.
PATHS = ("triton", "cpu_loops", "graph", "compiled_mlp", "torch_ops")


def gbfunc_imports(path: Path, package: str) -> set[str]:
    """The `gbfunc` modules `path` imports; its relative imports start at `package` (the
    package holding it, or the package itself for an `__init__.py`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = _resolved(node, package)
            names = [base] if node.module else [f"{base}.{a.name}" for a in node.names]
            found.update(n for n in names if n.startswith("gbfunc"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gbfunc"))
    return found


def gbfunc_names(path: Path, package: str) -> set[str]:
    """Every `gbfunc` name `path` imports, dotted: `from m import a` gives `m.a` (a module or
    a name in it), `import m` gives `m`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.update(f"{_resolved(node, package)}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {name for name in found if name.startswith("gbfunc")}


def _resolved(node: ast.ImportFrom, package: str) -> str:
    """The module `node` imports from, its relative form resolved from `package`."""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
    return ".".join(p for p in (base, node.module) if p)


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_the_loops_and_kernels_import_only_the_plan_and_the_specification(folder):
    own = "gbfunc.kernels" if folder == "kernels" else folder.replace("/", ".")
    offenders = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        package = ".".join((own, *path.relative_to(ROOT / folder).parts[:-1]))
        outside = {m for m in gbfunc_imports(path, package) if not m.startswith(own)}
        if outside - ALLOWED[folder]:
            offenders[str(path.relative_to(ROOT))] = sorted(outside - ALLOWED[folder])
    assert not offenders, f"imports above the plan and the specification: {offenders}"


def test_what_torch_does_to_the_call_imports_nothing_of_gbfunc():
    """The loops may read `_tracing` because it stands on torch alone: an import of gbfunc
    there would let the loops reach above the plan and the specification through it."""
    assert gbfunc_imports(ROOT / "gbfunc/_tracing.py", "gbfunc") == set()


# Above the paths: what no module of `gbfunc/generate/` may import.
ABOVE_THE_PATHS = ("gbfunc._dispatch", "gbfunc._apply")
# The runners, whose private names (and private modules) the dispatcher may not read.
RUNNERS = (
    "gbfunc.cpu",
    "gbfunc.kernels",
    "gbfunc._select",
    *(f"gbfunc.generate.{path}" for path in PATHS),
)


def test_the_paths_stand_below_the_dispatcher_and_gb_apply():
    offenders = {}
    for path in sorted((ROOT / "gbfunc" / "generate").glob("*.py")):
        package = "gbfunc.generate"
        up = {m for m in gbfunc_imports(path, package) if m.startswith(ABOVE_THE_PATHS)}
        if up:
            offenders[str(path.relative_to(ROOT))] = sorted(up)
    assert not offenders, f"paths importing the dispatcher or gb.apply: {offenders}"


def test_the_dispatcher_reads_no_private_name_of_a_runner():
    private = set()
    for name in gbfunc_names(ROOT / "gbfunc" / "_dispatch.py", "gbfunc"):
        for runner in RUNNERS:
            rest = name.removeprefix(runner)
            if (
                rest != name
                and rest.startswith(".")
                and any(part.startswith("_") for part in rest.split(".")[1:])
            ):
                private.add(name)
    assert not private, f"the dispatcher reads runners' private names: {sorted(private)}"


def test_the_generate_package_holds_one_module_per_path():
    from gbfunc import _dispatch

    assert tuple(p.__name__.removeprefix("gbfunc.generate.") for p in _dispatch.PATHS) == PATHS
    assert _dispatch.NAMES == ("triton", "cpu-loops", "graph", "compiled-mlp", "torch")


def test_the_import_reader_resolves_relative_imports(tmp_path):
    path = ROOT / "gbfunc" / "cpu" / "_relu_rows.py"
    assert gbfunc_imports(path, "gbfunc.cpu") >= {"gbfunc._spec", "gbfunc.cpu._relu_loops"}
    kernel = ROOT / "kernels" / "generate" / "kernel.py"
    assert "gbfunc.kernels._gnet" in gbfunc_imports(kernel, "gbfunc.kernels.generate")
    names = gbfunc_names(ROOT / "gbfunc" / "_dispatch.py", "gbfunc")
    assert {"gbfunc.generate.triton", "gbfunc.cpu.loops_state"} <= names
    graph = ROOT / "gbfunc" / "generate" / "graph.py"
    assert {"gbfunc.generate.compiled_mlp", "gbfunc.generate.cpu_loops"} <= gbfunc_imports(
        graph, "gbfunc.generate"
    )
    absolute = tmp_path / "absolute.py"
    absolute.write_text("import gbfunc._plan as plan\nimport torch\n")
    assert gbfunc_imports(absolute, "gbfunc") == {"gbfunc._plan"}
