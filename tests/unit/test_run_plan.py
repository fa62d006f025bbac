"""The thin entrance (issue 53): a run's derived values are computed once, into a frozen plan the loop reads, and the
loop holds no line of one engine."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from collections import Counter
from pathlib import Path

import pytest

from scale_ocr import train as train_script
from scale_ocr.run import mfu, plan
from scale_ocr.run.trainer import Trainer
from scale_ocr.train import main

ROOT = Path(__file__).resolve().parents[2]
TINY = ["crnn_mobilenet_v3_small", "--strategy", "single", "--max-steps", "3", "--train-samples", "8",
        "--val-samples", "4", "-b", "2", "--grad-accum", "2", "--max-chars", "5", "--no-eval", "--no-save-model",
        "--log-every", "1", "--sched", "cosine", "--wandb-mode", "disabled"]


def test_each_derived_value_is_computed_once(tmp_path, monkeypatch, capsys):
    """One training run calls each function that derives a value exactly once (the global batch, the rate plan,
    the steps, the warm-up, the FLOP count and the device peak), and every place that reports them agrees."""
    calls: Counter[str] = Counter()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # counted here, not read from an earlier run's

    def spy(module, name):
        real = getattr(module, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)

    for name in ("global_batch", "plan_lr", "plan_steps", "default_warmup"):
        spy(plan, name)
    spy(train_script, "build_plan")
    for name in ("flops_per_sample", "device_peak"):
        spy(mfu, name)
    run = tmp_path / "run"
    assert main([*TINY, "--output-dir", str(run)]) == 0
    assert calls == {name: 1 for name in ("global_batch", "plan_lr", "plan_steps", "default_warmup", "build_plan",
                                          "flops_per_sample", "device_peak")}
    config = json.loads((run / "config.json").read_text())
    metrics = json.loads((run / "metrics.json").read_text())
    assert config["global_batch"] == metrics["global_batch"] == 4  # 1 rank x 2 x 2
    assert config["lr_plan"]["global_batch"] == 4 and metrics["steps"] == 3
    assert capsys.readouterr().out.count("scale-ocr: MFU against") == 1  # the FLOP count is announced once


def test_the_plan_is_frozen_and_the_trainer_takes_it_and_its_parts():
    made = plan.RunPlan(train=None, run_dir=Path("run"), lr=None, steps_per_epoch=2, total_steps=4, warmup=0,
                        utilization=None, epoch_batches=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.total_steps = 5  # type: ignore[misc]
    assert list(inspect.signature(Trainer.__init__).parameters) == ["self", "plan", "parts"]


def test_the_run_directory_is_read_from_the_config_once():
    """Only the launch script turns --output-dir into the run's directory; the loop and the plan receive it."""
    readers = []
    for path in [ROOT / "scale_ocr" / "train.py", *(ROOT / "scale_ocr" / "run").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "output_dir":
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers == ["scale_ocr/train.py:" + readers[0].split(":")[1]] and len(readers) == 1, readers


def test_the_loop_holds_no_line_of_one_engine():
    """trainer.py names no engine, reduces no per-replica loss and prints no precision notice: those live behind
    the strategy's and precision's interfaces."""
    source = (ROOT / "scale_ocr" / "run" / "trainer.py").read_text(encoding="utf-8")
    tree = ast.parse(source)
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for engine in ("DataParallel", "DistributedDataParallel", "deepspeed", "fully_shard", "FSDPModule",
                   "ShardedDataParallel", "emulates_gemm"):
        assert engine not in names, f"trainer.py uses {engine}"
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "isinstance"
                and "strateg" in ast.unparse(n).lower()]
    assert '["loss"].mean()' not in source
