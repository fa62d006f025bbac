"""benchmarks.compute, for real at a tiny size: every variant measured in one process, the report rebuilt the same."""

from __future__ import annotations

import json

import pytest

from benchmarks import compute
from scale_ocr.errors import UserError


def test_compute_benchmark_times_each_variant_and_rebuilds_its_report(tmp_path):
    out = tmp_path / "compute"
    argv = ["--models", "crnn_mobilenet_v3_small:32x64:2", "--variants", "nchw,channels-last-images", "--compile",
            "--compile-backend", "eager", "--steps", "2", "--warmup", "1", "--out", str(out)]
    assert compute.main(argv) == 0
    lines = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
    assert [ln["variant"] for ln in lines] == ["nchw", "channels-last-images", "compiled"]
    assert all(len(ln["step_ms"]) == 2 and ln["median_ms"] > 0 and ln["input_size"] == "32x64" for ln in lines)
    assert (out / "command.txt").read_text().startswith("python -m benchmarks.compute")  # this process's argv
    report = (out / "report.md").read_text()
    assert "| crnn_mobilenet_v3_small | 32x64, b 2 | compiled |" in report
    assert compute.main(["--report", str(out)]) == 0
    assert (out / "report.md").read_text() == report


def test_compute_refuses_unknown_variants_and_models():
    with pytest.raises(UserError, match="--variants"):
        compute.check(compute.parse(["--variants", "nchw,fast"]))
    with pytest.raises(UserError, match="--models"):
        compute.check(compute.parse(["--models", "no_such_model:32x64:2"]))
    assert compute.model_spec("crnn_vgg16_bn") == ("crnn_vgg16_bn", None, 32)
