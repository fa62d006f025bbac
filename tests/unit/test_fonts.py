"""The fonts synthetic words and pages are drawn in (scale_ocr/data/fonts.py, ``--fonts``)."""

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import ImageFont

from scale_ocr.config import DataConfig
from scale_ocr.data import fonts
from scale_ocr.data.synthetic import SyntheticWords, system_fonts
from scale_ocr.errors import UserError
from scale_ocr.vocab import VOCABS

REPO = Path(__file__).resolve().parents[2]


def documented_packages() -> list[str]:
    """FONT_PKGS of the Makefile: the set `make install` installs."""
    text = (REPO / "Makefile").read_text()
    return re.search(r"^FONT_PKGS := (.*?)\n\S", text, re.S | re.M).group(1).replace("\\", " ").split()


def tiny_font(path: Path, chars: str) -> Path:
    """A TrueType font named "Tiny Test" whose character map draws only ``chars`` (each a filled box)."""
    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    names = [".notdef", *(f"g{ord(c)}" for c in chars)]
    builder = FontBuilder(1000, isTTF=True)
    builder.setupGlyphOrder(names)
    builder.setupCharacterMap({ord(c): f"g{ord(c)}" for c in chars})
    glyphs = {}
    for name in names:
        pen = TTGlyphPen(None)
        pen.moveTo((50, 0)), pen.lineTo((50, 700)), pen.lineTo((450, 700)), pen.lineTo((450, 0)), pen.closePath()
        glyphs[name] = pen.glyph()
    builder.setupGlyf(glyphs)
    builder.setupHorizontalMetrics({n: (500, 50) for n in names})
    builder.setupHorizontalHeader(ascent=800, descent=-200)
    builder.setupNameTable({"familyName": "Tiny Test", "styleName": "Regular"})
    builder.setupOS2()
    builder.setupPost()
    path.parent.mkdir(parents=True, exist_ok=True)
    builder.save(str(path))
    return path


def test_every_vocabulary_character_draws_in_each_default_font():
    """Every face the default selection keeps draws each character of the default vocabulary as ink that is not its
    missing-glyph box; after `make install`, in 20 families at least (issue 56, acceptance 2)."""
    vocab = VOCABS["latin"]
    chosen = fonts.select(fonts.DEFAULT, vocab)
    missing = [p for p in documented_packages()
               if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if missing:
        pytest.skip(f"fonts not installed: {' '.join(missing)} (`make install` as root installs them)")
    assert len(chosen.families) >= 20, chosen.line()
    for face in chosen.faces:
        font = ImageFont.truetype(face.path, 24)
        notdef = np.asarray(font.getmask("\U0010fffd"))  # unmapped: the face's missing-glyph drawing
        for char in vocab.replace(" ", ""):
            mask = font.getmask(char)
            assert mask.getbbox() is not None, f"{face.path} draws no ink for {char!r}"
            drawn = np.asarray(mask)
            assert drawn.shape != notdef.shape or not np.array_equal(drawn, notdef), f"{face.path}: {char!r} is a box"


def test_a_selection_skips_and_counts_fonts_that_lack_a_character(tmp_path):
    """A face without a vocabulary character is skipped and counted, not drawn as boxes; items match families (any
    case, globs), folders and file globs; `classic` keeps the records' faces and order; a selection that matches no
    font, or draws no face, is refused in one line; words in the chosen faces are the same for the same seed."""
    folder = tmp_path / "fonts"
    tiny_font(folder / "tiny-ab.ttf", "ab")
    tiny_font(folder / "tiny-abc.ttf", "abc")
    chosen = fonts.select([str(folder), "classic"], "abc")
    assert [Path(p).name for p in chosen.paths][:1] == ["tiny-abc.ttf"]
    assert chosen.skipped == {str(folder / "tiny-ab.ttf"): "'c'"}
    assert "1 skipped: they lack a vocabulary character (e.g. tiny-ab.ttf has no 'c')" in chosen.line()
    classic = fonts.select(["classic"], "abc")
    assert classic.paths == system_fonts() and classic.spacing == (0.0, 0.0)
    assert fonts.select([str(folder / "tiny-a*.ttf")], "ab").families == ("Tiny Test",)
    with pytest.raises(UserError, match=r"--fonts 'No Such Family\*' matches no font file"):
        fonts.select(["No Such Family*"], "abc")
    with pytest.raises(UserError, match=r"none of its 2 fonts draws every character of the vocabulary \(e.g. "
                                         r"tiny-ab.ttf has no 'c' 'd'\)"):
        fonts.select([str(folder)], "abcd")
    with pytest.raises(UserError, match="matches no font file"):  # the run's own path: refused before any word
        fonts.synthetic_fonts(DataConfig(fonts=("No Such Family",)), "abc")
    assert fonts.synthetic_fonts(DataConfig(train_path=(str(tmp_path),), val_path=(str(tmp_path),),
                                            fonts=("No Such Family",)), "abc") is None  # no synthetic data drawn
    some = fonts.select(["DejaVu Sans", "dejavu serif"], VOCABS["latin"])
    assert some.families == ("DejaVu Sans", "DejaVu Serif") and some.spacing == fonts.SPACING
    a, b = (SyntheticWords(VOCABS["latin"], 6, 3, 8, seed=4, fonts=some) for _ in range(2))
    assert all(np.array_equal(np.asarray(a.sample(i)[0]), np.asarray(b.sample(i)[0])) for i in range(6))
