"""Training really learns: a short run drives the loss clearly down.

The full learning check (>= 90% exact match, ~18 min on 2 CPU ranks) is in the README and closing notes.
"""

import pytest
from conftest import read_jsonl, read_metrics, torchrun_train


@pytest.mark.slow
def test_short_ddp_run_drives_loss_down(tmp_path):
    proc = torchrun_train([
        "--strategy", "ddp", "--vocab", "digits", "--min-chars", "3", "--max-chars", "5", "--no-augment",
        "--train-samples", "4096", "--val-samples", "128", "--max-steps", "60", "-b", "16", "--lr", "3e-3",
        "--log-every", "10", "--output-dir", str(tmp_path),
    ], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["train/loss"] for r in read_jsonl(tmp_path) if "train/loss" in r]
    # From random init (~13 at step 10) to below a third, and still falling after the first collapse (measured on
    # 2 CPU ranks: 13.2 -> 2.71 by step 60, against 3.05 and 2.78 at steps 20 and 30; 100 steps end at 2.70).
    assert losses[-1] < 0.35 * losses[0], losses
    assert losses[-1] < min(losses[1:3]), losses
    assert read_metrics(tmp_path)["steps"] == 60
