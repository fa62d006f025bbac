"""export -> predict on a model trained under ZeRO-3: the same words and confidences as the live model."""

from __future__ import annotations

import json

import pytest
from conftest import make_folder

from scale_ocr.checkpoint.export import load_any
from scale_ocr.cli.main import main as cli_main
from scale_ocr.cli.page_ocr import predict
from scale_ocr.errors import UserError


@pytest.mark.slow
def test_export_then_predict_matches_live_model(tmp_path, saved, capsys):
    run_dir = saved("zero3").parents[1]  # 2 ranks under ZeRO-3, shared with the resume matrix
    out = tmp_path / "model.safetensors"
    assert cli_main(["export", str(run_dir), str(out)]) == 0  # the CLI, in this process

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

    capsys.readouterr()
    assert cli_main(["predict", str(out), *images]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[0].split("\t")[0] == images[0]

    # scale_ocr's CRNN is docTR's: --format doctr gives docTR's class the same logits (its blank last, not first)
    import doctr.models
    import torch

    assert cli_main(["export", str(run_dir), str(tmp_path / "reco.pt"), "--format", "doctr"]) == 0
    info = json.loads((tmp_path / "reco.json").read_text(encoding="utf-8"))
    theirs = doctr.models.crnn_mobilenet_v3_small(pretrained=False, pretrained_backbone=False, vocab=info["vocab"])
    theirs.load_state_dict(torch.load(tmp_path / "reco.pt", weights_only=True), strict=True)
    x = torch.randn(2, 3, 32, 128)
    with torch.no_grad():
        a, b = live.model(x)["logits"], theirs.eval()(x, return_model_output=True)["out_map"]
    torch.testing.assert_close(torch.cat([a[..., 1:], a[..., :1]], -1), b, rtol=0, atol=1e-5)


def test_truncated_export_is_one_clear_error(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    with pytest.raises(UserError, match="not a readable safetensors export"):
        load_any(bad)
    with pytest.raises(UserError, match="does not exist"):
        load_any(tmp_path / "missing")
