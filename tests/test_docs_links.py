"""Every relative link of the README and the docs resolves, anchor included, and so does every reference to a
docs page in the code's comments and help strings.

Anchors follow GitHub's rule, which mkdocs.yml gives the site too (pymdownx.slugs): the heading's text, lower
case, punctuation dropped, each space a '-'; a repeated heading gets -1, -2... on GitHub but _1, _2 on the
site, so a link to one is refused: give the heading a name of its own.
"""

from __future__ import annotations

import re
import unicodedata
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# An inline link or image: [text](target "title"); the text may hold one level of brackets.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
# A docs page named in code: docs/training.md or docs/reports/main-job.md, with or without #anchor.
DOCS_REFERENCE = re.compile(r"\bdocs/((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+))?")
CODE_FOLDERS = ("src", "tests", "benchmarks", "scripts")
CODE_FILES = ("pyproject.toml", ".ci/run", "mkdocs.yml")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose_lines(path: Path):
    """(line number, line) of a Markdown file outside fenced code blocks."""
    fence = None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
        elif opened:
            fence = opened.group(1)
        else:
            yield number, line


def links(path: Path):
    """(line number, target) of every inline link and image outside code."""
    for number, line in prose_lines(path):
        spans = [span.span() for span in CODE_SPAN.finditer(line)]
        for match in LINK.finditer(line):
            if not any(start <= match.start() < end for start, end in spans):
                yield number, match.group(1)


def heading_text(markdown: str) -> str:
    """What a heading shows: code without its backticks, links and images as their text, no emphasis or HTML."""
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), markdown)
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return re.sub(r"\*+", "", text)


def slug(text: str) -> str:
    """GitHub's (and the site's) anchor of a heading's text."""
    text = unicodedata.normalize("NFC", heading_text(text)).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(anchors of the headings of ``path``, the subset that are repeated headings' -N anchors)."""
    seen: dict[str, int] = {}
    unique, repeated = set(), set()
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            if base in seen:
                seen[base] += 1
                repeated.add(f"{base}-{seen[base]}")
            else:
                seen[base] = 0
                unique.add(base)
    return frozenset(unique), frozenset(repeated)


def anchor_problem(page: Path, anchor: str) -> str | None:
    """Why ``page#anchor`` does not resolve, or None when it does."""
    unique, repeated = anchors(page)
    if anchor in unique:
        return None
    if anchor in repeated:
        return (f"#{anchor} is a repeated heading of {page.relative_to(ROOT)} (GitHub numbers it -N, the site _N): "
                f"rename that heading")
    return f"{page.relative_to(ROOT)} has no heading whose anchor is #{anchor}"


def link_problem(source: Path, target: str) -> str | None:
    """Why ``target``, linked from ``source``, does not resolve, or None when it does (or is not relative)."""
    if target.startswith("/") or SCHEME.match(target):
        return None if not target.startswith("/") else "an absolute path: link relative to this file"
    path, _, anchor = target.partition("#")
    resolved = (source.parent / path).resolve() if path else source
    if not resolved.is_relative_to(ROOT):
        return "points outside the repository"
    if not resolved.exists():
        return f"{resolved.relative_to(ROOT)} does not exist"
    if anchor and resolved.suffix == ".md":
        return anchor_problem(resolved, anchor)
    return None


def broken_links(paths) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{number}: ({target}): {problem}"
            for path in paths for number, target in links(path)
            if (problem := link_problem(path, target))]


def test_every_relative_link_in_the_readme_and_the_docs_resolves():
    broken = broken_links(markdown_files())
    assert not broken, "broken links (fix the link, or the heading or file it names):\n" + "\n".join(broken)


def test_every_docs_page_the_code_names_exists_with_the_anchor_it_names():
    files = [ROOT / name for name in CODE_FILES if (ROOT / name).is_file()]
    files += [path for folder in CODE_FOLDERS for path in sorted((ROOT / folder).rglob("*"))
              if path.suffix in {".py", ".sh", ".toml", ".yaml", ".yml", ".txt", ".md"} and path.is_file()]
    broken = []
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for match in DOCS_REFERENCE.finditer(line):
                page = DOCS / match.group(1)
                problem = (f"docs/{match.group(1)} does not exist" if not page.is_file()
                           else match.group(2) and anchor_problem(page, match.group(2)))
                if problem:
                    broken.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)}: {problem}")
    assert not broken, "references to docs pages that do not resolve (fix the reference or the page):\n" + \
        "\n".join(broken)


def test_the_reports_index_lists_every_report():
    index = DOCS / "reports" / "index.md"
    listed = {(index.parent / target.partition("#")[0]).resolve() for _, target in links(index)}
    missing = [path.name for path in sorted(index.parent.glob("*.md")) if path != index and path not in listed]
    assert not missing, f"docs/reports/index.md does not list {missing}: add a line for each"


def test_the_slug_rule():
    assert slug("Learning efficiency: the sweep (issue #24)") == "learning-efficiency-the-sweep-issue-24"
    assert slug("`teamrl eval`") == "teamrl-eval"
    assert slug("Learning digit_sum") == "learning-digit_sum"
    assert slug("Writing — [`envs/writing.py`](../src/teamrl/envs/writing.py)") == "writing--envswritingpy"
