"""The README's code blocks run as written (in order, sharing one namespace).

Blocks fenced as `python` run; the distributed snippets are fenced as `py` because they need
`torchrun` (their examples/ scripts are tested by tests/test_dist_*.py).
"""

import linecache
import re
from itertools import takewhile
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    """Every ```python block, preceded by blank lines so its line numbers are the README's
    (tracebacks, and torch.compile reading a function's source, point at the right lines)."""
    text = README.read_text()
    return [
        "\n" * text.count("\n", 0, match.start(1)) + match[1]
        for match in re.finditer(r"```python\n(.*?)```", text, flags=re.S)
    ]


@pytest.mark.slow
def test_readme_python_blocks_run_as_written():
    blocks = python_blocks()
    assert len(blocks) >= 2
    namespace: dict = {"__name__": "readme"}
    for i, block in enumerate(blocks):
        # A name of its own in linecache: inspect (torch.compile reads a function's source)
        # must see this block, not the markdown around it.
        name = f"<README.md python block {i}>"
        linecache.cache[name] = (len(block), None, block.splitlines(keepends=True), name)
        exec(compile(block, name, "exec"), namespace)


def test_readme_test_command_is_what_ci_runs():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    command = ci.strip().splitlines()[-1]
    assert command in text, "the README's test command must be the one .ci/run executes"


def quoted_results() -> list[tuple[str, list[str]]]:
    """`(results file, quoted lines)` for every README excerpt marked `<!-- from FILE -->`.

    An excerpt is the fenced block or the markdown table that follows its marker.
    """
    lines = README.read_text().splitlines()
    excerpts = []
    for i, line in enumerate(lines):
        marker = re.fullmatch(r"<!-- from (\S+) -->", line.strip())
        if not marker:
            continue
        body = lines[i + 1 :]
        if body[0].startswith("```"):
            quoted = body[1 : body.index("```", 1)]
        else:
            quoted = list(takewhile(lambda x: x.startswith("|"), body))
        excerpts.append((marker[1], quoted))
    return excerpts


def test_readme_results_are_quoted_from_the_committed_results_files():
    """Measured numbers in the README are copied from the files the benchmarks wrote, unedited."""
    excerpts = quoted_results()
    assert len(excerpts) >= 5
    for path, quoted in excerpts:
        source = (README.parent / path).read_text().splitlines()
        assert quoted, f"README: empty excerpt from {path}"
        missing = [line for line in quoted if line not in source]
        assert not missing, f"README lines not in {path} (edited by hand?): {missing[:3]}"
