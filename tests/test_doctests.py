"""Every example in the library's docstrings runs, and prints what it says it prints.

An example that needs several processes or a GPU says so with `# doctest: +SKIP` on the
lines that cannot run here.
"""

import doctest
import importlib
import pkgutil

import pytest
import torch
from torch import nn
from torch.func import functional_call

import gbfunc as gb
from gbfunc.kernels import _runtime


def _modules() -> list[str]:
    names = []
    for package in ("gbfunc", "gbfunc.kernels"):
        root = importlib.import_module(package)
        names.append(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            names.append(info.name)
    return sorted(set(names))


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for name in _modules():
        module = importlib.import_module(name)
        tests += [t for t in finder.find(module) if t.examples]
    return sorted(tests, key=lambda t: t.name)


EXAMPLES = _examples()
# Examples that launch the Triton kernels on CPU tensors.
LAUNCHES_KERNELS = {"gbfunc.kernels.generate.generate"}


def test_the_library_has_examples_to_run():
    assert len(EXAMPLES) >= 25


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda t: t.name)
def test_docstring_example(example, tmp_path, monkeypatch):
    if example.name in LAUNCHES_KERNELS and not _runtime.INTERPRETED:
        pytest.skip("launches the kernels on CPU tensors: needs Triton's interpreter (off on GPUs)")
    monkeypatch.chdir(tmp_path)  # examples that save files write here
    torch.manual_seed(0)
    example.globs.update({"torch": torch, "nn": nn, "gb": gb, "functional_call": functional_call})
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(example, out=lambda text: pytest.fail(text, pytrace=False))
