"""A model file's claimed identity cannot make scale-ocr allocate: it is checked against the registry's bounds and
against the tensors in the file (counted, and the claim built on the meta device) before anything is built.

The files are written here from a tiny model, as a run and ``scale-ocr export`` write them, then crafted; nothing
is trained. A crafted claim that were built for real would need terabytes, so an exit with one line (code 2) is
the proof that nothing was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from scale_ocr.checkpoint.export import save_export
from scale_ocr.cli.main import main as cli_main
from scale_ocr.config import ModelConfig
from scale_ocr.tasks import create_task

MODEL = {"arch": "vitstr_tiny", "input_size": [16, 64], "model_width": 32, "model_depth": 1, "model_heads": 2,
         "mlp_ratio": 2.0, "vocab": "digits"}
HUGE = {"model_width": 16384, "model_depth": 256}  # at the bounds: 0.55 trillion weights (MLP ratio 2) if built


def _task():
    return create_task(ModelConfig(**{**MODEL, "input_size": tuple(MODEL["input_size"])}))


def _one_error_line(code: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("scale-ocr: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def image(tmp_path) -> Path:
    Image.new("RGB", (64, 16), "white").save(tmp_path / "word.png")
    return tmp_path / "word.png"


@pytest.fixture
def run_dir(tmp_path) -> Path:
    """A run directory as training leaves it: best_model.pt and the config.json that says what it holds."""
    task = _task()
    run = tmp_path / "run"
    run.mkdir()
    torch.save(task.build_model().state_dict(), run / "best_model.pt")
    model = {k: v for k, v in MODEL.items() if k != "vocab"}
    (run / "config.json").write_text(json.dumps({"model": model, **task.describe()}))
    return run


def _claim(run: Path, **model) -> None:
    config = json.loads((run / "config.json").read_text())
    config["model"].update(model)
    (run / "config.json").write_text(json.dumps(config))


def test_crafted_config_beside_best_model_is_refused_before_a_build(run_dir, image, capsys):
    assert cli_main(["predict", str(run_dir / "best_model.pt"), str(image)]) == 0  # the genuine pair predicts
    capsys.readouterr()
    _claim(run_dir, **HUGE)
    line = _one_error_line(cli_main(["predict", str(run_dir / "best_model.pt"), str(image)]), capsys.readouterr().err)
    assert "best_model.pt" in line and "config.json claims vitstr_tiny 16x64, width 16384, depth 256" in line
    held = torch.load(run_dir / "best_model.pt", weights_only=True)
    assert f"a model of 549,804,277,771 weights, but the file holds {sum(t.numel() for t in held.values()):,} in " \
           f"{len(held)} tensors" in line, line
    _claim(run_dir, model_width=64, model_heads=4)  # in bounds but not these weights: the same refusal
    line = _one_error_line(cli_main(["predict", str(run_dir / "best_model.pt"), str(image)]), capsys.readouterr().err)
    assert "width 64" in line and "not written by scale-ocr for these weights" in line


def test_crafted_safetensors_metadata_is_refused_before_a_build(tmp_path, image, capsys):
    task = _task()
    out = save_export(task.build_model(), task, tmp_path / "model.safetensors")
    assert cli_main(["predict", str(out), str(image)]) == 0
    capsys.readouterr()
    with safe_open(str(out), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    identity = {**json.loads(meta["identity"]), **HUGE}
    save_file(tensors, str(out), metadata={**meta, "identity": json.dumps(identity)})
    line = _one_error_line(cli_main(["predict", str(out), str(image)]), capsys.readouterr().err)
    assert f"{out}: its metadata claims vitstr_tiny 16x64, width 16384, depth 256" in line
    assert f"but the file holds {sum(t.numel() for t in tensors.values()):,} in {len(tensors)} tensors" in line


@pytest.mark.parametrize(("claim", "says"), [
    ({"arch": "vitstr_colossal"}, "claims the model 'vitstr_colossal', which is not registered"),
    ({"model_width": 10**9},
     "claims vitstr_tiny with width 1000000000 is not a whole number above 0 and at most 16384"),
    ({"model_depth": 100000}, "depth 100000 is not a whole number above 0 and at most 256"),
    ({"mlp_ratio": 1e9}, "mlp_ratio 1000000000.0 is not a number above 0 and at most 16"),
    ({"input_size": [32, 10**6]}, "input_side 1000000 is not a whole number above 0 and at most 8192"),
    ({"input_size": [32, "128"]}, "input_side '128' is not a whole number"),
    ({"model_width": 64, "arch": "crnn_vgg16_bn"}, "claims crnn_vgg16_bn with crnn_vgg16_bn has no width to set"),
])
def test_config_claiming_an_unknown_model_or_an_out_of_bounds_size_is_refused(run_dir, image, capsys, claim, says):
    _claim(run_dir, **claim)
    line = _one_error_line(cli_main(["predict", str(run_dir / "best_model.pt"), str(image)]), capsys.readouterr().err)
    assert f"{run_dir / 'config.json'} " in line and says in line, line


def test_flags_beyond_the_bounds_are_refused_too():
    from scale_ocr.errors import UserError

    with pytest.raises(UserError, match="--model-depth: depth 257 is not a whole number above 0 and at most 256"):
        create_task(ModelConfig(arch="vitstr_tiny", model_depth=257))
    with pytest.raises(UserError, match="--input-size: input_side 9000"):
        create_task(ModelConfig(arch="crnn_vgg16_bn", input_size=(32, 9000)))
