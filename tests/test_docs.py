"""The documentation site (docs/, mkdocs.yml) builds in strict mode and documents the API.

Strict mode fails on a broken link or anchor, a missing page and a docstring mkdocstrings
cannot read; the code blocks of every page run in tests/test_readme.py.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_readme import exported_names

import gbfunc as gb
import gbfunc.dist as gbd

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"


def entries(page: str) -> set[str]:
    """The objects a page of the API reference renders: its `::: dotted.name` lines."""
    return set(re.findall(r"^::: (\S+)$", (API / page).read_text(), flags=re.M))


@pytest.mark.slow
def test_the_site_builds_in_strict_mode_with_every_page(site):
    for page in ("index.html", "concepts/index.html", "troubleshooting/index.html"):
        assert (site / page).is_file(), page
    assert (site / "figures" / "tiles.png").is_file()
    assert (site / "benchmarks" / "results" / "equal_params_cnn.png").is_file()  # docs/hooks.py


def test_the_docs_links_to_repository_files_resolve_where_the_markdown_is_read():
    # They were written from the site's layout (`benchmarks/...` from docs/training.md): dead
    # in the repository, where the README sends readers; docs/hooks.py maps them for the site.
    link = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")
    dead = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for target in link.findall(page.read_text()):
            if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                dead.append(f"{page.relative_to(ROOT)}: {target}")
    assert not dead, dead


@pytest.mark.slow
def test_the_api_pages_render_the_bottleneck_constructor_and_every_name(site):
    html = (site / "api" / "gbfunc" / "index.html").read_text()
    assert "plan_options" in html  # gb.Bottleneck.__init__'s arguments, merged into the class
    for name in gb.__all__:
        assert f'id="gbfunc.{name}"' in html or name in (
            "optim",
            "memory",
            "cpu",
            "compat",
            "continual",
        )
    dist = (site / "api" / "dist" / "index.html").read_text()
    for name in gbd.__all__:
        assert f'id="gbfunc.dist.{name}"' in dist


@pytest.mark.parametrize(
    ("module", "init", "page"),
    [
        (gb, ROOT / "gbfunc" / "__init__.py", "gbfunc.md"),
        (gbd, ROOT / "gbfunc" / "dist" / "__init__.py", "dist.md"),
    ],
)
def test_every_public_name_has_an_api_entry(module, init, page):
    """`__all__` is every public name the package binds, and each has its entry."""
    submodules = {n for n in module.__all__ if isinstance(getattr(module, n), type(gb))}
    assert set(module.__all__) == set(exported_names(init)) | submodules
    documented = entries(page) | entries("submodules.md")
    missing = [n for n in module.__all__ if f"{module.__name__}.{n}" not in documented]
    assert not missing, f"docs/api/{page} has no `::: {module.__name__}.NAME` for {missing}"


@pytest.mark.parametrize("module", [gb, gbd])
def test_no_public_name_beyond_all_but_the_packages_own_modules(module):
    """`dir(gb)` holds no helper the package imported for itself (`gb.importlib` did), only
    `__all__` and gbfunc's own subpackages that Python binds on import."""
    extra = [
        n
        for n in dir(module)
        if not n.startswith("_")
        and n not in module.__all__
        and not getattr(getattr(module, n), "__name__", "").startswith(f"{module.__name__}.")
    ]
    assert not extra, f"{module.__name__} binds public names outside __all__: {extra}"


def test_bottlenecks_constructor_has_its_own_docstring():
    """`help(gb.Bottleneck.__init__)` shows gbfunc's arguments, not nn.Module's docstring."""
    doc = gb.Bottleneck.__init__.__doc__
    assert doc is not None
    assert "plan_options" in doc
    assert "model" in doc


@pytest.mark.slow
def test_the_concept_figure_is_drawn_by_its_script(tmp_path):
    pytest.importorskip("matplotlib", reason="needs the demo extra")
    out = tmp_path / "tiles.png"
    subprocess.run(
        [sys.executable, str(ROOT / "docs" / "figures" / "tiles.py"), str(out)],
        cwd=tmp_path,
        check=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"},
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 20_000  # three panels, not an empty canvas


def test_every_code_block_of_the_site_runs_or_says_why_not():
    """```python blocks run (tests/test_readme.py; those marked `<!-- run: torchrun ... -->`
    under torchrun, tests/test_dist_examples.py); any other block is a quoted result
    (`<!-- from FILE -->`) or says why it is not run (a comment for maintainers)."""
    from test_readme import PAGES, fenced_blocks

    for page in PAGES:
        for block in fenced_blocks(page):
            if block.lang != "python":
                assert re.fullmatch(r"<!-- (not run: .+|from \S+) -->", block.above.strip()), (
                    f"{block}: a ```{block.lang} block needs `<!-- not run: REASON -->` above it"
                )
