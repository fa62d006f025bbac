"""The fonts synthetic words and pages are drawn in (``--fonts``; docs/data.md, "Fonts").

A selection is a list of items, each matching at least one font file:

- ``installed`` (the default): every text font this host has, as fontconfig lists them (``fc-list``; without it,
  the usual font folders), less the faces that do not draw text (:data:`NOT_TEXT`: symbols, dingbats, math, keycaps,
  initials);
- ``classic``: the four upright DejaVu faces scale_ocr drew every synthetic word in before ``--fonts``, which the
  benchmark records made until 2026-12-07 use (:func:`~scale_ocr.data.synthetic.system_fonts`);
- a folder: every font file under it;
- a path or a path glob (it holds a ``/``): those font files;
- anything else: a family name or a family glob, any case (``"DejaVu Sans"``, ``"Liberation*"``, ``"CMU *"``),
  matched against each file's own family name.

Only OpenType/TrueType files are read (``.ttf``, ``.otf``, ``.ttc``: the first face of a collection). Every face of a
family is drawn (regular, bold, italic, condensed: the weights and slants vary with the faces). A face whose
character map lacks a character of the vocabulary would draw that character as a box or nothing under a label that
names it: it is skipped and counted (:attr:`FontSet.skipped`), and the run's log line says how many.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from scale_ocr.errors import UserError

SUFFIXES = (".ttf", ".otf", ".ttc")
FONT_DIRS = ("/usr/share/fonts", "/usr/local/share/fonts", "~/.local/share/fonts", "~/.fonts")
# Families `installed` leaves out: they map letters to pictures, formulas, keycaps or drop caps, so a word drawn in
# them is not that word. Name them explicitly to draw them anyway.
NOT_TEXT = ("*symbol*", "*dingbat*", "d050000l", "* math*", "*keyboard*", "*initials*")
DEFAULT = ("installed",)
# Letter spacing a word is set with, in ems (tracking; text on pages is set loose and tight): drawn per word for
# selections other than `classic`, whose words stay as the records drew them.
SPACING = (-0.04, 0.12)


FORMAT = "%{file}\t%{family[0]}\t%{style[0]}\t%{charset}\n"  # fontconfig's cached facts of each face


@dataclass(frozen=True)
class Face:
    """One font file: its family and style names and the code points it draws (``ranges``: inclusive pairs)."""

    path: str
    family: str
    style: str
    ranges: tuple[tuple[int, int], ...] = ()

    def lacks(self, code_points: set[int]) -> list[int]:
        return sorted(c for c in code_points if not any(lo <= c <= hi for lo, hi in self.ranges))


@dataclass(frozen=True)
class FontSet:
    """The faces a generator draws from, in a fixed order (the draws are deterministic by seed on hosts with the same
    fonts), the families they make, the faces skipped for a missing vocabulary character (path: the first few it
    lacks), and the per-word letter spacing range in ems (``(0, 0)``: none, and no random draw for it)."""

    faces: tuple[Face, ...]
    skipped: dict[str, str] = field(default_factory=dict)
    spacing: tuple[float, float] = (0.0, 0.0)
    selection: tuple[str, ...] = DEFAULT

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.faces)

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(sorted({f.family for f in self.faces}))

    def line(self) -> str:
        """The run's log line about its fonts."""
        if not self.faces:
            return ("synthetic fonts: none installed, so Pillow's own face draws every word (`make install` installs "
                    "the documented set: docs/data.md, \"Fonts\")")
        shown = ", ".join(self.families[:6]) + (", ..." if len(self.families) > 6 else "")
        skipped = (f"; {len(self.skipped)} skipped: they lack a vocabulary character (e.g. "
                   f"{Path(next(iter(self.skipped))).name} has no {next(iter(self.skipped.values()))})"
                   if self.skipped else "")
        return (f"synthetic fonts ({' '.join(self.selection)}): {len(self.families)} families, {len(self.faces)} "
                f"faces ({shown}){skipped}")


def _fontconfig(args: list[str]) -> list[Face] | None:
    """Faces as fontconfig reads them (``fc-list``, or ``fc-scan`` of files and folders): in C, cached, 30 ms for
    300 faces where fontTools takes 3 s. None without fontconfig's tools."""
    if not shutil.which(args[0]):
        return None
    try:
        listed = subprocess.run([*args[:1], "--format", FORMAT, *args[1:]], capture_output=True, text=True,
                                timeout=120, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    faces = []
    for row in listed.splitlines():
        path, family, style, charset = (row.split("\t") + ["", "", ""])[:4]
        if path.lower().endswith(SUFFIXES) and os.path.isfile(path):
            ranges = tuple((int(a, 16), int(b or a, 16)) for a, _, b in (r.partition("-") for r in charset.split()))
            faces.append(Face(os.path.normpath(path), family or Path(path).stem, style, ranges))
    return faces


def _fonttools(path: str) -> Face | None:
    """One face read by fontTools, where fontconfig's tools are missing (None: not a font it can read)."""
    from fontTools.ttLib import TTFont

    try:
        font = TTFont(path, lazy=True, fontNumber=0)
        names = font["name"]
        drawn = sorted(c for c, glyph in (font.getBestCmap() or {}).items() if glyph != ".notdef")
    except Exception:  # noqa: BLE001 - any unreadable or truncated file is "not a font"
        return None
    family = names.getDebugName(16) or names.getDebugName(1) or Path(path).stem
    return Face(path, family, names.getDebugName(17) or names.getDebugName(2) or "", tuple((c, c) for c in drawn))


def faces_of(paths: list[str]) -> list[Face]:
    """The faces of these font files (one per file: a collection's first)."""
    if not paths:
        return []
    read = _fontconfig(["fc-scan", *paths])
    return read if read is not None else [f for f in map(_fonttools, paths) if f is not None]


@functools.lru_cache(maxsize=1)
def installed() -> tuple[Face, ...]:
    """Every OpenType/TrueType face fontconfig lists, or (without its tools) the usual font folders hold."""
    listed = _fontconfig(["fc-list"])
    if listed is None:
        listed = faces_of([p for folder in FONT_DIRS for p in files_under(os.path.expanduser(folder))])
    return tuple(sorted({f.path: f for f in listed}.values(), key=lambda f: f.path))


def files_under(folder: str) -> list[str]:
    return sorted(p for p in glob.glob(os.path.join(folder, "**", "*"), recursive=True)
                  if p.lower().endswith(SUFFIXES) and os.path.isfile(p))


def match(item: str) -> list[Face]:
    """The faces one selection item names (module docstring)."""
    from scale_ocr.data.synthetic import system_fonts

    if item == "installed":
        return [f for f in installed() if not any(fnmatch.fnmatch(f.family.casefold(), p) for p in NOT_TEXT)]
    if item == "classic":  # in system_fonts()' order, which the records' draws index
        order = {os.path.normpath(p): i for i, p in enumerate(system_fonts())}
        return sorted(faces_of(list(order)), key=lambda f: order.get(f.path, len(order)))
    path = os.path.expanduser(item)
    if os.path.isdir(path):
        return sorted(faces_of(files_under(path)), key=lambda f: f.path)
    if "/" in item or item.lower().endswith(SUFFIXES):
        files = [p for p in glob.glob(path, recursive=True) if p.lower().endswith(SUFFIXES)]
        return sorted(faces_of(files), key=lambda f: f.path)
    pattern = item.casefold()
    return [f for f in installed() if fnmatch.fnmatch(f.family.casefold(), pattern)]


def select(selection: tuple[str, ...] | list[str], charset: str) -> FontSet:
    """The faces ``selection`` names that draw every character of ``charset`` (spaces aside); the others skipped and
    counted. Refused in one line (:class:`UserError`) when an item matches no font or no face draws the vocabulary."""
    selection = tuple(selection) or DEFAULT
    chosen: dict[str, Face] = {}
    for item in selection:
        faces = match(item)
        if not faces and item != "installed":  # a host without fonts draws in Pillow's own face, said in line()
            families = sorted({f.family for f in installed()})
            hint = (f"installed families include {', '.join(families[:8])}" if families else
                    "no font is installed: `make install` installs the documented set (docs/data.md, \"Fonts\")")
            raise UserError(f"--fonts {item!r} matches no font file (a family name or glob, a folder, a file glob, "
                            f"installed or classic); {hint}")
        chosen.update((f.path, f) for f in faces)
    if not chosen:
        return FontSet((), {}, (0.0, 0.0), selection)
    needed = {ord(c) for c in charset if not c.isspace()}
    kept, skipped = [], {}
    for path in chosen:  # in the selection's order: each item's faces by path (classic's as the records drew them)
        missing = chosen[path].lacks(needed)
        if missing:
            skipped[path] = " ".join(repr(chr(c)) for c in missing[:3]) + (" ..." if len(missing) > 3 else "")
        else:
            kept.append(chosen[path])
    if not kept:
        raise UserError(f"--fonts {' '.join(selection)}: none of its {len(chosen)} fonts draws every character of the "
                        f"vocabulary (e.g. {Path(next(iter(skipped))).name} has no {next(iter(skipped.values()))}); "
                        "select fonts that cover it, or a smaller --vocab")
    spacing = (0.0, 0.0) if selection == ("classic",) else SPACING
    return FontSet(tuple(kept), skipped, spacing, selection)


def synthetic_fonts(cfg, charset: str) -> FontSet | None:
    """The fonts a run's synthetic data is drawn in (``cfg``: its DataConfig), its line said once; None when the run
    draws none (both sets are folders or shards without `synthetic` in a mix, or it reads a cache)."""
    from scale_ocr.data.mix import draws_synthetic
    from scale_ocr.errors import say

    if not draws_synthetic(cfg):
        return None
    fonts = select(cfg.fonts, charset)
    say(fonts.line(), every_rank=False)
    return fonts
