"""The generation code's imports run one way: the CPU loops and the Triton kernels stand on
the plan, the specification (`gbfunc._spec`) and the tiling (`gbfunc._tiling`: tile-and-cut), never on
the runners above them.

Read from the source with `ast`, so a new import that runs back up fails here before it
can make a cycle.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What the low packages may import from gbfunc: the plan, the specification and the tiling
# (tile-and-cut, which the kernels' forward reference checks their fused layout against).
ALLOWED = {
    "gbfunc/cpu": {"gbfunc._plan", "gbfunc._spec"},
    "kernels": {"gbfunc._plan", "gbfunc._spec", "gbfunc._tiling"},
}


def gbfunc_imports(path: Path, package: str) -> set[str]:
    """The `gbfunc` modules `path` imports; its relative imports start at `package` (the
    package holding it, or the package itself for an `__init__.py`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            base = ".".join(p for p in (base, node.module) if p)
            names = [base] if node.module else [f"{base}.{a.name}" for a in node.names]
            found.update(n for n in names if n.startswith("gbfunc"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("gbfunc"))
    return found


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


def test_the_import_reader_resolves_relative_imports():
    path = ROOT / "gbfunc" / "cpu" / "_relu_rows.py"
    assert gbfunc_imports(path, "gbfunc.cpu") >= {"gbfunc._spec", "gbfunc.cpu._relu_loops"}
    kernel = ROOT / "kernels" / "generate" / "kernel.py"
    assert "gbfunc.kernels._gnet" in gbfunc_imports(kernel, "gbfunc.kernels.generate")
