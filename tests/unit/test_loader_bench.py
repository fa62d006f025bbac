"""benchmarks.loader, for real on a tiny job: every source and worker count measured, the memo seen, a report."""

from __future__ import annotations

import json
import shutil

from benchmarks import loader
from benchmarks.harness import work_dir


def test_loader_benchmark_measures_each_source_against_training(tmp_path):
    out = tmp_path / "loader"
    args = loader.parse(["--sources", "synthetic-plain,cache,shards", "--workers", "0", "--batches", "3",
                      "--passes", "2", "-b", "4", "--train-steps", "2", "--out", str(out)])
    try:
        loader.run(args)
    finally:
        shutil.rmtree(work_dir(out), ignore_errors=True)
    doc = json.loads((out / "results.json").read_text())
    rows = {(r["source"], r["workers"]): r for r in doc["rows"]}
    assert set(rows) == {("synthetic-plain", 0), ("cache", 0), ("shards", 0)}
    plain = rows[("synthetic-plain", 0)]
    assert len(plain["loader_sps"]) == 2 and plain["train_sps"] > 0
    # The second pass reads the same words from the memo of rendered ones: no rendering, many times faster.
    assert plain["loader_sps"][1] > 2 * plain["loader_sps"][0], plain
    assert plain["headroom"][1] == plain["loader_sps"][1] / plain["train_sps"]
    report = loader.write_report(out)
    assert all(f"| {s} | 0 |" in report.read_text() for s in ("synthetic-plain", "cache", "shards"))
    assert rows[("shards", 0)]["per_worker_sps"][0] > 0 and doc["gpu_sps_estimate"] > 0
