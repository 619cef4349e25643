"""The site as a reader sees it: checks on the HTML that `mkdocs build` writes.

tests/test_docs.py checks that the site builds and documents every name; these check how it
renders. Each test guards against a defect that reached the pages once (issue 57): docstring
examples run together into a paragraph, a literal `\\|`, markdown bold shown raw inside code,
code lines that scroll sideways, a page that stopped mid-sentence, figures whose labels shrank
to 6 px at the page's width, maintainers' notes shown to readers.

The widths were measured in headless Chromium (mkdocs-material, a 1280 or 1600 px window):
the content column is 688 CSS px, and a code line of 80 characters fits it, 81 scrolls.
"""

import html
import re
import struct
from pathlib import Path

import pytest

import gbfunc as gb

CODE_COLUMNS = 80  # characters of a code line that fit the content column
SHOWN_PX = 688  # the content column's width, at which every figure is shown
MAX_INCHES = 7.2  # drawn at most this wide, a figure's point sizes show at least at full size

_PRE = re.compile(r"<pre[^>]*>(.*?)</pre>", re.S)
_TAG = re.compile(r"<[^>]+>")
_PARAGRAPH = re.compile(r"<p>(.*?)</p>", re.S)


def article(page: Path) -> str:
    """The page's content: what is between `<article>` and its end (no navigation)."""
    text = page.read_text()
    return text.split("<article", 1)[-1].split("</article>", 1)[0]


def text_of(fragment: str) -> str:
    return html.unescape(_TAG.sub("", fragment))


def pages(site: Path, *, authored: bool = False) -> list[Path]:
    """Every page of the site; `authored=True`: the docs' own pages and the API reference,
    without the mounted results files, which quote program output unedited."""
    found = sorted(p for p in site.rglob("index.html"))
    if authored:
        found = [p for p in found if not p.relative_to(site).as_posix().startswith("benchmarks/")]
    return found


def code_lines(page: Path) -> list[str]:
    return [line for block in _PRE.findall(article(page)) for line in text_of(block).split("\n")]


@pytest.mark.slow
def test_docstring_examples_render_as_code(site):
    """An `Examples:` section is a code block of doctest lines, not prose: no `>>>` outside
    a `<pre>`, and the API pages hold as many example blocks as the docstrings."""
    prompts = 0
    for page in (site / "api").rglob("index.html"):
        body = article(page)
        outside = _PRE.sub("", body)
        assert "&gt;&gt;&gt;" not in outside, f"{page}: a doctest line outside a code block"
        assert "<blockquote>" not in body, f"{page}: a docstring section rendered as a quote"
        prompts += body.count('class="gp">&gt;&gt;&gt;')
    assert prompts >= 100, prompts  # 37 `Examples:` sections of several lines each


@pytest.mark.slow
def test_each_returns_section_is_one_row(site):
    """A continuation line of `Returns:` indented too little becomes a second row."""
    tables = []
    for page in (site / "api").rglob("index.html"):
        tables += re.findall(r"Returns:</span></p>\s*<table>(.*?)</table>", article(page), re.S)
    assert len(tables) >= 10
    for table in tables:
        assert table.count('<tr class="doc-section-item">') == 1, text_of(table)[:300]


@pytest.mark.slow
def test_no_escaped_pipe_or_raw_bold_reaches_the_reader(site):
    for page in pages(site):
        body = article(page)
        assert "\\|" not in text_of(body), f"{page}: a literal \\| (a pipe escaped for a table)"
        for block in _PRE.findall(body):
            bold = re.search(r"\*\*[^\s*(,][^*\n]*[^\s*]\*\*", text_of(block))
            assert bold is None, f"{page}: markdown bold inside code: {bold[0]!r}"


@pytest.mark.slow
def test_code_fits_the_page_width(site):
    """Signatures (formatted by ruff, mkdocs.yml's `line_length`), docstring examples and
    the docs' code blocks; the benchmark results pages quote program output and may scroll."""
    long = [
        f"{page.relative_to(site).parent}: {line}"
        for page in pages(site, authored=True)
        for line in code_lines(page)
        if len(line) > CODE_COLUMNS
    ]
    assert not long, f"{len(long)} code lines wider than the page:\n" + "\n".join(long[:10])


@pytest.mark.slow
def test_every_paragraph_ends_a_sentence(site):
    """A paragraph that stops mid-sentence (the performance page did, for weeks)."""
    cut = []
    for page in pages(site):
        body = _PRE.sub("", article(page))
        for paragraph in _PARAGRAPH.findall(body):
            text = text_of(paragraph).strip()
            if text and not paragraph.lstrip().startswith("<img") and text[-1] not in ".:!?)":
                cut.append(f"{page.relative_to(site).parent}: ...{text[-80:]}")
    assert not cut, "\n".join(cut)


def png_size(path: Path) -> tuple[int, float | None]:
    """A PNG's width in pixels and its dpi (its `pHYs` chunk), None when it records none."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width = struct.unpack(">I", data[16:20])[0]
    at = data.find(b"pHYs")
    if at < 0:
        return width, None
    per_unit, _, unit = struct.unpack(">IIB", data[at + 4 : at + 13])
    return width, per_unit * 0.0254 if unit == 1 else None


@pytest.mark.slow
def test_figures_are_drawn_for_the_width_they_are_shown_at(site):
    """Every figure on a page is at least as many pixels wide as it is shown (688 px), and
    drawn at most 7.2 inches wide, so that its labels show at least at their point size."""
    shown = set()
    for page in pages(site):
        for src in re.findall(r'<img[^>]* src="([^"]+)"', article(page)):
            if src.endswith(".png"):
                shown.add((page.parent / src).resolve())
    assert len(shown) >= 5, shown
    for path in sorted(shown):
        width, dpi = png_size(path)
        assert dpi, f"{path.name}: no dpi recorded (savefig(dpi=...), PIL save(dpi=...))"
        assert width >= SHOWN_PX, f"{path.name}: {width} px, shown at {SHOWN_PX}"
        assert width / dpi <= MAX_INCHES + 0.01, (
            f"{path.name}: drawn {width / dpi:.1f} in wide, shown at {MAX_INCHES}: its labels "
            f"shrink to {SHOWN_PX / width:.0%} of their size"
        )


@pytest.mark.slow
def test_maintainer_notes_stay_out_of_the_page(site):
    """`<!-- not run: REASON -->` tells maintainers why the suite skips a block; the reader
    sees the block alone."""
    notes = 0
    for page in pages(site):
        body = article(page)
        notes += body.count("<!-- not run:")
        assert "not run:" not in text_of(re.sub(r"<!--.*?-->", "", body, flags=re.S)).lower()
    assert notes >= 5  # the comments are there, kept as comments


@pytest.mark.slow
def test_the_footer_names_the_version_and_the_changelog_is_a_page(site):
    home = (site / "index.html").read_text()
    assert f"gbfunc {gb.__version__}" in home
    changelog = article(site / "CHANGELOG" / "index.html")
    assert "Changelog" in changelog
    assert gb.__version__ in changelog
