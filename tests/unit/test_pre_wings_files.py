"""Files written before the package was laid out in wings (git 8eb7ad2) still load, resume and export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from scale_ocr.checkpoint.export import export, load_any
from tests.conftest import REPO, python_train

OLD = REPO / "tests" / "fixtures" / "pre_wings"
EXPECTED = json.loads((OLD / "expected.json").read_text())
# The old run's model flags: a resumed run must describe the same model.
MODEL = ["vitstr_tiny", "--strategy", "single", "--model-width", "32", "--model-depth", "1", "--model-heads", "2",
         "--mlp-ratio", "2", "--input-size", "16x64", "--vocab", "digits", "--train-samples", "64",
         "--val-samples", "16", "-b", "16", "--wandb-mode", "disabled"]


def first_logits(path: Path) -> list[float]:
    loaded = load_any(path)
    torch.manual_seed(EXPECTED["seed"])
    images = torch.rand(*EXPECTED["images"])
    with torch.no_grad():
        return loaded.model.eval()(images)["logits"].flatten()[:64].tolist()


@pytest.mark.parametrize("name", sorted(EXPECTED["logits_first_64"]))
def test_old_file_loads_to_the_same_model(name):
    assert first_logits(OLD / name) == pytest.approx(EXPECTED["logits_first_64"][name], abs=1e-6)
    assert load_any(OLD / name).task.identity() == EXPECTED["identity"]


def test_old_checkpoint_exports(tmp_path):
    out = export(OLD / "run" / "checkpoints" / "step_00000002", tmp_path / "model.safetensors", "safetensors")
    assert first_logits(out) == pytest.approx(EXPECTED["logits_first_64"]["model.safetensors"], abs=1e-6)


def test_old_checkpoint_resumes(tmp_path):
    ckpt = shutil.copytree(OLD / "run" / "checkpoints" / "step_00000002", tmp_path / "old" / "step_00000002")
    proc = python_train([*MODEL, "--max-steps", "3", "--resume", str(ckpt), "--output-dir", str(tmp_path / "run")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"resumed from {ckpt} at step 2" in proc.stdout
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 3
