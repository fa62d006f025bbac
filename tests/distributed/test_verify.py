"""`scale-ocr verify` passes engines that do the same maths and fails one that does not."""

import sys

import pytest
from conftest import run_cmd

ARGS = ["--steps", "8", "--strategies", "ddp,zero2"]


@pytest.mark.slow
def test_verify_passes_and_catches_an_injected_difference(tmp_path):
    ok = run_cmd([sys.executable, "-m", "scale_ocr", "verify", *ARGS, "--output-dir", str(tmp_path / "a")],
                 timeout=600)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    assert ok.stdout.count(" pass") == 1 and "reference" in ok.stdout

    bad = run_cmd([sys.executable, "-m", "scale_ocr", "verify", *ARGS, "--extra", "zero2=--lr 2e-3",
                   "--output-dir", str(tmp_path / "b")], timeout=600)
    assert bad.returncode == 1, bad.stdout[-3000:]
    row = next(ln for ln in bad.stdout.splitlines() if ln.startswith("zero2"))
    assert row.endswith("FAIL")
