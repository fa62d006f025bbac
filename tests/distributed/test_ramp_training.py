"""``--batch-ramp auto`` trained for real (issue 54): the batch grows under DDP at 2 ranks, the run stops at its
samples, and a resume in one process under ZeRO-2 continues the ramp at the batch it reached (its accumulation
re-derived for one rank) and grows it on, each change said in one line, the log recording the batch of each step and
the rate the batch carried it to.

``--ramp-limit 1e6`` lets any positive B_simple through, so the changes fall at the readings the ramp waits for
(:data:`~scale_ocr.run.noise_scale.SETTLED` after each): the decisions themselves are tests/unit/test_batch_ramp.py's.
"""

from __future__ import annotations

import re

import pytest
from conftest import python_train, read_jsonl, read_metrics, torchrun_train

RAMP = ["--train-samples", "256", "--val-samples", "16", "--max-chars", "5", "--epochs", "1", "--log-every", "1",
        "--batch-ramp", "auto", "--ramp-limit", "1e6", "--ramp-max-batch", "32", "--noise-every", "1",
        "--sched", "constant", "--lr", "1e-3", "--wandb-mode", "disabled"]


@pytest.mark.slow
def test_the_batch_grows_stops_at_its_samples_and_resumes_growing_at_another_world_size_and_engine(tmp_path):
    run = tmp_path / "ramp"
    # 2 ranks x 2 x 1 = 4 a step; --max-steps 10 at it is 40 samples: 4 steps of 4, then 3 of 8
    first = torchrun_train(["--strategy", "ddp", "-b", "2", "--max-steps", "10", *RAMP, "--output-dir", str(run)])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "batch ramp: global batch 4 -> 8 after step 4 (16 samples in;" in first.stdout, first.stdout[-3000:]
    metrics = read_metrics(run)
    assert (metrics["steps"], metrics["samples"], metrics["global_batch"]) == (7, 40, 8), metrics

    # one process, 2 x 2 = 4 a step at the start; the checkpoint's 8 is 4 micro-batches here; 40 x 4 = 160 samples
    second = python_train(["--strategy", "zero2", "-b", "2", "--grad-accum", "2", "--max-steps", "40", *RAMP,
                           "--output-dir", str(run)])
    assert second.returncode == 0, second.stderr[-3000:]
    out = second.stdout
    assert re.search(r"resumed from \S+ at step 7\b.*, batch ramp at global batch 8;", out), out[-3000:]
    changes = re.findall(r"batch ramp: global batch (\d+) -> (\d+) after step (\d+) .*--grad-accum (\d+),", out)
    assert changes == [("8", "16", "8", "8"), ("16", "32", "12", "16")], out[-3000:]
    metrics = read_metrics(run)
    ramp = metrics["batch_ramp"]
    assert (metrics["steps"], metrics["samples"], metrics["global_batch"]) == (14, 176, 32), metrics
    assert (ramp["start_batch"], ramp["final_batch"], [c["after"] for c in ramp["changes"]]) == (4, 32, [8, 16, 32])
    records = [r for r in read_jsonl(run) if "train/global_batch" in r]
    batches = {r["step"]: r["train/global_batch"] for r in records}
    assert batches == {**dict.fromkeys(range(1, 5), 4), **dict.fromkeys(range(5, 9), 8),
                       **dict.fromkeys(range(9, 13), 16), 13: 32, 14: 32}, batches
    # the rate grew with the batch by the default rule, sqrt, from 1e-3 at batch 4, across the resume too
    rates = {r["step"]: r["train/lr"] for r in records}
    assert all(rates[s] == pytest.approx(1e-3 * (batches[s] / 4) ** 0.5) for s in batches), rates
    assert ramp["lr_rule"] == "sqrt" and ramp["origin"] == [4, pytest.approx(1e-3)], ramp
