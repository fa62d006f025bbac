"""Text detection (DBNet) through the same trainer, launchers, strategies and checkpoints as recognition."""

from __future__ import annotations

import pytest
from conftest import _env, deepspeed_train, fixture_dir, python_train, read_jsonl, read_metrics, torchrun_train

# 128x128 pages, 2 per rank: a few seconds a step for DBNet-MobileNetV3 on a CPU core.
DET = ["db_mobilenet_v3_large", "--input-size", "128x128", "-b", "2", "--train-samples", "16", "--val-samples", "4",
       "--log-every", "1", "--sched", "constant", "--wandb-mode", "disabled", "--epochs", "1"]


def _check(proc, run_dir, steps: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    m = read_metrics(run_dir)
    assert m["task"] == "detection" and m["steps"] == steps
    assert all(0.0 <= m[k] <= 1.0 for k in ("recall", "precision", "hmean", "mean_iou")), m
    assert "recall=" in proc.stdout and (run_dir / "last_model.pt").is_file()
    return m


@pytest.fixture(scope="module")
def zero3_saved(tmp_path_factory):
    """A 2-rank ZeRO-3 detection run of 3 steps that saved at step 2."""
    with fixture_dir(tmp_path_factory, "det_zero3") as run_dir:
        proc = torchrun_train(["--strategy", "zero3", *DET, "--max-steps", "3", "--save-every", "2",
                               "--output-dir", str(run_dir)])
        _check(proc, run_dir, 3)
        yield run_dir


@pytest.mark.slow
def test_detection_trains_under_the_deepspeed_launcher(tmp_path):
    """ZeRO-2 through `deepspeed`; ZeRO-3 (torchrun) trains in the fixture, FSDP and one process resume below."""
    run_dir = tmp_path / "run"
    _check(deepspeed_train(["--strategy", "zero2", *DET, "--max-steps", "2", "--output-dir", str(run_dir)]), run_dir, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 1])
def test_zero3_detection_checkpoint_resumes_under_fsdp_and_one_process(world, zero3_saved, tmp_path):
    """Saved by ZeRO-3 on 2 ranks at step 2; resumed by FSDP2 on 2 ranks (DBNet sharded by its own units), or by
    one plain process at the same global batch, it continues the ZeRO-3 run's loss curve."""
    run_dir = tmp_path / "resumed"
    args = [*DET, "--max-steps", "3", "--resume", str(zero3_saved / "checkpoints" / "step_00000002"),
            "--output-dir", str(run_dir)]
    proc = torchrun_train(["--strategy", "fsdp", *args]) if world == 2 else \
        python_train(["--strategy", "single", *args, "-b", "4"])
    _check(proc, run_dir, 3)
    assert "at step 2" in proc.stdout
    straight = {r["step"]: r["train/loss"] for r in read_jsonl(zero3_saved) if "train/loss" in r}
    resumed = {r["step"]: r["train/loss"] for r in read_jsonl(run_dir) if "train/loss" in r}
    assert sorted(resumed) == [3]  # the steps after the checkpoint, each once
    # One process sees both ranks' pages in one batch: BatchNorm statistics change, so only closeness there.
    assert resumed[3] == pytest.approx(straight[3], rel=1e-3 if world == 2 else 0.1), (resumed, straight)


@pytest.mark.slow
def test_detection_folder_trains_and_evaluates(tmp_path):
    """A docTR detection folder trains and evaluates, and W&B (offline, read back from its files) gets the
    per-epoch metrics and a table of validation pages with true and predicted boxes drawn on them."""
    import json
    from pathlib import Path

    from scale_ocr.data.synthetic_pages import write_detection_folder
    from tests.helpers.wandb_reader import read_offline_run

    folder = write_detection_folder(tmp_path / "pages", num_pages=6, seed=3, size=(160, 128))
    run_dir = tmp_path / "run"
    env = {**_env(), "WANDB_MODE": "offline", "HOME": str(tmp_path)}
    proc = python_train([*DET, "--strategy", "single", "--train-path", str(folder), "--val-path", str(folder),
                         "--max-steps", "2", "--output-dir", str(run_dir), "--wandb-mode", "offline"], env=env)
    m = _check(proc, run_dir, 2)
    assert m["skipped_samples"] == 0
    (wb,) = (run_dir / "wandb").glob("offline-run-*")
    run = read_offline_run(wb)
    evals = [h for h in run.history if "val/recall" in h]
    assert len(evals) == 1 and {"val/precision", "val/mean_iou", "val/hmean"} <= set(evals[0])
    assert evals[0]["val/examples/_type"] == "table-file" and evals[0]["val/examples/nrows"] == 4
    # The table and its images travel as a run_table artifact (what `wandb sync` uploads).
    (files,) = [a["files"] for a in run.artifacts.values() if a["type"] == "run_table"]
    table = json.loads(Path(files["val/examples.table.json"]).read_text())
    assert table["columns"] == ["page", "true_boxes", "predicted_boxes"] and len(table["data"]) == 4
    for page, true_boxes, _ in table["data"]:
        # Real pages are read whole at their own scale (--page-scale native, their default): 128 wide, 160 high.
        assert page["_type"] == "image-file" and (page["width"], page["height"]) == (128, 160)
        assert Path(files[page["path"]]).is_file() and true_boxes > 0
