"""The READMEs and the docs say what is true: snippets run, results are quoted, links and the
API hold.

- Every ```python block of README.md, benchmarks/README.md and the pages of docs/ runs on its
  own, in a fresh process started in an empty directory, so each carries its own imports and
  setup.
- A ```python block with a `<!-- run: torchrun --nproc-per-node N FILE.py -->` line (and
  optionally `--max-restarts M` before FILE.py) just above it is a script for torchrun:
  tests/test_dist_examples.py writes it to FILE.py, launches it so on gloo ranks on
  127.0.0.1, and checks its log.
- ```py blocks (the distributed snippets, which need `torchrun`) are not run; each has a
  `<!-- not run: REASON -->` line just above it, and a test file it names must exist.
- Excerpts marked `<!-- from FILE -->` are copied from the committed results, unedited.
- The READMEs' relative links point at files (and headings) that exist (the docs' links are
  checked by `mkdocs build --strict`, tests/test_docs.py).
- Every public name of `gbfunc` and `gbfunc.dist` is in the API tables of docs/api/index.md.
"""

import ast
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import takewhile
from operator import methodcaller
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
READMES = (README, ROOT / "benchmarks" / "README.md")
DOCS = ROOT / "docs"
PAGES = tuple(sorted(DOCS.rglob("*.md")))  # site paths: docs/ is the root, as the repository's
SNIPPET_TIMEOUT_S = 180
# above a ```python block that runs under torchrun: its launch command, FILE.py the script
TORCHRUN = re.compile(
    r"<!-- run: torchrun --nproc-per-node (\d+)(?: --max-restarts (\d+))? (\w+\.py) -->"
)


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language, first body line (1-based) and text."""

    path: Path
    lang: str
    line: int
    body: str
    above: str  # the line just above the opening fence

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\S*)\s*", lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        above = lines[i - 1] if i else ""
        blocks.append(Block(path, fence[1], i + 2, "\n".join(lines[i + 1 : end]) + "\n", above))
        i = end + 1
    return blocks


def every_python_block() -> list[Block]:
    return [b for path in READMES + PAGES for b in fenced_blocks(path) if b.lang == "python"]


def for_torchrun(block: Block) -> bool:
    return block.above.strip().startswith("<!-- run:")


def python_blocks() -> list[Block]:
    """The ```python blocks that run on their own, as `python -c`."""
    return [b for b in every_python_block() if not for_torchrun(b)]


def torchrun_blocks() -> list[Block]:
    """The ```python blocks that are scripts for torchrun (`<!-- run: torchrun ... -->`)."""
    return [b for b in every_python_block() if for_torchrun(b)]


def test_readme_and_docs_have_runnable_python_blocks():
    assert len([b for b in python_blocks() if b.path == README]) >= 1
    assert len({b.path for b in python_blocks() if b.path.is_relative_to(DOCS)}) >= 5


def run_alone(block: Block, cwd: Path) -> subprocess.CompletedProcess:
    """Run `block` as `python -c` in `cwd`, importing gbfunc from this checkout.

    Blank lines in front of the code make the line numbers in a traceback the README's.
    """
    code = "\n" * (block.line - 1) + block.body
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=SNIPPET_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def snippet_runs(request, tmp_path_factory):
    """The selected blocks, started together two at a time (a cold torch.compile takes most
    of a minute on 2 cores; the other blocks run beside it)."""
    selected = [
        item.callspec.params["block"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_readme_python_block_runs_on_its_own"
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {b: pool.submit(run_alone, b, tmp_path_factory.mktemp("snippet")) for b in selected}


@pytest.mark.slow
@pytest.mark.parametrize("block", python_blocks(), ids=str)
def test_readme_python_block_runs_on_its_own(block, snippet_runs):
    """Each block runs alone, in a fresh process started in an empty directory."""
    result = snippet_runs[block].result()
    assert result.returncode == 0, (
        f"the ```python block at {block} failed (line numbers are the README's):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )


def test_torchrun_blocks_name_their_launch():
    """A `<!-- run: ... -->` line is a launch tests/test_dist_examples.py can reproduce."""
    blocks = torchrun_blocks()
    assert blocks
    for block in blocks:
        assert TORCHRUN.fullmatch(block.above.strip()), (
            f"{block}: write `<!-- run: torchrun --nproc-per-node N [--max-restarts M] "
            f"FILE.py -->`, not {block.above.strip()!r}"
        )


def test_unrun_blocks_say_why():
    """```py blocks are not run: each says so just above it, and names its test if any."""
    blocks = [b for path in READMES + PAGES for b in fenced_blocks(path) if b.lang == "py"]
    assert blocks
    for block in blocks:
        marker = re.fullmatch(r"<!-- not run: (.+) -->", block.above.strip())
        assert marker, f"```py block at {block} needs a `<!-- not run: ... -->` line above it"
        for test in re.findall(r"tests/\S+\.py", marker[1]):
            assert (ROOT / test).is_file(), f"{block}: {test} does not exist"


def test_readme_test_command_is_what_ci_runs():
    text = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    lines = ci.strip().splitlines()
    command = lines[lines.index("# README test command:") + 1]
    assert f"```bash\n{command}\n```" in text, "the README's test command is what .ci/run runs"


def quoted_results(path: Path) -> list[tuple[Path, list[str]]]:
    """`(results file, quoted lines)` for every excerpt marked `<!-- from FILE -->` in `path`.

    FILE is relative to `path`'s folder, like the markdown links beside it (for a docs page,
    to the repository's root, which is the site's: docs/hooks.py). An excerpt is the fenced
    block, the markdown table or the markdown list that follows its marker.
    """
    base = ROOT if path.is_relative_to(DOCS) else path.parent
    lines = path.read_text().splitlines()
    excerpts = []
    for i, line in enumerate(lines):
        marker = re.fullmatch(r"<!-- from (\S+) -->", line.strip())
        if not marker:
            continue
        body = lines[i + 1 :]
        if body[0].startswith("```"):
            quoted = body[1 : body.index("```", 1)]
        else:
            kind = "|" if body[0].startswith("|") else "- "
            quoted = list(takewhile(methodcaller("startswith", kind), body))
        excerpts.append((base / marker[1], quoted))
    return excerpts


def test_readme_results_are_quoted_from_the_committed_results_files():
    """Measured numbers are copied from the files the benchmarks wrote, unedited."""
    excerpts = [e for path in READMES + PAGES for e in quoted_results(path)]
    assert len(excerpts) >= 5
    for source, quoted in excerpts:
        where = source.relative_to(ROOT)
        assert source.is_file(), f"quoted from {where}, which does not exist"
        assert quoted, f"empty excerpt from {where}"
        lines = source.read_text().splitlines()
        missing = [line for line in quoted if line not in lines]
        assert not missing, f"lines not in {where} (edited by hand?): {missing[:3]}"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_relative_links_resolve():
    for path in READMES:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            assert linked.exists(), f"{path.relative_to(ROOT)} links to missing {target}"
            if anchor:
                prose = re.sub(r"```.*?```", "", linked.read_text(), flags=re.S)
                headings = re.findall(r"^#+ (.+)$", prose, flags=re.M)
                anchors = {github_anchor(h) for h in headings}
                assert anchor in anchors, f"{path.relative_to(ROOT)}: no heading for #{anchor}"


def exported_names(init: Path) -> list[str]:
    """Public names bound by an `__init__.py`, submodules left out."""
    names = []
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.ImportFrom) and not (node.level and node.module is None):
            names += [alias.asname or alias.name for alias in node.names]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
    return [n for n in names if not n.startswith("_")]


def api_section() -> str:
    text = (DOCS / "api" / "index.md").read_text()
    return "\n".join(line for line in text.splitlines() if line.startswith("|"))


@pytest.mark.parametrize(
    ("init", "prefix"),
    [(ROOT / "gbfunc" / "__init__.py", "gb."), (ROOT / "gbfunc" / "dist" / "__init__.py", "gbd.")],
)
def test_every_public_name_is_in_the_api_table(init, prefix):
    names = exported_names(init)
    assert len(names) > 10
    table = api_section()
    missing = [n for n in names if not re.search(rf"(?<![\w.]){re.escape(prefix + n)}\b", table)]
    assert not missing, f"docs/api/index.md's API table lacks {[prefix + n for n in missing]}"


def test_every_name_in_the_api_table_is_exported():
    import gbfunc
    import gbfunc.dist

    table = api_section()
    named = set(re.findall(r"(?<![\w.])(gbd?)\.([A-Za-z_]\w*)", table))
    assert len(named) > 20
    stale = sorted(
        f"{prefix}.{name}"
        for prefix, name in named
        if not hasattr(gbfunc if prefix == "gb" else gbfunc.dist, name)
    )
    assert not stale, f"docs/api/index.md's API table names what gbfunc does not export: {stale}"


def test_api_table_covers_the_functional_optimizer_and_torchgb_shell():
    table = api_section()
    for name in ("gb.optim.adamw_init", "gb.optim.adamw_update", "gbfunc.compat.GenomicBottleneck"):
        assert name in table
