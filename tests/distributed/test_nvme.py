"""NVMe offload (ZeRO-Infinity, ``zero3_nvme``) really moves state out of memory: 2 real ranks over gloo."""

from __future__ import annotations

import math
import os
import shutil

import pytest
from conftest import read_jsonl, torchrun_train

# A one-block ViT 512 wide: its MLP and QKV weights have partitions over DeepSpeed's 1 MiB swap minimum
# (smaller ones stay in memory), and it trains two steps in seconds.
MODEL = ["vitstr_tiny", "--model-width", "512", "--model-depth", "1", "--model-heads", "8"]
RUN = [*MODEL, "--max-steps", "2", "--no-eval", "--train-samples", "32", "-b", "4", "--log-every", "1",
       "--max-chars", "5", "--sched", "constant", "--wandb-mode", "disabled"]
MIB = 2**20


def _require_async_io() -> None:
    """Build DeepSpeed's async_io op (cached after the first time); skip only where nothing could provide libaio.
    In this process: loading the op `make install` built takes a moment, a process of its own several seconds."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from scale_ocr.errors import UserError
    from scale_ocr.strategies.nvme import check_async_io

    if not AsyncIOBuilder().is_compatible(verbose=False):
        if os.geteuid() == 0 and shutil.which("apt-get"):
            pytest.fail("libaio is missing although `make install` could install it (root, apt-get): run it")
        pytest.skip("libaio headers are absent and this user cannot install them (apt-get install libaio-dev)")
    try:
        check_async_io()
    except UserError as exc:
        pytest.fail(str(exc))


def _partitions(world: int) -> list[int]:
    """Each parameter's ZeRO-3 partition (elements per rank, padded), from the model built on meta."""
    import torch

    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    task = create_task(ModelConfig(arch="vitstr_tiny", model_width=512, model_depth=1, model_heads=8))
    with torch.device("meta"):
        model = task.build_model()
    return [math.ceil(p.numel() / world) for p in model.parameters()]


def _sizes(folder) -> dict[str, int]:
    return {f.name: f.stat().st_size for f in folder.iterdir()}


@pytest.mark.slow
def test_zero3_nvme_swaps_state_to_disk_and_matches_zero3(tmp_path):
    """The swap files hold this rank's fp32 master + Adam moments (12 bytes per partition element), and the
    fp32 weights and gradients of every partition of 1 MiB or more; the losses are zero3's."""
    _require_async_io()
    swap, runs = tmp_path / "swap", {}
    for name, extra in (("zero3_nvme", ["--nvme-path", str(swap)]), ("zero3", [])):
        run_dir = tmp_path / name
        proc = torchrun_train(["--strategy", name, *RUN, "--output-dir", str(run_dir), *extra], timeout=240)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        runs[name] = [r["train/loss"] for r in read_jsonl(run_dir) if "train/loss" in r]
        if name == "zero3_nvme":
            assert not (run_dir / "nvme").exists()  # --nvme-path given: nothing in the run directory

    parts = _partitions(2)
    swappable = sum(n for n in parts if 4 * n >= MIB)  # DeepSpeed swaps fp32 partitions of 1 MiB or more
    for rank in (0, 1):
        opt = _sizes(swap / "zero_stage_3" / "optimizer" / f"rank{rank}")
        params = _sizes(swap / "zero_stage_3" / "float32params" / f"rank{rank}")
        state = sum(v for k, v in opt.items() if "_gradient_" not in k)
        grads = sum(v for k, v in opt.items() if "_gradient_" in k)
        assert state == pytest.approx(12 * sum(parts), rel=0.01), opt  # master, exp_avg, exp_avg_sq
        assert sum(params.values()) == 4 * swappable, params
        assert grads == 4 * swappable, opt
        assert swappable > 0.8 * sum(parts)  # most of the model really left memory
    # Same maths from disk: only summation order may differ.
    assert len(runs["zero3_nvme"]) == len(runs["zero3"]) == 2
    assert runs["zero3_nvme"] == pytest.approx(runs["zero3"], rel=1e-5)
