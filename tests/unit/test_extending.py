"""docs/extending.md against the repository: the files and functions it names exist, each section says which
files to touch and which tests pick the new thing up, and those tests really loop over the registry (or read the
results index) they are said to."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "extending.md"
# What a test must call to pick up a new thing of each kind: the registry's listing (the results index for a
# benchmark). A test that names a fixed list instead would not see the new one.
PICKED_UP_BY = {
    "Add a strategy": ("list_strategies(",),
    "Add a model": ("list_models(",),
    "Add a task": ("registry._TASKS", "list_models("),
    "Add a benchmark": ('"results"',),
}
_CODE = re.compile(r"`([^`\n]+)`")
# A repository file: `dir/x.py`, or one of the top level's (a bare `__init__.py` is the one just named).
_PATH = re.compile(r"^[\w.-]+(/[\w.-]+)*/[\w.-]*\.\w+$|^(README\.md|mkdocs\.yml|pyproject\.toml|Makefile)$")
_DOTTED = re.compile(r"^(scale_ocr|benchmarks)(\.\w+)+$")  # a module attribute: `scale_ocr.models.list_models`


def sections(text: str | None = None) -> dict[str, str]:
    """The page's ``##`` sections by heading."""
    parts = re.split(r"^## (.+)$", text if text is not None else PAGE.read_text(encoding="utf-8"), flags=re.M)
    return {heading.strip(): body for heading, body in zip(parts[1::2], parts[2::2], strict=True)}


def part(body: str, label: str) -> str:
    """The bullet list under a section's bold ``**label**`` (items and their indented continuations)."""
    _, found, after = body.partition(f"**{label}**\n")
    lines = []
    for line in after.lstrip("\n").splitlines() if found else []:
        if line and not line.startswith(("- ", "  ")):
            break
        lines.append(line)
    return "\n".join(lines)


def named_files(text: str) -> list[str]:
    """Repository paths the text names in code spans; ``NAME`` marks the file a reader creates."""
    return [c for c in _CODE.findall(text) if _PATH.match(c) and "NAME" not in c]


def named_attributes(text: str) -> list[str]:
    return [c for c in _CODE.findall(text) if _DOTTED.match(c)]


def resolve(dotted: str) -> object:
    """``a.b.c.f`` imported as the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_the_page_says_how_to_add_each_kind_with_the_files_and_the_tests():
    found = sections()
    assert list(found) == list(PICKED_UP_BY)
    for heading, body in found.items():
        assert named_files(part(body, "Files to touch")), f"{heading}: no file to touch named"
        assert named_files(part(body, "Tests that pick it up")), f"{heading}: no test named"


def test_every_file_the_page_names_exists():
    missing = [f for f in named_files(PAGE.read_text(encoding="utf-8")) if not (REPO / f).exists()]
    assert missing == [], f"docs/extending.md names files that do not exist: {missing}"


def test_every_registry_function_and_class_the_page_names_exists():
    names = named_attributes(PAGE.read_text(encoding="utf-8"))
    assert {"scale_ocr.strategies.registry.register_strategy", "scale_ocr.models.registry.register_model",
            "scale_ocr.tasks.registry.register_task"} <= set(names)
    for name in names:
        try:
            obj = resolve(name)
        except (ImportError, AttributeError) as exc:
            pytest.fail(f"docs/extending.md names {name}, which does not exist ({exc})")
        assert callable(obj), name


@pytest.mark.parametrize("heading", list(PICKED_UP_BY))
def test_the_tests_said_to_pick_up_a_new_one_loop_over_its_registry(heading):
    tests = [f for f in named_files(part(sections()[heading], "Tests that pick it up")) if f.startswith("tests/")]
    assert tests, heading
    for test in tests:
        text = (REPO / test).read_text(encoding="utf-8")
        assert any(call in text for call in PICKED_UP_BY[heading]), (
            f"{heading}: docs/extending.md says {test} picks a new one up, but it never calls "
            f"{' or '.join(PICKED_UP_BY[heading])}")


@pytest.mark.parametrize(("heading", "call"), [("Add a strategy", "register_strategy("),
                                               ("Add a model", "@register_model"),
                                               ("Add a task", "@register_task")])
def test_the_files_shown_as_examples_register_as_the_page_says(heading, call):
    """Where a section points at an existing file as its example (or the one to add a line to), that file makes
    the registration call the page describes."""
    files = [f for f in named_files(part(sections()[heading], "Files to touch")) if f.startswith("scale_ocr/")]
    assert any(call in (REPO / f).read_text(encoding="utf-8") for f in files if (REPO / f).is_file()), (
        f"{heading}: none of {files} calls {call}")

