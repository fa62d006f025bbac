"""`scale-ocr verify` passes engines that do the same maths and fails one that does not."""

import sys

import pytest
from conftest import run_cmd

ARGS = ["--steps", "8", "--strategies", "ddp,zero2,fsdp"]


@pytest.mark.slow
def test_verify_passes_and_catches_an_injected_difference(tmp_path):
    """One verify run: FSDP does DDP's maths and passes; ZeRO-2 with a doubled learning rate is caught."""
    bad = run_cmd([sys.executable, "-m", "scale_ocr", "verify", *ARGS, "--extra", "zero2=--lr 2e-3",
                   "--output-dir", str(tmp_path / "b")], timeout=600)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-2000:]
    rows = {ln.split()[0]: ln for ln in bad.stdout.splitlines()
            if ln.split() and ln.split()[0] in ("ddp", "zero2", "fsdp")}
    assert rows["ddp"].endswith("reference") and rows["zero2"].endswith("FAIL") and rows["fsdp"].endswith("pass"), \
        bad.stdout
