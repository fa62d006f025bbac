"""The engine-settings benchmark: each variant's flags or JSON, and ratios against its strategy's default per repeat."""

from __future__ import annotations

import json

import pytest

from benchmarks import engine_knobs


def test_variants_change_only_their_setting_and_ratios_pair_runs_of_the_same_repeat(tmp_path):
    flags = engine_knobs.variant_flags("zero2-no-overlap", tmp_path)
    assert flags[0] == "--ds-config"
    changed = json.loads((tmp_path / "zero2-no-overlap.json").read_text())
    preset = json.loads((engine_knobs.REPO / "ds_configs" / "zero2.json").read_text())
    preset["zero_optimization"]["overlap_comm"] = False
    assert changed == preset
    big = json.loads(open(engine_knobs.variant_flags("zero2-big-buckets", tmp_path)[1]).read())["zero_optimization"]
    assert big["reduce_bucket_size"] == 5e8 and "stage3_prefetch_bucket_size" not in big  # no stage-3 key in ZeRO-2
    assert engine_knobs.variant_flags("ddp-bucket1", tmp_path) == ["--bucket-mb", "1"]

    def line(variant, repeat, sps, status="ok"):
        return {"variant": variant, "strategy": engine_knobs.VARIANTS[variant][0], "flags": [], "repeat": repeat,
                "status": status, "error": None if status == "ok" else "boom", "samples_per_sec": sps,
                "window_samples_per_sec": sps, "world_size": 2, "threads_per_rank": 1, "arch": "crnn",
                "batch_size": 32, "steps": 40, "versions": {}, "hardware": {"cpu": "c", "cores": 2, "gpus": []}}

    lines = [line("ddp", 0, 100.0), line("ddp-static", 0, 110.0), line("ddp", 1, 200.0), line("ddp-static", 1, 180.0),
             line("ddp-bucket1", 0, None, "failed")]
    rows = {r["variant"]: r for r in engine_knobs.summarize(lines)}
    assert rows["ddp-static"]["ratio_median"] == pytest.approx(1.0) and rows["ddp-static"]["ratio_min"] == 0.9
    assert rows["ddp"]["ratio_median"] == 1.0 and rows["ddp-bucket1"]["failed"] == ["boom"]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = engine_knobs.write_report(tmp_path).read_text()
    assert ("| ddp-static | `(default)` | 145.0 | 1.000 (0.900 - 1.100) | 2 |" in report
            and "- ddp-bucket1: boom" in report)
