"""The documentation: the CLI reference matches the CLI, the site builds in strict mode, the README's links resolve,
and the lists kept in several places (pages, benchmarks) match their one source: mkdocs.yml's nav for the pages,
the results index's sections (benchmarks/results/README.md) for the benchmarks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scale_ocr.cli import reference

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MKDOCS_YML = REPO / "mkdocs.yml"
DOCS_HOME = REPO / "docs" / "index.md"
RESULTS_INDEX = REPO / "benchmarks" / "results" / "README.md"
BENCHMARKS_README = REPO / "benchmarks" / "README.md"
README_MAX_LINES = 200


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_cli_reference_is_current():
    current = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert current == reference.render(), (
        f"docs/cli.md differs from the config's flags: run `{reference.REGENERATE}` and commit docs/cli.md")


def test_cli_reference_lists_every_command_and_flag():
    from scale_ocr.cli.args import build_parser
    from scale_ocr.cli.main import COMMANDS

    text = reference.render()
    assert all(f"`scale-ocr {name}`" in text for name in COMMANDS)
    flags = {s for a in build_parser()._actions for s in a.option_strings if s not in ("-h", "--help")}
    assert {f for f in flags if f"`{f}" not in text} == set()


def test_docs_site_builds_in_strict_mode(tmp_path):
    result = _mkdocs_build(MKDOCS_YML, tmp_path / "site")
    assert result.returncode == 0, "mkdocs build --strict failed:\n" + result.stderr[-4000:]
    assert (tmp_path / "site" / "cli.html").is_file()


@pytest.mark.parametrize(("link", "fails"), [
    ("strategies.md", False),
    ("no-such-page.md", True),
    ("strategies.md#no-such-heading", True),
    ("../ds_configs/README.md#why-these-bucket-sizes", False),  # a repository page outside docs/, via the hook
    ("../ds_configs/README.md#no-such-heading", True),
    ("../no/such/file.md", True),
])
def test_strict_build_fails_on_a_broken_link(tmp_path, link, fails):
    """The real config (strict, link validation, the hook) against a two-page site with one link in it."""
    config = yaml.safe_load(MKDOCS_YML.read_text(encoding="utf-8"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# Home\n\nSee [this]({link}).\n", encoding="utf-8")
    (docs / "strategies.md").write_text("# Strategies\n\n## Same maths\n\nText.\n", encoding="utf-8")
    config.update(docs_dir=str(docs), hooks=[str(REPO / "docs" / "_hooks.py")],
                  nav=[{"Home": "index.md"}, {"Strategies": "strategies.md"}])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
    result = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert (result.returncode != 0) == fails, result.stderr[-3000:]
    if fails:
        assert link.split("#")[-1] in result.stderr


def test_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; topic text belongs in docs/"
    assert lines[2:6] == ["```bash", lines[3], lines[4], "```"] and lines[3].startswith("make demo") \
        and lines[4].startswith("make test"), "README.md starts with `make demo` and `make test`"


_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    text = _FENCE.sub("", markdown.read_text(encoding="utf-8"))  # a "# comment" in a code block is no heading
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _broken_links(markdown: Path) -> list[str]:
    """Relative links of a Markdown file whose target file, or heading, does not exist."""
    broken = []
    for target in _LINK.findall(_CODE.sub("", markdown.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (markdown.parent / path).resolve() if path else markdown
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: {file.name} has no heading with that anchor")
    return broken


def test_readme_links_resolve():
    assert _broken_links(README) == []


def test_link_check_finds_broken_links(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## The `x` part (y)\n", encoding="utf-8")
    page.write_text("# Page\n\n[a](other.md#the-x-part-y) [b](other.md#nope) [c](gone.md) [d](#page) "
                    "`[e](in-code.md)` [f](https://example.com/x)\n", encoding="utf-8")
    assert _broken_links(page) == ["other.md#nope: other.md has no heading with that anchor", "gone.md: no such file"]


# The lists kept in several places. Each page list (the README's, the docs home page's) is a table of links to
# docs/ pages under one heading; each benchmark list links to the results index's sections under one heading.
PAGE_LISTS = {"README.md": (README, "Documentation", "docs/"), "docs/index.md": (DOCS_HOME, "Pages", "")}
BENCHMARK_LISTS = {"README.md": (README, "Benchmarks", "benchmarks/results/README.md#"),
                   "docs/index.md": (DOCS_HOME, "Benchmarks", "../benchmarks/results/README.md#")}


def _nav() -> list[tuple[str, str]]:
    """``(title, page)`` of every page in mkdocs.yml's nav, in order, sections flattened."""
    def walk(items):
        for item in items:
            for title, value in item.items():
                yield from walk(value) if isinstance(value, list) else [(title, value)]
    return list(walk(yaml.safe_load(MKDOCS_YML.read_text(encoding="utf-8"))["nav"]))


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section (up to the next ``##``), code blocks left out."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", _FENCE.sub("", text), flags=re.S | re.M)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def _listed(text: str, heading: str, prefix: str) -> list[tuple[str, str]]:
    """``(link text, target without prefix)`` of the links under ``## heading`` whose target starts with ``prefix``."""
    body = _section(text, heading)
    return [(label, target[len(prefix):]) for label, target in re.findall(r"\[([^\]]+)\]\(([^)\s]+)\)", body)
            if target.startswith(prefix)]


def _page_list(text: str, heading: str, prefix: str) -> list[tuple[str, str]]:
    """The page table's rows under ``heading``: ``(title, page)`` of each row's first-cell link to a .md page."""
    rows = [row for row in _section(text, heading).splitlines() if row.startswith("| [")]
    return [link for row in rows for link in _listed(f"## x\n{row.split(' | ')[0]}\n", "x", prefix)]


def _index_benchmarks() -> list[str]:
    return re.findall(r"^## (.+)$", RESULTS_INDEX.read_text(encoding="utf-8"), flags=re.M)


def test_every_docs_page_is_in_the_nav():
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    nav = {page for _, page in _nav()}
    assert pages == nav, f"docs/ pages not in mkdocs.yml's nav: {sorted(pages - nav)}; nav pages missing from " \
                         f"docs/: {sorted(nav - pages)}"


@pytest.mark.parametrize("where", PAGE_LISTS)
def test_a_page_list_names_every_page_of_the_nav_in_its_order(where):
    path, heading, prefix = PAGE_LISTS[where]
    listed = [page for _, page in _page_list(path.read_text(encoding="utf-8"), heading, prefix)]
    nav = [page for _, page in _nav() if page != "index.md"]  # the home page lists the others
    missing, extra = [p for p in nav if p not in listed], [p for p in listed if p not in nav]
    assert listed == nav, (f"{where}'s '{heading}' table differs from mkdocs.yml's nav: missing {missing}, not in "
                           f"the nav {extra}, or in another order")


@pytest.mark.parametrize("where", PAGE_LISTS)
def test_a_page_list_uses_the_navs_titles(where):
    path, heading, prefix = PAGE_LISTS[where]
    titles = dict((page, title) for title, page in _nav())
    wrong = [(title, page, titles.get(page)) for title, page in _page_list(path.read_text(encoding="utf-8"), heading,
                                                                           prefix) if titles.get(page) != title]
    assert wrong == [], f"{where}: (title, page, mkdocs.yml's title) {wrong}"


@pytest.mark.parametrize("where", BENCHMARK_LISTS)
def test_a_benchmark_list_names_every_benchmark_of_the_results_index(where):
    path, heading, prefix = BENCHMARK_LISTS[where]
    listed = {target for _, target in _listed(path.read_text(encoding="utf-8"), heading, prefix)}
    index = _index_benchmarks()
    assert set(index) == listed, (f"{where}'s '{heading}' misses {[b for b in index if b not in listed]} of "
                                  f"benchmarks/results/README.md, and names {sorted(listed - set(index))} it has not")


def test_benchmarks_readme_has_one_section_per_benchmark_of_the_results_index():
    headings = re.findall(r"^## (.+)$", _FENCE.sub("", BENCHMARKS_README.read_text(encoding="utf-8")), flags=re.M)
    assert sorted(headings) == sorted(_index_benchmarks())



def test_every_fault_row_names_tests_that_exist():
    """docs/faults.md's table of cases: each row names its test, and each test it names exists."""
    files = list((REPO / "tests").rglob("*.py"))
    defined = {m for p in files
               for m in re.findall(r"^\s*(?:async )?def (test_\w+)", p.read_text(encoding="utf-8"), re.M)}
    defined |= {p.stem for p in files}  # a row may name the test file that holds its cases
    rows = [ln for ln in (REPO / "docs" / "faults.md").read_text(encoding="utf-8").splitlines()
            if re.match(r"\| [A-Z]?\d+ \|", ln) and ln.count(" | ") >= 5]
    assert len(rows) > 100
    missing, untested = [], []
    for row in rows:
        named = re.findall(r"`(test_\w+)", row.rsplit("|", 2)[-2])
        untested += [] if named or "same test" in row.rsplit("|", 2)[-2] else [row[:60]]  # the row above's
        cut = set(re.findall(r"`(test_\w+)\.\.\.", row))  # a name cut short, ending in "..."
        missing += [f"{row.split('|')[1].strip()}: {n}" for n in named
                    if n not in defined and not (n in cut and any(d.startswith(n) for d in defined))]
    assert not untested, f"rows without a test: {untested}"
    assert not missing, f"rows naming tests that do not exist: {missing}"
