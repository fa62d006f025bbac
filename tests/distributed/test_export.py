"""export -> predict on a model trained under ZeRO-3: the same words and confidences as the live model."""

from __future__ import annotations

import sys

import pytest
from conftest import make_folder, run_cmd

from scale_ocr.errors import UserError
from scale_ocr.export import load_any, predict


@pytest.mark.slow
def test_export_then_predict_matches_live_model(tmp_path, saved):
    run_dir = saved("zero3").parents[1]  # 2 ranks under ZeRO-3, shared with the resume matrix
    out = tmp_path / "model.safetensors"
    proc = run_cmd([sys.executable, "-m", "scale_ocr", "export", str(run_dir), str(out)])
    assert proc.returncode == 0, proc.stderr[-2000:]

    folder = make_folder(tmp_path / "imgs", {f"{i}.png": w for i, w in enumerate(["abc", "word", "42", "XyZ"])})
    images = sorted(str(p) for p in (folder / "images").iterdir())
    exported = load_any(out)
    assert exported.arch == "crnn_mobilenet_v3_small" and exported.task.input_size == (32, 128)
    from_export = predict(exported, images)

    # The live model: the weights the run saved at its end, loaded from the run's own file.
    live = load_any(run_dir / "last_model.pt")
    from_live = predict(live, images)
    assert [r["word"] for r in from_export] == [r["word"] for r in from_live]
    assert [r["confidence"] for r in from_export] == pytest.approx([r["confidence"] for r in from_live], abs=1e-6)

    proc = run_cmd([sys.executable, "-m", "scale_ocr", "predict", str(out), *images])
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4 and lines[0].split("\t")[0] == images[0]


def test_truncated_export_is_one_clear_error(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    with pytest.raises(UserError, match="not a readable safetensors export"):
        load_any(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_any(tmp_path / "missing")
