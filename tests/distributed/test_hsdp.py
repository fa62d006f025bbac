"""hsdp and zero3_hpz on 2 simulated nodes x 2 ranks: DDP's maths, the memory model's share per rank, and a
checkpoint that resumes under another engine, world size and layout.

One `scale-ocr verify` run trains ddp, hsdp and zero3_hpz as two torchrun agents (--nnodes 2) of 2 ranks each on
127.0.0.1 (that verify fails an engine whose maths differ: tests/unit/test_hybrid.py); its run folders are then read
for the memory and the checkpoint checks, so the 4-rank jobs run once.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import HOOKED_TRAIN, read_metrics, run_cmd, torchrun_train
from test_checkpoint import read_checkpoint

from scale_ocr.config import ModelConfig
from scale_ocr.planning.estimate import estimate, model_size
from scale_ocr.tasks import create_task

STEPS, BATCH, WORLD = 4, 4, 4  # verify's global batch: 4 ranks x 4


@pytest.mark.slow
def test_hsdp_and_zero3_hpz_on_two_nodes_match_ddp_and_resume_under_another_engine(tmp_path):
    root = tmp_path / "verify"
    proc = run_cmd([sys.executable, "-m", "scale_ocr", "verify", "--world-size", str(WORLD), "--nodes", "2",
                    "--steps", str(STEPS), "-b", str(BATCH), "--strategies", "ddp,hsdp,zero3_hpz",
                    "--output-dir", str(root)], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {ln.split()[0]: ln for ln in proc.stdout.splitlines() if ln.split()}
    assert rows["ddp"].endswith("reference"), proc.stdout
    assert rows["hsdp"].endswith("pass") and rows["zero3_hpz"].endswith("pass"), proc.stdout
    assert "training hsdp on 4 ranks (2 nodes x 2)" in proc.stdout

    # 1. Each rank holds what the memory model says for shard groups of 2 (a node): hsdp half the model, not a
    # quarter (replicated across the 2 nodes); zero3_hpz a quarter plus hpZ's half-model copy within the node.
    model = create_task(ModelConfig(arch="crnn_mobilenet_v3_small")).build_model()
    doc = estimate(model_size(model), WORLD, "fp32", ["ddp", "hsdp", "zero3_hpz"], model=model, ranks_per_node=2)
    for name, parts in (("hsdp", ("params", "grads", "optimizer")), ("zero3_hpz", ("params",))):
        measured, predicted = read_metrics(root / name)["state_bytes"], doc["strategies"][name]
        for part in parts:  # shards are padded to the group's size: bytes, not more
            assert measured[part] == pytest.approx(predicted[part], rel=1e-3), (name, part, measured, predicted)
    assert read_metrics(root / "hsdp")["state_bytes"]["params"] == pytest.approx(
        doc["strategies"]["ddp"]["params"] / 2, rel=1e-3)

    # 2. hsdp's checkpoint (2-D mesh: shards replicated across nodes) resumes under zero3_hpz on 2 ranks at the same
    # global batch and trains a step on; the resumed run saves what it loaded, re-sharded by DeepSpeed, before that
    # step: every tensor (weights, Adam's step/exp_avg/exp_avg_sq) is the same.
    ckpt = root / "hsdp" / "checkpoints" / f"step_{STEPS:08d}"
    dst = tmp_path / "resumed"
    resumed = torchrun_train(["--resave-on-resume", "--strategy", "zero3_hpz", "--max-steps", str(STEPS + 1),
                              "--epochs", "2", "-b", str(BATCH * 2), "--train-samples", str(STEPS * BATCH * WORLD),
                              "--val-samples", "8", "--max-chars", "5", "--no-augment", "--seed", "0",
                              "--wandb-mode", "disabled", "--resume", str(ckpt), "--output-dir", str(dst)],
                             script=HOOKED_TRAIN)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "one shard group spans all 2 ranks, so it runs as zero3" in resumed.stdout  # said, not silent
    before, after = read_checkpoint(ckpt), read_checkpoint(dst / "checkpoints" / f"step_{STEPS:08d}")
    tensors = [k for k, v in before.items() if isinstance(v, torch.Tensor)]
    assert before.keys() == after.keys() and sum(k.endswith(".exp_avg_sq") for k in tensors) > 50
    for k in tensors:
        assert torch.equal(before[k], after[k]), k
