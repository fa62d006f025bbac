"""The DDP-vs-DataParallel benchmark's arithmetic: per-repeat ratios, efficiencies, verdicts and report."""

from __future__ import annotations

import json

import pytest

from benchmarks import ddp_vs_dp


def _line(job, repeat, sps, status="ok"):
    side, strategy, ranks, _, units = ddp_vs_dp.JOBS[job]
    return {"job": job, "repeat": repeat, "side": side, "strategy": strategy, "ranks": ranks, "threads_per_rank": 1,
            "batch_per_rank": 32 * units, "status": status, "error": None if status == "ok" else "boom",
            "samples_per_sec": sps if status == "ok" else None, "wall_seconds": 30.0, "arch": "crnn", "steps": 40,
            "workers": 0, "command": "x", "versions": {"git": "abc", "torch": "2"}, "hardware": {"cpu": "c", "cores": 2,
                                                                                                  "gpus": []}}


def test_ratios_pair_jobs_of_the_same_repeat_and_the_report_gives_both_verdicts(tmp_path):
    sps = {"dp": 50.0, "ddp1": 30.0, "ddp2": 57.0, "hand1": 32.0, "hand2": 64.0}
    lines = [_line(j, 0, v) for j, v in sps.items()]
    lines += [_line(j, 1, v * 1.1) for j, v in sps.items() if j != "hand2"] + [_line("hand2", 1, 0, "timeout")]
    r = ddp_vs_dp.ratios(lines)
    assert r["ddp_over_dp"] == [pytest.approx(57 / 50), pytest.approx(57 / 50)]
    assert r["trainer_efficiency"] == [pytest.approx(0.95)] * 2
    assert r["hand_efficiency"] == [pytest.approx(1.0)]  # repeat 1 has no hand2: no efficiency from it
    v = ddp_vs_dp.verdicts(r)
    assert "1.140 (PASS" in v[0] and "trainer 0.950, hand-written DDP loop 1.000 (FAIL" in v[1]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    report = ddp_vs_dp.write_report(tmp_path).read_text()
    assert "| ddp2 | `train.py --strategy ddp` | 2 x 1 | 32 |" in report and "| hand2 |" in report
    assert "| dp | `train.py --strategy dp` | 1 x 1 | 64 |" in report
    assert "hand2 r1: timeout boom" in report
    assert json.loads((tmp_path / "summary.json").read_text())["hand_efficiency"] == r["hand_efficiency"]
