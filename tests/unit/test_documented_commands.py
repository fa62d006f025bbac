"""Every training command line the README and docs show parses with today's flags (the layout may move, the
commands users copy may not break)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from scale_ocr.cli.args import build_parser
from scale_ocr.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LAUNCH = re.compile(r"(?:^|\s)(?:scale_ocr/train\.py|scale-ocr train)(?=\s|$)")


def shell_blocks(text: str) -> list[str]:
    """The lines of fenced shell blocks, with backslash continuations joined."""
    blocks = re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        for line in shell_blocks(page.read_text(encoding="utf-8")):
            match = LAUNCH.search(line)
            if match:
                args = shlex.split(line[match.end():], comments=True)
                found.append((f"{page.relative_to(ROOT)}: {line.strip()[:90]}", args))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_training_commands():
    assert len(COMMANDS) >= 7, COMMANDS  # the README's launch examples at least


@pytest.mark.parametrize("args", [args for _, args in COMMANDS], ids=[where for where, _ in COMMANDS])
def test_documented_command_parses(args):
    try:
        build_parser().parse_args(args)
    except UserError as exc:  # the training parser's way of refusing a flag (one line, from rank 0)
        pytest.fail(f"the documented flags {args} no longer parse ({exc})")
