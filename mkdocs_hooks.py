"""MkDocs hook (mkdocs.yml ``hooks:``): links from a page to repository files outside ``docs/``.

A page may link to code or examples of the repository, e.g. ``[the example](../../examples/plugins/...)``.
Such a target is not a documentation file, so MkDocs would report it as missing; here it becomes a link
to the file on GitHub (``repo_url``). A target that does not exist in the repository is logged as a
warning, which ``mkdocs build --strict`` turns into a failure.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.repo_links")

ROOT = Path(__file__).resolve().parent
#: ``](target)`` or ``](target#anchor)`` of a Markdown inline link (not images of remote URLs).
LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Rewrite links that leave ``docs/`` into links to the repository on GitHub."""
    docs_dir = Path(config["docs_dir"]).resolve()
    page_dir = (docs_dir / page.file.src_path).parent
    repo = str(config.get("repo_url") or "").rstrip("/")

    def rewrite(match: re.Match[str]) -> str:
        target = match.group("target")
        if "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        path = (page_dir / target).resolve()
        if path.is_relative_to(docs_dir) or not path.is_relative_to(ROOT):
            return match.group(0)
        if not path.exists():
            log.warning("%s links to %s, which does not exist in the repository", page.file.src_path, target)
            return match.group(0)
        kind = "tree" if path.is_dir() else "blob"
        return f"]({repo}/{kind}/main/{path.relative_to(ROOT).as_posix()}{match.group('anchor') or ''})"

    return LINK.sub(rewrite, markdown)
