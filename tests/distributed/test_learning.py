"""Training really learns: a short run drives the loss clearly down and starts reading words."""

import pytest
from conftest import read_jsonl, read_metrics, torchrun_train


@pytest.mark.slow
def test_short_ddp_run_drives_loss_down(tmp_path):
    proc = torchrun_train([
        "--strategy", "ddp", "--vocab", "digits", "--min-chars", "3", "--max-chars", "5", "--no-augment",
        "--train-samples", "4096", "--val-samples", "128", "--max-steps", "150", "-b", "16", "--lr", "3e-3",
        "--log-every", "10", "--output-dir", str(tmp_path),
    ], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["train/loss"] for r in read_jsonl(tmp_path) if "train/loss" in r]
    assert losses[-1] < 0.25 * losses[0], losses
    assert losses[-1] < 2.0, losses  # below CTC's all-blank plateau
    m = read_metrics(tmp_path)
    assert m["cer"] < 0.8, m
