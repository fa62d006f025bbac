"""Training really learns: a short run drives the loss clearly down.

The full learning check (>= 90% exact match, ~18 min on 2 CPU ranks) is in the README and closing notes.
"""

import pytest
from conftest import read_jsonl, read_metrics, torchrun_train


@pytest.mark.slow
def test_short_ddp_run_drives_loss_down(tmp_path):
    proc = torchrun_train([
        # --fonts classic: the four DejaVu faces these losses were measured on (76 families stay on the plateau longer)
        "--strategy", "ddp", "--vocab", "digits", "--min-chars", "3", "--max-chars", "5", "--no-augment", "--fonts",
        "classic",
        "--train-samples", "4096", "--val-samples", "128", "--max-steps", "60", "-b", "16", "--lr", "3e-3",
        "--log-every", "10", "--output-dir", str(tmp_path),
    ], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["train/loss"] for r in read_jsonl(tmp_path) if "train/loss" in r]
    # The head starts at the blank's prior (ctc.BLANK_PRIOR), so there is no first collapse from random init to fall
    # from: the loss has to leave CTC's blank plateau, where the run sat before that head (2.71 at step 60, 2.70 at
    # 100). Measured on 2 CPU ranks: 2.83 at step 10, 2.71, 2.44, 2.18, 1.88, 1.68 at step 60.
    assert losses[-1] < 0.7 * losses[0], losses
    assert losses[-1] < 2.2, losses  # below the plateau, not only down from the start
    assert losses[-1] < min(losses[1:3]), losses
    assert read_metrics(tmp_path)["steps"] == 60
