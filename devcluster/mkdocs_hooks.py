"""mkdocs hook (mkdocs.yml `hooks:`): links from the docs to the repository's own files.

The pages link to files outside docs/ by relative path (`../operator/src/...`), so the Markdown reads
right where it lies. mkdocs can only check links to pages, so this hook checks these: a path that does
not exist in the repository is a warning, which `mkdocs build --strict` turns into a failure. In the
built site the link points at the file in the repository browser when `repo_url` is set
(TPUJOB_REPO_URL), else it becomes its plain text.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.repo_links")

# [text](target), its text possibly with code spans; or an inline code span, which is left alone.
_LINK_OR_CODE = re.compile(r"\[(?P<text>(?:[^\]`]|`[^`]*`)*)\]\((?P<target>[^)\s]+)\)|`[^`]*`")
_FENCE = re.compile(r"^(```|~~~)")


def repo_target(page_src: str, target: str) -> str | None:
    """The repository path (posix, no anchor) a relative link of docs/`page_src` names, when it lies
    outside docs/; None for a link into docs/, an anchor, or an absolute URL."""
    if re.match(r"^[a-zA-Z][a-zA-Z+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    joined = posixpath.normpath(posixpath.join("docs", posixpath.dirname(page_src), path))
    if joined == "docs" or joined.startswith("docs/"):
        return None
    return joined


def rewrite(markdown: str, page_src: str, repo_root: Path, repo_url: str) -> tuple[str, list[str]]:
    """The page's Markdown with its repository links rewritten, and the targets that do not exist."""
    missing: list[str] = []

    def fix(match: re.Match[str]) -> str:
        if match.group("target") is None:
            return match.group(0)
        text, target = match.group("text"), match.group("target")
        path = repo_target(page_src, target)
        if path is None:
            return match.group(0)
        if path.startswith("../") or not (repo_root / path).exists():
            missing.append(target)
            return match.group(0)
        if not repo_url:
            return text
        kind = "tree" if (repo_root / path).is_dir() else "blob"
        anchor = "#" + target.split("#", 1)[1] if "#" in target else ""
        return f"[{text}]({repo_url.rstrip('/')}/{kind}/main/{path}{anchor})"

    out: list[str] = []
    fenced = False
    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
        if fenced:
            out.append(line)
            continue
        out.append(_LINK_OR_CODE.sub(fix, line))
    return "".join(out), missing


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    repo_root = Path(config["config_file_path"]).parent
    text, missing = rewrite(markdown, page.file.src_uri, repo_root, config.get("repo_url") or "")
    for target in missing:
        log.warning("Doc file '%s' links to '%s', which is not a file of the repository", page.file.src_uri, target)
    return text
