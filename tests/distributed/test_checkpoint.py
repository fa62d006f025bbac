"""Checkpoints move between strategies and world sizes, resume exactly, and survive a killed save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, HOOKED_TRAIN, REPO, _env, python_train, read_jsonl, torchrun_train
from conftest import CKPT_BASE as BASE  # shared with the `saved` fixture (tests/conftest.py)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from scale_ocr.distributed.process_group import free_port


def _losses(run_dir):
    return {r["step"]: r["train/loss"] for r in read_jsonl(run_dir) if "train/loss" in r}


@pytest.fixture(scope="module")
def ddp_straight(saved):
    """DDP trained 6 steps in one go, saving at step 4: the curve every resumed run must continue."""
    return saved("ddp").parents[1]


# Every saver at world size 2 resumes under another engine: at world size 2, or in a 1-rank plain `python` job
# (per-device batch doubled so the global batch stays 8; what benchmarks/gpu_check.sh runs on one GPU). Both
# ways occur, and zero3 and fairscale also run as 1-rank jobs here. ZeRO-3 as the saver, resumed by FSDP at 2
# ranks and by one plain process (single), is tests/distributed/test_detection.py's matrix (on DBNet). An hsdp
# checkpoint of 2 nodes x 2 ranks (shards replicated across nodes) resumes under zero3_hpz in
# tests/distributed/test_hsdp.py; hsdp on one node is one shard group, FSDP's layout, which fairscale-to-fsdp resumes.
MATRIX = [("ddp", "zero3", 1), ("fsdp", "ddp", 2), ("zero2", "fairscale", 1), ("fairscale", "fsdp", 2)]


def _launch(strategy: str, world: int, args: list[str], hooks: tuple[str, ...] = (), **kw):
    """train.py, or with ``hooks`` (options of tests/helpers/hooked_train.py) the launcher that installs them."""
    if hooks:
        kw["script"] = HOOKED_TRAIN
    if world == 2:
        return torchrun_train([*hooks, "--strategy", strategy, *BASE, *args], **kw)
    return python_train([*hooks, "--strategy", strategy, *BASE, "-b", "8", *args], **kw)


def read_checkpoint(path: Path) -> dict[str, object]:
    """A checkpoint as flat full (unsharded) tensors, read in this process without a process group."""
    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))

    def flat(d, prefix=""):
        items = {}
        for k, v in d.items():
            items.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return items

    return flat(torch.load(out, weights_only=True))


@pytest.mark.slow
@pytest.mark.parametrize("saver,resumer,world", MATRIX, ids=[f"{s}-to-{r}-ws{w}" for s, r, w in MATRIX])
def test_resume_matrix(saver, resumer, world, saved, tmp_path, ddp_straight):
    ckpt = saved(saver)
    meta = json.loads((ckpt / "trainer.json").read_text())
    assert meta["step"] == 4 and meta["world_size"] == 2 and meta["arch"] == "crnn_mobilenet_v3_small"

    # One resumed run checks both halves. The test hook makes it save what it loaded, re-sharded by its own
    # engine, before its first step; then it trains on to step 6.
    dst = tmp_path / "dst"
    proc = _launch(resumer, world, ["--resume", str(ckpt), "--output-dir", str(dst)], hooks=("--resave-on-resume",))
    assert proc.returncode == 0, proc.stderr[-3000:]

    # 1. Optimizer state survives the move intact: every tensor (weights, Adam step/exp_avg/exp_avg_sq) is equal.
    before, after = read_checkpoint(ckpt), read_checkpoint(dst / "checkpoints" / "step_00000004")
    assert before.keys() == after.keys()
    tensors = [k for k, v in before.items() if isinstance(v, torch.Tensor)]
    assert sum(k.startswith("optim.state.") and k.endswith(".exp_avg_sq") for k in tensors) > 50
    for k in tensors:
        assert torch.equal(before[k], after[k]), k
    assert before["optim.param_groups"] == after["optim.param_groups"]

    # 2. Training continues the uninterrupted DDP curve: same weights, Adam moments, schedule, data
    # position (and, at the same world size, RNG streams).
    ours, ref = _losses(dst), _losses(ddp_straight)
    assert set(ours) == {6}
    if world == 2:
        assert ours[6] == pytest.approx(ref[6], rel=1e-4)  # float noise from other reduction orders
    else:
        # One process sees the global batch of 8 at once: BatchNorm statistics change, so only closeness.
        assert ours[6] == pytest.approx(ref[6], rel=0.05)


@pytest.mark.slow
def test_deepspeed_ranks_write_the_part_of_each_tensor_they_hold(saved):
    """ZeRO-2 keeps each rank's fp32 masters and Adam moments as a range of one flat partition: each rank writes
    that range of every tensor, where it lies (before, every rank gathered each whole tensor first). The tensor the
    partitions' boundary runs through is in both ranks' files, as boxes that tile it exactly."""
    import math

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from scale_ocr.checkpoint.safe_dcp import read_metadata_file

    md = read_metadata_file(saved("zero2") / ".metadata")
    masters = {k: v for k, v in md.state_dict_metadata.items()
               if k.startswith("model.") and isinstance(v, TensorStorageMetadata) and "running_" not in k}
    files = {k: {info.relative_path for index, info in md.storage_data.items() if index.fqn == k} for k in masters}
    assert set().union(*files.values()) == {"__0_0.distcp", "__1_0.distcp"}
    split = [k for k, v in masters.items() if len(files[k]) == 2]
    assert split, "no tensor is written in parts"
    for k in split:
        assert sum(math.prod(c.sizes) for c in masters[k].chunks) == math.prod(masters[k].size)
        moment = f"optim.state.{k[len('model.'):]}.exp_avg"
        assert {info.relative_path for index, info in md.storage_data.items() if index.fqn == moment} == files[k]


@pytest.mark.slow
def test_resume_at_another_world_size_and_batch_trains_the_rest(saved, tmp_path):
    """ddp x2 (global batch 8) saved at step 4 = 32 samples into epoch 1; one process at batch 4 continues from
    those 32 samples (its step 8) through both epochs (its step 32), not to the saved run's step count."""
    dst = tmp_path / "dst"
    proc = python_train(["--strategy", "single", *BASE, "-b", "4", "--max-steps", "100", "--resume", str(saved("ddp")),
                         "--output-dir", str(dst)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "at step 4 (epoch 1, 32 samples into it; step 8 at this run's global batch of 4 instead of 8)" in proc.stdout
    metrics = json.loads((dst / "metrics.json").read_text())
    assert metrics["steps"] == 32 and metrics["epochs"] == 2
    assert [r["step"] for r in read_jsonl(dst) if "train/loss" in r][0] == 10  # first log after step 8 (every 2)


# Stopping and resuming gives bitwise an uninterrupted run's weights: for one process in
# tests/unit/test_run_faults.py (SIGTERM, resume), for DDP on 2 ranks in tests/distributed/test_faults.py
# (a rank killed under torchrun --max-restarts, resumed).


@pytest.mark.slow
def test_killed_save_leaves_previous_checkpoint(tmp_path):
    """kill -9 a rank while step 4's checkpoint is being written: step 2's still resumes."""
    run_dir = tmp_path / "run"
    # Every save after the first stalls 8 s once each rank's files are written: long enough to be caught mid-write.
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(HOOKED_TRAIN),
           "--stall-save", "8", "--strategy", "fsdp", *BASE, "--save-every", "2", "--output-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.time() + 240
        while not (run_dir / "checkpoints" / "step_00000004.tmp").is_dir():
            assert time.time() < deadline and proc.poll() is None, "never reached the second save"
            time.sleep(0.5)
        # Once step 2 is complete, step 4 is the one in flight.
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
        time.sleep(2)
        ranks = subprocess.run(["pgrep", "-f", "--", f"--output-dir {run_dir}"], capture_output=True, text=True)
        workers = [int(p) for p in ranks.stdout.split() if int(p) != proc.pid]
        os.kill(max(workers), signal.SIGKILL)
    finally:
        # The whole job dies: a rank left running would still hold the run directory's lock (rightly).
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
    assert not (run_dir / "checkpoints" / "step_00000004").exists()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    resumed = torchrun_train(["--strategy", "ddp", *BASE, "--resume", "auto", "--output-dir", str(run_dir)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout


def test_checkpoint_of_another_model_is_refused(tmp_path, capsys):
    from scale_ocr.train import main

    run_dir = tmp_path / "run"
    small = ["--strategy", "single", "--train-samples", "16", "--val-samples", "4", "-b", "4", "--max-steps", "1",
             "--max-chars", "5", "--wandb-mode", "disabled", "--save-every", "1", "--output-dir", str(run_dir)]
    assert main(small) == 0
    code = main(["crnn_mobilenet_v3_large", *small, "--resume", "auto"])
    err = capsys.readouterr().err
    assert code == 2 and "arch='crnn_mobilenet_v3_small'" in err and "Traceback" not in err
    code = main([*small, "--vocab", "digits", "--resume", "auto"])
    assert code == 2 and "vocab" in capsys.readouterr().err


def test_truncated_checkpoint_is_refused(tmp_path, capsys):
    from scale_ocr.train import main

    run_dir = tmp_path / "run"
    small = ["--strategy", "single", "--train-samples", "16", "--val-samples", "4", "-b", "4", "--max-steps", "1",
             "--max-chars", "5", "--wandb-mode", "disabled", "--save-every", "1", "--output-dir", str(run_dir)]
    assert main(small) == 0
    shard = next((run_dir / "checkpoints" / "step_00000001").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code = main([*small, "--max-steps", "2", "--resume", "auto"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "step_00000001 cannot be read" in err and len(err.strip().splitlines()) == 1
