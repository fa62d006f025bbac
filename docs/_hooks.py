"""mkdocs hook: the repository's own files join the site, so docs/ can link to them and strict mode checks it.

The topic pages link to Markdown outside docs/ as GitHub resolves it (``../benchmarks/results/README.md#overhead``,
``../ds_configs/README.md``). mkdocs knows only docs/, so on its own every such link is "not found". Here each
repository file outside docs/ is added to the build under the path such a link resolves to (``../<path>``):
Markdown files become pages (their headings are anchors, their own links are checked too), other files are
copied as they are (a report's plots). They are written under ``repo/`` in the site and stay out of the nav.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

REPO = Path(__file__).resolve().parent.parent
SITE_PREFIX = "repo"  # where repository files land in the built site
SKIP_TOP = {"docs", "site", "README.md", "mkdocs.yml"}  # docs/ is the site (site/ its default output); README: the front door
_SKIP_DIRS = {".git", ".venv", "__pycache__", "runs", "site", "wandb", "node_modules"}


def _repository_files() -> list[str]:
    """Files git would track (tracked, or new and not ignored), as repository-relative POSIX paths."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                             capture_output=True, check=True).stdout.decode()
        paths = [p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # no git (an unpacked archive): walk the tree instead
        paths = []
        for root, dirs, names in os.walk(REPO):
            dirs[:] = [d for d in dirs if d not in _SKIP_DIRS and not d.startswith(".") and not d.endswith(".egg-info")]
            paths += [Path(root, n).relative_to(REPO).as_posix() for n in names]
    return sorted(p for p in paths if p.split("/")[0] not in SKIP_TOP and (REPO / p).is_file())


def _repository_file(path: str, config) -> File:
    """``path`` as a file of the build: found by links as ``../path``, written to ``repo/path``."""
    f = File(f"../{path}", src_dir=str(REPO / "docs"), dest_dir=config.site_dir,
             use_directory_urls=config.use_directory_urls, inclusion=InclusionLevel.NOT_IN_NAV)
    placed = File(f"{SITE_PREFIX}/{path}", src_dir=None, dest_dir=config.site_dir,
                  use_directory_urls=config.use_directory_urls)
    f.dest_uri = placed.dest_uri
    return f


def on_files(files: Files, config) -> Files:
    """Add every repository file outside docs/ (see the module docstring)."""
    for path in _repository_files():
        files.append(_repository_file(path, config))
    return files


_FOLDER_LINK = re.compile(r"\]\((?!\w+:)([^)\s#]+/)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """A link to a report folder (``overhead-vm-.../``) means its report: GitHub lists the folder, the site has
    no folder pages. Only repository pages outside docs/ get this; a topic page links to the file itself."""
    if not page.file.src_uri.startswith("../"):
        return markdown
    here = (REPO / "docs" / page.file.src_uri).resolve().parent

    def to_report(match: re.Match) -> str:
        folder = (here / match.group(1)).resolve()
        for name in ("report.md", "README.md", "NOTE.md"):
            if (folder / name).is_file():
                return f"]({match.group(1)}{name}{match.group(2) or ''})"
        return match.group(0)  # no page to stand for it: left as is, and strict mode names the link

    return _FOLDER_LINK.sub(to_report, markdown)
