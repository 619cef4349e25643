"""The README's code blocks run as written (in order, sharing one namespace).

Blocks fenced as `python` run; the distributed snippets are fenced as `py` because they need
`torchrun` (their examples/ scripts are tested by tests/test_dist_*.py).
"""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow
def test_readme_python_blocks_run_as_written():
    blocks = python_blocks()
    assert len(blocks) >= 2
    namespace: dict = {"__name__": "readme"}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)


def test_readme_test_command_is_what_ci_runs():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    command = ci.strip().splitlines()[-1]
    assert command in text, "the README's test command must be the one .ci/run executes"
