"""Loading a checkpoint never runs code from it, and a damaged one is refused with one line.

One tiny checkpoint is trained per module and copied per test. Crafted files come with a rewritten
manifest.json (whoever can edit a checkpoint can), so the refusal shown is the loader's, not the hash's.
"""

from __future__ import annotations

import builtins
import json
import os
import pathlib
import pickle
import shutil

import pytest
import torch
from conftest import fixture_dir

from scale_ocr.checkpoint.manifest import MANIFEST, sha256, write_manifest
from scale_ocr.checkpoint.safe_dcp import read_metadata_file
from scale_ocr.cli.main import main as cli_main
from scale_ocr.train import main as train_main

SMALL = ["--strategy", "single", "--train-samples", "16", "--val-samples", "4", "-b", "4", "--max-steps", "1",
         "--max-chars", "5", "--wandb-mode", "disabled", "--save-every", "1"]
STEP = "step_00000001"


class _RunsCode:
    """Unpickling this creates ``marker`` through ``how``: what a crafted checkpoint would do."""

    def __init__(self, how: str, marker: pathlib.Path) -> None:
        self.how, self.marker = how, marker

    def __reduce__(self):
        if self.how == "os.system":
            return os.system, (f"touch {self.marker}",)
        if self.how == "builtins.exec":
            return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)
        return pathlib.Path.touch, (pathlib.Path(self.marker),)  # pickled as `pathlib.Path.touch`


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    with fixture_dir(tmp_path_factory, "trained") as root:
        assert train_main([*SMALL, "--output-dir", str(root / "run")]) == 0
        yield root / "run"


@pytest.fixture
def run_dir(trained, tmp_path):
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _one_error_line(code: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("scale-ocr: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _resume(run_dir, capsys) -> str:
    code = train_main([*SMALL, "--output-dir", str(run_dir), "--max-steps", "2", "--resume", "auto"])
    return _one_error_line(code, capsys.readouterr().err)


def _craft_metadata(step: pathlib.Path, how: str, marker: pathlib.Path) -> None:
    """A genuine .metadata with a payload in it, and a manifest that agrees."""
    metadata = read_metadata_file(step / ".metadata")
    metadata.planner_data["payload"] = _RunsCode(how, marker)
    with open(step / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    write_manifest(step)


@pytest.mark.parametrize("how", ["os.system", "builtins.exec", "pathlib.Path.touch"])
def test_crafted_metadata_does_not_run_on_resume(run_dir, tmp_path, capsys, how):
    marker = tmp_path / "pwned"
    _craft_metadata(run_dir / "checkpoints" / STEP, how, marker)
    line = _resume(run_dir, capsys)
    assert not marker.exists()
    expected = {"os.system": "posix.system", "builtins.exec": "builtins.exec"}.get(how, "pathlib.Path.touch")
    assert f"refers to `{expected}`" in line and ".metadata" in line and "crafted" in line


@pytest.mark.parametrize("command", ["export", "predict"])
def test_crafted_metadata_does_not_run_on_export_or_predict(run_dir, tmp_path, capsys, command):
    from PIL import Image

    marker = tmp_path / "pwned"
    _craft_metadata(run_dir / "checkpoints" / STEP, "os.system", marker)
    Image.new("RGB", (128, 32), "white").save(tmp_path / "word.png")
    last = str(tmp_path / "out.safetensors") if command == "export" else str(tmp_path / "word.png")
    line = _one_error_line(cli_main([command, str(run_dir), last]), capsys.readouterr().err)
    assert not marker.exists() and not (tmp_path / "out.safetensors").exists()
    assert "refers to `posix.system`" in line and STEP in line


@pytest.mark.parametrize("command", ["resume", "export"])
def test_a_pointer_naming_a_folder_outside_the_run_is_refused(run_dir, tmp_path, capsys, command):
    """``checkpoints/latest`` edited to lead out of the run (to a loadable checkpoint elsewhere) is not followed."""
    shutil.copytree(run_dir / "checkpoints" / STEP, tmp_path / "elsewhere" / STEP)
    (run_dir / "checkpoints" / "latest").write_text(f"../../elsewhere/{STEP}\n")
    if command == "resume":
        line = _resume(run_dir, capsys)
    else:
        out = tmp_path / "out.safetensors"
        line = _one_error_line(cli_main(["export", str(run_dir), str(out)]), capsys.readouterr().err)
        assert not out.exists()
    assert "not a step_N folder beside it" in line and "elsewhere" in line


def test_run_weights_file_predicts_and_a_crafted_one_does_not_run(run_dir, tmp_path, capsys):
    """A run's last_model.pt is a model for predict/export (identity from config.json), read with weights_only."""
    from PIL import Image
    from safetensors.torch import load_file

    Image.new("RGB", (128, 32), "white").save(tmp_path / "word.png")
    assert cli_main(["predict", str(run_dir / "last_model.pt"), str(tmp_path / "word.png")]) == 0
    assert capsys.readouterr().out.startswith(str(tmp_path / "word.png"))
    # Exported a tensor at a time from the mapped file, it is the model the checkpoint of the same step holds.
    assert cli_main(["export", str(run_dir / "last_model.pt"), str(tmp_path / "from_pt.safetensors")]) == 0
    assert cli_main(["export", str(run_dir), str(tmp_path / "from_ckpt.safetensors")]) == 0
    from_pt, from_ckpt = (load_file(str(tmp_path / f"from_{k}.safetensors")) for k in ("pt", "ckpt"))
    assert from_pt.keys() == from_ckpt.keys() and all(torch.equal(from_pt[k], from_ckpt[k]) for k in from_pt)
    marker = tmp_path / "pwned"
    torch.save({"weight": _RunsCode("os.system", marker)}, run_dir / "last_model.pt")
    line = _one_error_line(cli_main(["export", str(run_dir / "last_model.pt"), str(tmp_path / "m.safetensors")]),
                           capsys.readouterr().err)
    assert not marker.exists() and "refers to `posix.system`" in line and "last_model.pt" in line
    (run_dir / "config.json").unlink()
    line = _one_error_line(cli_main(["predict", str(run_dir / "last_model.pt"), str(tmp_path / "word.png")]),
                           capsys.readouterr().err)
    assert "no config.json beside it" in line


@pytest.mark.filterwarnings("ignore::UserWarning")  # crafting: dcp.save in one process, over a checkpoint
@pytest.mark.parametrize("where", ["optimizer entry", "rng file"])
def test_crafted_non_tensor_entry_does_not_run(run_dir, tmp_path, capsys, where):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    step, marker = run_dir / "checkpoints" / STEP, tmp_path / "pwned"
    if where == "rng file":
        torch.save({"torch": _RunsCode("os.system", marker)}, step / "rng_rank0.pt")
        expected = "rng_rank0.pt"
    else:  # the bytes entry DCP keeps optimizer hyper-parameters in, inside the .distcp shard
        dcp_to_torch_save(step, tmp_path / "full.pt")
        state = torch.load(tmp_path / "full.pt", weights_only=True)
        state["optim"]["param_groups"][0]["lr"] = _RunsCode("os.system", marker)
        dcp.save(state, checkpoint_id=step, no_dist=True)  # overwrites .metadata and the shard
        expected = "`optim.param_groups.0.lr`"
    write_manifest(step)
    line = _resume(run_dir, capsys)
    assert not marker.exists()
    assert expected in line and "refers to `posix.system`" in line and "crafted" in line


def test_flipped_byte_in_a_shard_is_refused(run_dir, capsys):
    shard = run_dir / "checkpoints" / STEP / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # bit rot: same size, one bit off
    shard.write_bytes(bytes(data))
    line = _resume(run_dir, capsys)
    assert f"{STEP} cannot be read: __0_0.distcp has SHA-256 {sha256(shard)[:16]}" in line
    assert "the file is damaged" in line and "earlier checkpoints/step_N" in line


@pytest.mark.parametrize("damage", ["truncated shard", "missing rng file", "missing shard"])
def test_half_copied_checkpoint_is_refused(run_dir, capsys, damage):
    step = run_dir / "checkpoints" / STEP
    if damage == "truncated shard":
        shard = step / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        expected = f"{STEP} cannot be read: __0_0.distcp is {shard.stat().st_size} bytes"
    else:
        name = "rng_rank0.pt" if damage == "missing rng file" else "__0_0.distcp"
        (step / name).unlink()
        expected = f"{STEP} cannot be read: {name} is missing"
    assert expected in _resume(run_dir, capsys)


def test_genuine_checkpoint_lists_every_file_and_loads(run_dir, tmp_path, capsys):
    step = run_dir / "checkpoints" / STEP
    files = json.loads((step / MANIFEST).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in step.iterdir() if p.name != MANIFEST)
    assert all(files[n] == {"size": (step / n).stat().st_size, "sha256": sha256(step / n)} for n in files)
    assert cli_main(["export", str(run_dir), str(tmp_path / "m.safetensors")]) == 0
    assert train_main([*SMALL, "--output-dir", str(run_dir), "--max-steps", "2", "--resume", "auto"]) == 0
    assert "scale-ocr: error" not in capsys.readouterr().err


def test_checkpoint_without_manifest_loads_with_one_warning(run_dir, tmp_path, capsys):
    (run_dir / "checkpoints" / STEP / MANIFEST).unlink()  # as an older scale-ocr wrote it
    assert cli_main(["export", str(run_dir), str(tmp_path / "m.safetensors")]) == 0
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if "scale-ocr: warning" in ln] == [
        f"scale-ocr: warning: checkpoint {run_dir / 'checkpoints' / STEP} has no {MANIFEST} (written by an "
        "older scale-ocr); its integrity is not checked"]


@pytest.mark.parametrize(("out", "fmt"), [("last_model.pt", "safetensors"), ("metrics.json", "safetensors"),
                                          ("checkpoints/model.safetensors", "safetensors"),
                                          ("config.pt", "doctr")])  # doctr's sidecar: config.json
def test_export_never_replaces_a_file_of_the_run(run_dir, capsys, out, fmt):
    """X07: ``export RUN/checkpoints/step_N RUN/last_model.pt`` replaced the run's model with the export; every
    output of export (OUT, and docTR's OUT.json) goes through disk.check_output first."""
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    line = _one_error_line(cli_main(["export", str(run_dir / "checkpoints" / STEP), str(run_dir / out),
                                     "--format", fmt]), capsys.readouterr().err)
    assert "would replace a file of the run" in line
    assert before == {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_an_export_named_pt_is_read_as_the_export_it_is(run_dir, tmp_path, capsys):
    """X07's aftermath: a safetensors export written as ``.pt`` is recognised by its content (it was refused as a
    pickle that "may have been crafted to run code"); bytes that are no torch pickle are said to be so, no attack
    claimed."""
    from scale_ocr.checkpoint.weights_io import read_state_dict

    exported = tmp_path / "model.pt"
    assert cli_main(["export", str(run_dir), str(exported)]) == 0
    assert read_state_dict(exported).keys() == torch.load(run_dir / "last_model.pt", weights_only=True).keys()
    (run_dir / "last_model.pt").write_bytes(exported.read_bytes())  # what X07 left
    assert cli_main(["export", str(run_dir / "last_model.pt"), str(tmp_path / "again.safetensors")]) == 0
    (run_dir / "last_model.pt").write_bytes(b"garbage, not a pickle")
    line = _one_error_line(cli_main(["export", str(run_dir / "last_model.pt"), str(tmp_path / "m.safetensors")]),
                           capsys.readouterr().err)
    assert "is not a torch file" in line and "crafted" not in line


@pytest.mark.parametrize("value", [float("nan"), 1e38])
def test_init_from_weights_unfit_to_train_are_refused_before_any_step(trained, tmp_path, capsys, value):
    """N03: --init-from NaN weights (or 1e38, finite but with an infinite norm) trained 5 NaN steps and ended
    "training diverged ... lower --lr": NaN is refused as the file loads, 1e38 as the weight check first measures."""
    state = torch.load(trained / "last_model.pt", weights_only=True)
    state = {k: v.fill_(value) if v.is_floating_point() and k.endswith("weight") else v for k, v in state.items()}
    torch.save(state, tmp_path / "bad.pt")
    code = train_main([*SMALL, "--output-dir", str(tmp_path / "run"), "--init-from", str(tmp_path / "bad.pt")])
    line = _one_error_line(code, capsys.readouterr().err)
    if value != value:  # NaN
        assert "bad.pt: " in line and "tensors hold NaN or inf (e.g. " in line, line
    else:
        assert "the weights from --init-from " in line and "have an infinite norm" in line, line
        assert "before any step" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run").glob("checkpoints/step_*"))
