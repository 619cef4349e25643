"""What an install of gbfunc makes importable, and what importing it changes in a process.

Each check runs in a fresh interpreter started from a temporary directory, so neither the
repository root nor pytest's own `sys.path` entries can hide a packaging mistake.
"""

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_fresh(code: str, tmp_path: Path, env: dict[str, str] | None = None) -> str:
    """Run `code` in a new interpreter whose working directory is `tmp_path`; its stdout."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=tmp_path,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_transformers_imports_after_gbfunc_and_torch_compile(tmp_path):
    """transformers imports a package named `kernels` when one is importable (issue 11)."""
    pytest.importorskip("transformers")
    out = run_fresh(
        """
        import torch, gbfunc as gb
        torch.compile(lambda x: x * 2)(torch.ones(3))
        from transformers import GPT2LMHeadModel
        print("ok")
        """,
        tmp_path,
    )
    assert out.strip() == "ok"


def test_only_gbfunc_is_importable(tmp_path):
    out = run_fresh(
        """
        import importlib.util, json
        import gbfunc, gbfunc.kernels
        names = ("kernels", "examples", "tests", "benchmarks")
        try:
            gbfunc.distt
        except AttributeError as e:
            misspelt = str(e)
        print(json.dumps({
            "found": {n: str(importlib.util.find_spec(n)) for n in names
                      if importlib.util.find_spec(n) is not None},
            "gbfunc": gbfunc.__file__,
            "kernels": gbfunc.kernels.__file__,
            "dist": gbfunc.dist.plan_difference.__name__,  # after `import gbfunc` alone
            "misspelt": misspelt,
        }))
        """,
        tmp_path,
    )
    result = json.loads(out)
    repo = str(ROOT)
    assert not any(repo in spec for spec in result["found"].values()), result["found"]
    assert result["kernels"] == str(ROOT / "kernels" / "__init__.py")
    assert result["gbfunc"] == str(ROOT / "gbfunc" / "__init__.py")
    with pytest.raises(AssertionError, match="ModuleNotFoundError"):
        run_fresh("import examples", tmp_path)
    assert result["dist"] == "plan_difference"  # `gb.dist`, as docstrings and messages say
    assert result["misspelt"] == "module 'gbfunc' has no attribute 'distt'"


def test_importing_gbfunc_changes_nothing_for_other_libraries(tmp_path):
    out = run_fresh(
        """
        import json, os, sys, torch

        def state():
            return {
                "env": dict(os.environ),
                "dtype": str(torch.get_default_dtype()),
                "threads": torch.get_num_threads(),
                "matmul": torch.get_float32_matmul_precision(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "grad": torch.is_grad_enabled(),
                "triton": "triton" in sys.modules,
            }

        before = state()
        import gbfunc, gbfunc.dist, gbfunc.kernels
        after = state()
        after["triton"] = before["triton"]  # gbfunc.kernels imports triton, on purpose
        print(json.dumps(before == after))
        """,
        tmp_path,
    )
    assert out.strip() == "true"


def test_importing_gbfunc_leaves_what_others_set_meanwhile(tmp_path):
    """The import removed every variable added while it ran, another thread's too."""
    out = run_fresh(
        """
        import os, threading, time

        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # as a process that never imported torch

        def other_library():
            time.sleep(0.2)  # while gbfunc (and torch) import
            os.environ["OTHER_LIBRARY"] = "1"

        thread = threading.Thread(target=other_library)
        thread.start()
        import gbfunc
        thread.join()
        print(os.environ.get("OTHER_LIBRARY"), "TORCHINDUCTOR_CACHE_DIR" in os.environ)
        """,
        tmp_path,
    )
    assert out.split() == ["1", "False"]


def test_triton_backend_without_the_interpreter_says_how_to_enable_it(tmp_path):
    pytest.importorskip("triton")
    out = run_fresh(
        """
        import torch, gbfunc as gb
        if torch.cuda.is_available():
            print("cuda")
        else:
            plan = gb.plan(torch.nn.Linear(8, 8), tile=(4, 4))
            try:
                gb.apply(gb.init(plan), plan, backend="triton")
            except RuntimeError as e:
                print(e)
        """,
        tmp_path,
    )
    if out.strip() == "cuda":
        pytest.skip("CUDA present: the kernels compile for it, no interpreter is asked for")
    assert "gb.apply" in out
    assert "TRITON_INTERPRET=1" in out
    assert "backend='torch'" in out


@pytest.mark.slow
def test_triton_backend_runs_where_the_process_enabled_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    out = run_fresh(
        """
        import os
        os.environ["TRITON_INTERPRET"] = "1"  # the process's own choice, before triton loads
        import torch, gbfunc as gb
        plan = gb.plan(torch.nn.Linear(10, 7), tile=(4, 4))
        gparams = gb.init(plan)
        fused = gb.apply(gparams, plan, backend="triton")["weight"]
        plain = gb.apply(gparams, plan, backend="torch")["weight"]
        print(float((fused - plain).abs().max()))
        """,
        tmp_path,
    )
    assert float(out) < 1e-5


def test_every_package_folder_is_listed_for_the_build():
    """setuptools' explicit package list has every folder with an `__init__.py`."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"gbfunc": ROOT / "gbfunc", "gbfunc.kernels": ROOT / "kernels"}
    found = set()
    for package, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((package, *parts)))
    assert found == set(config["packages"])
    assert config["package-dir"] == {"gbfunc": "gbfunc", "gbfunc.kernels": "kernels"}


@pytest.mark.slow
def test_the_wheel_holds_gbfunc_only(tmp_path):
    """A wheel ships `kernels/` as `gbfunc/kernels/` and nothing else at the top level."""
    source = tmp_path / "source"  # a copy: setuptools writes build/ beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("gbfunc", "kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("gbfunc-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {n.split("/")[0] for n in names} == {"gbfunc", wheel.name.split("-py")[0] + ".dist-info"}
    assert "gbfunc/kernels/generate/kernel.py" in names
    assert "gbfunc/kernels/generate_backward/kernel.py" in names
    sources = {p.name for p in (ROOT / "gbfunc" / "cpu" / "csrc").iterdir()}
    assert sources
    assert {f"gbfunc/cpu/csrc/{name}" for name in sources} <= set(names)


def module_imports(root: Path, package: str) -> dict[str, set[str]]:
    """Per module of `package` (in folder `root`), the modules of it that its top-level code
    imports: `import a.b` imports `a.b`; `from a import b` imports `a`, and `a.b` where that
    is a module (so `from . import x` in a package's module imports the package itself)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = (
            ".".join((package, *parts[:-1]))
            if parts[-1] == "__init__"
            else ".".join((package, *parts))
        )
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        edges = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = ".".join(filter(None, (base if node.level else "", node.module or "")))
                edges.add(source)
                edges |= {f"{source}.{alias.name}" for alias in node.names}
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def test_gbfunc_has_no_import_cycle():
    """No module of gbfunc imports, through its top-level imports, a module that imports it
    back: `gbfunc.dist._sharded` did, through `from . import _optim_state`, which imports the
    package `gbfunc.dist` whose `__init__` imports `_sharded`."""
    graph = module_imports(ROOT / "gbfunc", "gbfunc")
    assert "gbfunc.dist._sharded" in graph["gbfunc.dist"]  # the walk sees imports
    on_stack, done, cycles = [], set(), []

    def visit(module: str) -> None:
        if module in on_stack:
            cycles.append([*on_stack[on_stack.index(module) :], module])
            return
        if module in done:
            return
        on_stack.append(module)
        for target in sorted(graph[module]):
            visit(target)
        on_stack.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)
    assert cycles == []


def test_no_module_of_the_library_is_over_500_lines():
    """A module past 500 lines holds more than one concern (issue 55's bound); the kernels
    count too. `dist/_sharded.py` (516) and `compat.py` (501) had grown past it."""
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in ("gbfunc", "kernels")
        for path in (ROOT / folder).rglob("*.py")
    }
    assert len(sizes) > 50  # the walk sees the modules
    assert {name: n for name, n in sizes.items() if n > 500} == {}
