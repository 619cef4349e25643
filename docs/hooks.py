"""MkDocs hooks: the repository's benchmark and kernel documents join the site at their
repository paths, so that the docs link to the committed results instead of copies.

The docs' own pages link to a mounted document by its path in the repository (from
`docs/training.md`, `../benchmarks/results/x.md`), so that the links work where the Markdown is
read in the repository too; on the site they point at the mounted copy, and the pages keep
strict link checking. A mounted page's links to files that are not in the site (scripts,
tests, the README) become plain text naming the path. The
`<!-- not run: REASON -->` lines above code blocks are notes for maintainers (tests/test_readme.py
runs every other block) and stay HTML comments, out of the reader's way.
"""

import posixpath
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
MOUNTED = (
    "CHANGELOG.md",
    "benchmarks/README.md",
    "benchmarks/results/*.md",
    "benchmarks/results/*.png",
    "kernels/README.md",
)
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
_LINK_OR_IMAGE = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    """The version gbfunc reports (`gbfunc/_version.py`) in every page's footer."""
    version = re.search(r'__version__ = "([^"]+)"', (ROOT / "gbfunc" / "_version.py").read_text())
    config["copyright"] = f"gbfunc {version[1]} · MIT licence"
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for pattern in MOUNTED:
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if not page.file.src_uri.startswith(("benchmarks/", "kernels/", "CHANGELOG")):
        return _LINK_OR_IMAGE.sub(lambda m: _to_mounted(m, page.file.src_uri, files), markdown)
    here = Path(page.file.src_uri).parent

    def resolve(match: re.Match) -> str:
        text, target = match[1], match[2]
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            return match[0]
        path = _normalise((here / target.split("#")[0]).as_posix())
        if files.get_file_from_path(path) is not None:
            return match[0]
        return f"{text} (`{path}` in the repository)"

    return _LINK.sub(resolve, markdown)


def _to_mounted(match: re.Match, page: str, files: Files) -> str:
    """A docs page's link (or image) to a mounted document, written from the page's place in
    the repository (`docs/<page>`), made relative to its place on the site; others unchanged."""
    label, target = match[1], match[2]
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
        return match[0]
    path, hash_, anchor = target.partition("#")
    here = posixpath.dirname(page)
    in_repository = posixpath.normpath(posixpath.join("docs", here, path))
    if in_repository.startswith("docs/") or files.get_file_from_path(in_repository) is None:
        return match[0]
    return f"{label}({posixpath.relpath(in_repository, here or '.')}{hash_}{anchor})"


def _normalise(path: str) -> str:
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts)
