"""mkdocs hooks for teamrl's site (``hooks:`` in mkdocs.yml).

1. Links from a page to repository files outside ``docs/`` (``[envs/writing.py](../src/teamrl/envs/writing.py)``)
   work on GitHub but would point nowhere on the site, and ``mkdocs build --strict`` refuses them. Each one
   must name a file or folder that exists in the repository: a missing one is logged as a warning, which fails
   ``--strict``, as a broken link between pages does. A valid one is rewritten: to ``repo_url``'s copy of the
   file when mkdocs.yml sets ``repo_url``, else to its text alone (the text is kept as written, so heading
   anchors are the same on the site and on GitHub).
2. The nav's "Reports" section lists every ``docs/reports/*.md`` after the entries mkdocs.yml gives it, so
   that a report added later is in the nav without editing mkdocs.yml.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from mkdocs.plugins import get_plugin_logger

log = get_plugin_logger(__name__)

REPORTS_SECTION = "Reports"
REPORTS_DIR = "reports"
# An inline link or image: [text](target "title"); the text may hold one level of brackets.
LINK = re.compile(r"(?P<image>!?)\[(?P<text>(?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?(?P<target>[^()\s<>]+)>?"
                  r"(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:.+?)\1")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def on_config(config):
    """Append every report not already listed to the nav's Reports section."""
    reports = Path(config.docs_dir) / REPORTS_DIR
    for entry in config.nav or []:
        if isinstance(entry, dict) and REPORTS_SECTION in entry and reports.is_dir():
            section = entry[REPORTS_SECTION]
            listed = {item if isinstance(item, str) else next(iter(item.values())) for item in section}
            for path in sorted(reports.glob("*.md")):
                name = f"{REPORTS_DIR}/{path.name}"
                if name not in listed:
                    section.append(name)
    return config


def on_page_markdown(markdown, page, config, files):
    """Check, then rewrite, the page's links to repository files outside the docs folder."""
    docs_dir = Path(config.docs_dir).resolve()
    repo_root = Path(config.config_file_path).resolve().parent
    page_dir = (docs_dir / page.file.src_uri).parent
    repo_url = (config.repo_url or "").rstrip("/")

    def rewrite(match: re.Match) -> str:
        target = match.group("target")
        if target.startswith(("#", "/")) or SCHEME.match(target):
            return match.group(0)
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (page_dir / path).resolve()
        if resolved.is_relative_to(docs_dir):
            return match.group(0)  # a page or file of the site: mkdocs checks it
        if not resolved.is_relative_to(repo_root):
            log.warning(f"Doc file '{page.file.src_uri}' links to '{target}', which is outside the repository")
            return match.group(0)
        if not resolved.exists():
            log.warning(f"Doc file '{page.file.src_uri}' links to '{target}', but the repository has no "
                        f"'{resolved.relative_to(repo_root).as_posix()}'")
            return match.group(0)
        text = match.group("text")
        if repo_url:
            kind = "tree" if resolved.is_dir() else "blob"
            where = PurePosixPath(resolved.relative_to(repo_root).as_posix())
            return f"{match.group('image')}[{text}]({repo_url}/{kind}/main/{where})"
        return text

    lines, fence = [], None
    for line in markdown.split("\n"):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
        elif opened:
            fence = opened.group(1)
        else:
            spans = [span.span() for span in CODE_SPAN.finditer(line)]
            line = LINK.sub(lambda match, spans=spans: match.group(0) if any(
                start <= match.start() < end for start, end in spans) else rewrite(match), line)
        lines.append(line)
    return "\n".join(lines)
