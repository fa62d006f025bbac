"""User-supplied strings reach the terminal escaped and cut (docs/faults.md rows 64-66): a file name or a label
holding a newline, CR, ESC or a bidi override cannot forge a line or move the cursor, and a 1,000,000-character
label is not echoed whole. The real start-up data check is run, as a user runs it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from conftest import TINY, make_folder, python_train

from scale_ocr.errors import printable, shown

FORGED = "scale-ocr: all samples OK"
EVIL = f"a\n{FORGED}\x1b[2J\r\u202e.png"  # the file name: a line of its own, clear screen, carriage return, RLO
# Every control character a terminal acts on, but the newline that ends each line.
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
LONGEST_LINE = 1000  # characters: one error line, whatever the folder holds

WORDS = {f"{i}.png": w for i, w in enumerate(["hello", "world", "scale", "ocr42", "Text", "CTC", "gloo", "rank"])}


def _folder(root: Path, label: str, image: bool = True) -> Path:
    from scale_ocr.data.synthetic import render_word, system_fonts

    make_folder(root, WORDS)
    if image:
        render_word("hi", np.random.default_rng(0), system_fonts()).save(root / "images" / EVIL, format="PNG")
    (root / "labels.json").write_text(json.dumps({**WORDS, EVIL: label}), encoding="utf-8")
    return root


def _assert_safe(proc) -> str:
    """The run printed no raw control character, no forged line and no over-long line; returns its error line."""
    text = proc.stdout + proc.stderr
    assert not RAW.search(text), repr(text[:2000])
    lines = text.splitlines()
    assert not any(ln.startswith(FORGED) for ln in lines) and "Traceback" not in text, text[:2000]
    assert max(map(len, lines)) <= LONGEST_LINE, max(map(len, lines))
    errors = [ln for ln in lines if ln.startswith("scale-ocr: error:")]
    assert proc.returncode == 2 and len(errors) == 1, text[:2000]
    return errors[0]


def test_shown_escapes_control_characters_and_states_the_length():
    assert shown("a\nb\x1b[2J\r\u202eé中") == "'a\\nb\\x1b[2J\\r\\u202eé中'"  # printable unicode stays
    assert shown("x" * 1_000_000) == "'" + "x" * 80 + "…' (1000000 characters)"
    assert shown(Path("/d/a\nb.png")) == "/d/a\\nb.png"  # a path unquoted, as messages write paths
    assert printable("ok é") == "ok é" and printable("\x9b\u2028", limit=1) == "\\x9b… (2 characters)"


def test_file_name_with_control_characters_cannot_forge_a_line(tmp_path):
    """Row 64: listed but missing, the name is echoed escaped in the one error line."""
    folder = _folder(tmp_path / "words", "hi", image=False)
    line = _assert_safe(python_train(["--train-path", str(folder), "--output-dir", str(tmp_path / "run"), *TINY]))
    assert "a\\nscale-ocr: all samples OK\\x1b[2J\\r\\u202e.png is listed" in line, line


def test_label_with_control_characters_is_escaped(tmp_path):
    folder = _folder(tmp_path / "words", f"a\n{FORGED}\x1b[2J")
    line = _assert_safe(python_train(["--train-path", str(folder), "--output-dir", str(tmp_path / "run"), *TINY]))
    assert "outside the vocabulary" in line and "'\\n \\x1b'" in line, line


def test_refused_million_character_label_is_not_echoed_whole(tmp_path):
    """Row 65: the label is cut, with its length stated."""
    folder = _folder(tmp_path / "words", "x" * 1_000_000)
    line = _assert_safe(python_train(["--train-path", str(folder), "--output-dir", str(tmp_path / "run"), *TINY]))
    assert "xxx…' (1000000 characters)" in line and "needs 1999999 CTC frames" in line, line


def test_predict_prints_one_escaped_line_per_image(tmp_path, capsys):
    """Row 66: ``scale-ocr predict`` writes NAME<TAB>WORD<TAB>CONFIDENCE; a name cannot add a line or a column."""
    from PIL import Image

    from scale_ocr.checkpoint.export import save_export
    from scale_ocr.cli.main import main as cli_main
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    task = create_task(ModelConfig(arch="vitstr_tiny", input_size=(16, 64), model_width=32, model_depth=1,
                                   model_heads=2, mlp_ratio=2.0, vocab="digits"))
    export = save_export(task.build_model(), task, tmp_path / "m.safetensors")
    image = tmp_path / f"w\t{EVIL}"
    Image.new("RGB", (64, 16), "white").save(image, format="PNG")
    assert cli_main(["predict", str(export), str(image)]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) == 1, repr(out)
    name, word, confidence = out.rstrip("\n").split("\t")  # the tabs are the separators, none is the name's
    assert not RAW.search(name + word) and name == printable(str(image)) and 0 <= float(confidence) <= 1
