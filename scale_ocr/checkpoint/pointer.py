"""``checkpoints/latest``: the one file that says which ``step_N`` folder beside it is a run's newest checkpoint.

Every reader goes through here, so none follows it out of its folder: a pointer naming anything but a ``step_N``
beside it is refused in one line, never read as a path.
"""

from __future__ import annotations

import re
from pathlib import Path

from scale_ocr.disk import KiB, read_user_text
from scale_ocr.errors import UserError, printable

POINTER = "latest"
STEP_NAME = re.compile(r"step_\d+")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def pointed_checkpoint(checkpoints: Path) -> Path | None:
    """The folder ``checkpoints/latest`` names (complete or not); None where there is no pointer."""
    pointer = checkpoints / POINTER
    if not pointer.is_file():
        return None
    try:
        name = read_user_text(pointer, what="the checkpoint pointer", limit=KiB).strip()
    except UserError:  # a link, a FIFO, not UTF-8, too long for a folder's name
        name = "(unreadable)"
    if not STEP_NAME.fullmatch(name):
        raise UserError(f"{printable(str(pointer), 300)} names {printable(name, 60)!r}, not a step_N folder beside "
                        "it: the pointer is damaged; pass a checkpoints/step_N folder itself")
    return checkpoints / name


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The complete checkpoint (its ``trainer.json`` written) that ``checkpoints/latest`` names; None before one."""
    path = pointed_checkpoint(checkpoints)
    return path if path is not None and (path / "trainer.json").is_file() else None


def checkpoint_folder(path: Path) -> Path:
    """The checkpoint a user's path means: a run directory's or a ``checkpoints`` folder's newest, the one its
    pointer names; any other path as it is (a ``step_N`` folder)."""
    for checkpoints in (path / "checkpoints", path):
        named = pointed_checkpoint(checkpoints)
        if named is not None:
            return named
    return path
