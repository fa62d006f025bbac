"""Where a 2-rank gloo run's step time and memory went (metrics.json's time_breakdown and memory_breakdown)."""

from __future__ import annotations

import pytest
from conftest import REPO, read_metrics, torchrun_train

SLOW_LOADER = REPO / "tests" / "helpers" / "slow_loader_train.py"


@pytest.mark.slow
def test_a_ddp_run_says_where_its_step_time_and_memory_went(tmp_path):
    """8 steps: 2 of warm-up, 4 timed, 2 profiled. The parts of a timed step add up to the step time samples/s
    reports, within 10%, and the straggler share is measured. Rank 1's loader waits 50 ms for each batch: that is
    data wait on rank 1, and rank 0 waits as long for it inside DDP's all-reduce, as exposed communication. The peak
    resident set splits into runtime, model state, engine buffers, activations and heap exactly."""
    out = tmp_path / "run"
    proc = torchrun_train(["0.05", "--strategy", "ddp", "--max-steps", "8", "--train-samples", "128", "-b", "8",
                           "--log-every", "4", "--max-chars", "5", "--no-eval", "--no-save-model",
                           "--profile-steps", "2", "--wandb-mode", "disabled", "--output-dir", str(out)],
                          script=SLOW_LOADER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = read_metrics(out)
    t = m["time_breakdown"]
    parts = [t[k] for k in ("data", "compute", "exposed_comm", "optimizer", "other")]
    assert t["timed_steps"] == 4 and t["profiled_steps"] == 2 and all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(t["step_seconds"], rel=0.1)
    assert t["step_seconds"] == pytest.approx(m["global_batch"] / m["samples_per_sec"])
    assert 0 < t["exposed_comm_share"] <= t["comm_in_flight_share"] <= 1
    assert t["data"] >= 0.02  # the mean over ranks of 50 ms on rank 1 and next to nothing on rank 0
    assert t["exposed_comm_share_max"] * t["step_seconds"] >= 0.03  # rank 0, waiting for rank 1
    assert "time=[compute " in proc.stdout.splitlines()[-1] and "; straggler " in proc.stdout.splitlines()[-1]
    assert 0 <= t["straggler_share"] < 0.5  # equal batches: each rank's forward work the same, up to the host's noise
    mem = m["memory_breakdown"]
    assert mem["model_state"] == m["state_bytes"]["model_state"] and mem["activations"] > 0
    assert mem["peak_rss"] == sum(mem[k] for k in ("runtime", "model_state", "engine_buffers", "activations", "heap"))
