"""The learning rate across global batches: the rule's arithmetic, the warm-up that grows with it, which rate a run
trains at and says so (first line, config.json), LAMB under a torch and a DeepSpeed engine, and a resume at another
global batch that keeps the rate of the run it continues (docs/lr-scaling.md)."""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

from scale_ocr.cli.args import parse_config
from scale_ocr.config import DEFAULT_LR_SCALING, OptimConfig, TrainConfig
from scale_ocr.errors import UserError
from scale_ocr.optim import LRPlan, LRSchedule, default_warmup, lr_factor, plan_lr, rate, scale_factor
from scale_ocr.run.batch_ramp import BatchRamp
from scale_ocr.run.loop_state import RunState
from scale_ocr.run.trainer import Trainer
from scale_ocr.strategies.deepspeed import refuse_flattened
from scale_ocr.train import main

TINY = ["crnn_mobilenet_v3_small", "--max-steps", "2", "--train-samples", "8", "--val-samples", "4", "-b", "4",
        "--max-chars", "5", "--no-eval", "--no-save-model", "--log-every", "1", "--sched", "constant",
        "--wandb-mode", "disabled", "--fonts", "classic"]  # the faces its losses were measured in


def test_rules_carry_the_rate_from_the_reference_batch():
    assert scale_factor("linear", 128, 64) == 2.0 and scale_factor("linear", 16, 64) == 0.25
    assert scale_factor("sqrt", 256, 64) == 2.0 and scale_factor("sqrt", 16, 64) == 0.5
    assert scale_factor("none", 4096, 64) == 1.0 and scale_factor("sqrt", 4096, None) == 1.0
    plan = LRPlan(1.2e-3, "linear", 64, 128)
    assert plan.peak_lr == pytest.approx(2.4e-3)
    assert plan.describe() == "lr 2.4e-3 = 1.2e-3 x 2 (linear: global batch 128 / reference 64)"
    assert LRPlan(1e-3, "none", None, 512).describe() == "lr 1e-3 unscaled (--lr-scaling none; global batch 512)"
    assert rate(3e-3 * math.sqrt(0.125)) == "1.06e-3"


def test_resolve_states_the_rate_its_batch_and_rule():
    assert DEFAULT_LR_SCALING == "none"  # the rule the scale-accuracy record chose (docs/lr-scaling.md)
    plain = parse_config(["crnn_mobilenet_v3_small"]).optim  # the model's 3e-3, as it is at any batch
    assert (plain.lr, plain.lr_reference_batch, plain.lr_scaling) == (3e-3, None, "none")
    assert plan_lr(plain, 1024).peak_lr == 3e-3
    model = parse_config(["crnn_mobilenet_v3_small", "--lr-scaling", "sqrt"]).optim  # from the convergence record's 64
    assert (model.lr, model.lr_reference_batch, model.lr_scaling) == (3e-3, 64, "sqrt")
    assert plan_lr(model, 16).peak_lr == pytest.approx(3e-3 * math.sqrt(16 / 64))
    detector = parse_config(["db_resnet50", "--lr-scaling", "linear"]).optim  # docTR's detection script's batch
    assert detector.lr_reference_batch == 2 and plan_lr(detector, 8).peak_lr == pytest.approx(4e-3)
    given = parse_config(["vitstr_tiny", "--lr", "5e-4"]).optim  # a --lr is the rate at this run's batch
    assert (given.lr_scaling, given.lr_reference_batch) == ("none", None) and plan_lr(given, 4096).peak_lr == 5e-4
    tuned = parse_config(["vitstr_tiny", "--lr", "5e-4", "--lr-reference-batch", "32", "--lr-scaling", "linear"])
    assert plan_lr(tuned.optim, 256).peak_lr == pytest.approx(4e-3)
    again = parse_config(["vitstr_tiny", "--lr", "3e-3", "--lr-reference-batch", "64", "--lr-scaling", "sqrt"])
    assert again.optim == model  # config.json's optim section scales the same way when run again
    assert parse_config(["crnn_mobilenet_v3_small", "--lr", "3e-3"]).optim == plain  # and so does the default's


@pytest.mark.parametrize(("argv", "says"), [
    (["--lr", "1e-3", "--lr-scaling", "linear"], "--lr-scaling linear with --lr 0.001: say which global batch"),
    (["--lr-reference-batch", "32"], "--lr-reference-batch 32 names the batch a --lr was tuned at"),
    (["--lr", "1e-3", "--lr-reference-batch", "32", "--lr-scaling", "none"],
     "--lr-reference-batch 32 with --lr-scaling none"),
    (["--lr", "1e-3", "--lr-reference-batch", "32"], "with the default --lr-scaling (none): none uses --lr as given"),
    (["--lr", "1e-3", "--lr-reference-batch", "0"], "--lr-reference-batch 0: give the global batch"),
])
def test_bad_combinations_are_one_line(argv, says):
    with pytest.raises(UserError, match=re.escape(says)):
        parse_config(["crnn_mobilenet_v3_small", *argv])


def test_warmup_grows_with_the_factor():
    cosine, constant = OptimConfig(sched="cosine"), OptimConfig(sched="constant")
    assert default_warmup(cosine, 1000) == 50 and default_warmup(constant, 1000) == 0
    assert default_warmup(cosine, 1000, 4.0) == 200 and default_warmup(constant, 1000, 4.0) == 200
    assert default_warmup(cosine, 1000, 64.0) == 500  # at most half the run
    assert default_warmup(cosine, 1000, 0.25) == 50  # a lowered rate keeps the reference's warm-up
    assert default_warmup(OptimConfig(sched="onecycle"), 1000, 8.0) == 0  # its 30% rise is its warm-up
    assert default_warmup(OptimConfig(sched="cosine", warmup_steps=7), 1000, 8.0) == 7  # as given


def _restore(schedule: LRSchedule, saved: dict, global_batch: int) -> str:
    """Trainer.restore on a trainer reduced to what it reads: 10 steps per epoch, resumed at another global batch."""
    plan = SimpleNamespace(global_batch=global_batch, steps_per_epoch=10, total_steps=100)
    fake = SimpleNamespace(state=RunState(), schedule=schedule, plan=plan, cfg=TrainConfig(), data=SimpleNamespace(
        position=SimpleNamespace(restore=lambda *a: None)), ramp=BatchRamp(TrainConfig(), 1), _done=lambda: False)
    meta = {"step": 4, "epoch": 0, "samples_in_epoch": 256, "global_batch": 64, "steps_per_epoch": 20,
            "schedule": saved, "best": None}
    return Trainer.restore(fake, meta)


def test_resume_at_another_global_batch_keeps_the_rate_unless_told():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    first = LRSchedule(opt, 3e-3, lr_factor("constant", 100, 0), plan=LRPlan(3e-3, "sqrt", 64, 64))
    saved = first.state_dict()
    now = LRPlan(3e-3, "sqrt", 64, 256)  # twice the world size and micro-batch: 6e-3 on its own
    kept = LRSchedule(opt, now.peak_lr, lr_factor("constant", 100, 0), "keep", now)
    where = _restore(kept, saved, 256)
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3) and kept.state_dict()["peak_lr"] == pytest.approx(3e-3)
    assert where.endswith("; lr kept at 3e-3, the rate of the run it continues (this run alone would train at lr "
                          "6e-3 = 3e-3 x 2 (sqrt: global batch 256 / reference 64); --lr-on-resume rescale for that)")
    rescaled = LRSchedule(opt, now.peak_lr, lr_factor("constant", 100, 0), "rescale", now)
    assert "lr rescaled (--lr-on-resume rescale): lr 6e-3 = 3e-3 x 2" in _restore(rescaled, saved, 256)
    assert opt.param_groups[0]["lr"] == pytest.approx(6e-3)
    given = LRPlan(1e-4, "none", None, 256)  # a --lr given on resume is the rate wanted
    changed = LRSchedule(opt, given.peak_lr, lr_factor("constant", 100, 0), "keep", given)
    assert _restore(changed, saved, 256).endswith("; lr 1e-4 unscaled (--lr-scaling none; global batch 256), as this "
                                                  "run's flags set it (the run it continues trained at 3e-3)")
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-4)
    old = LRSchedule(opt, 6e-3, lr_factor("constant", 100, 0), "keep", now)
    assert "(the checkpoint records no rate)" in _restore(old, {"step_count": 4}, 256)


def test_deepspeed_refuses_lamb_where_it_flattens_tensors():
    refuse_flattened({"zero_optimization": {"stage": 0}, "bf16": {"enabled": False}}, "s0.json", "Lamb")  # whole
    with pytest.raises(UserError, match=r"--optim lamb under zero2\.json \(ZeRO stage 2\): DeepSpeed flattens"):
        refuse_flattened({"zero_optimization": {"stage": 2}}, "zero2.json", "Lamb")
    with pytest.raises(UserError, match="its 16-bit optimizer"):
        refuse_flattened({"bf16": {"enabled": True}}, "s0.json", "Lamb")
    with pytest.raises(UserError, match="\"optimizer\" section would replace scale-ocr's Lamb"):
        refuse_flattened({"optimizer": {"type": "Adam"}}, "mine.json", "Lamb")


def test_lamb_under_zero2_is_one_line_and_exit_2(tmp_path, capsys):
    assert main([*TINY, "--strategy", "zero2", "--optim", "lamb", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("scale-ocr: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "zero2.json (ZeRO stage 2): DeepSpeed flattens tensors into partitions" in lines[0]


@pytest.mark.parametrize("engine", ["single", "deepspeed"])
def test_lamb_trains_and_the_run_records_its_rate(engine, tmp_path, capsys):
    """One process, two LAMB steps: the same losses under a torch engine and DeepSpeed's stage 0 (fp32, whole
    tensors); the first line and config.json say the rate and the rule that made it."""
    extra = []
    if engine == "deepspeed":
        ds = tmp_path / "stage0.json"
        ds.write_text(json.dumps({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                                  "zero_optimization": {"stage": 0}}))
        extra = ["--ds-config", str(ds)]
    run = tmp_path / "run"
    argv = [*TINY, "--strategy", engine, *extra, "--optim", "lamb", "--lr-scaling", "sqrt", "--output-dir", str(run)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = "lr 7.5e-4 = 3e-3 x 0.25 (sqrt: global batch 4 / reference 64)"
    assert f"scale-ocr: {line}, warm-up 0 of 2 steps (constant)" in out.splitlines()[:4], out  # after the fonts
    doc = json.loads((run / "config.json").read_text())
    assert doc["lr_plan"] == {"peak_lr": pytest.approx(7.5e-4), "base_lr": 3e-3, "factor": 0.25, "rule": "sqrt",
                              "reference_batch": 64, "global_batch": 4, "warmup_steps": 0, "line": line}
    assert doc["optim"]["optim"] == "lamb" and doc["optim"]["lr"] == 3e-3  # before scaling: it scales again
    losses = [json.loads(x)["train/loss"] for x in (run / "metrics.jsonl").read_text().splitlines()
              if "train/loss" in x]
    assert losses == pytest.approx([5.0510, 5.0163], abs=1e-3), losses  # as measured under single (blank-prior head)


def test_a_scaled_rate_that_overflows_names_the_scaling_not_the_flag():
    """L01: --lr 1e308 x 4 (linear, reference batch 1) was reported as "--lr inf is not a finite number"."""
    from scale_ocr.run.plan import run_lr

    cfg = parse_config(["--lr", "1e308", "--lr-scaling", "linear", "--lr-reference-batch", "1", "-b", "4"])
    with pytest.raises(UserError) as err:
        run_lr(cfg, 1)
    text = str(err.value)
    assert "--lr 1e+308 scaled by --lr-scaling linear" in text and "x 4" in text and "overflows to inf" in text
    assert "--lr-scaling none" in text and "--lr inf" not in text
