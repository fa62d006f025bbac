"""``--batch-ramp auto`` (issue 54): the global batch grows through accumulation (at most doubling) within
``--ramp-limit`` x B_simple and never past ``--ramp-max-batch``; its state is free of world size; and the schedule runs
in samples, so a grown batch keeps the schedule's shape over the run. The ramp trained for real, through a
resume at another world size and engine: tests/distributed/test_ramp_training.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from scale_ocr.config import TrainConfig
from scale_ocr.errors import UserError
from scale_ocr.optim import LRPlan, LRSchedule, lr_factor
from scale_ocr.run.batch_ramp import BatchRamp
from scale_ocr.run.noise_scale import SETTLED

CPU = torch.device("cpu")


def ramp(world: int = 2, **train) -> BatchRamp:
    return BatchRamp(TrainConfig(**{"batch_size": 4, "batch_ramp": "auto", **train}), world)


def readings(r: BatchRamp, b_simple: float, n: int, step: int = 0) -> list[int]:
    """The global batch after each of ``n`` readings of ``b_simple``."""
    batches = []
    for k in range(n):
        r.grow(r.propose(b_simple, True, CPU), step + k, 0)
        batches.append(r.global_batch)
    return batches


def test_the_batch_doubles_while_twice_it_fits_under_the_limit_and_stops_at_the_cap():
    r = ramp(ramp_max_batch=64, ramp_limit=1.0)  # 2 ranks x 4: 8 samples an accumulation step
    assert (r.start_batch, r.global_batch) == (8, 8)
    # SETTLED readings before the first change, and again after each; 20 x 1.0 has room for 16, not 32
    assert readings(r, 20.0, SETTLED + SETTLED) == [8] * (SETTLED - 1) + [16] * (SETTLED + 1)
    # the lowest of the last SETTLED readings decides: a higher B_simple must hold that long (a spike does not)
    assert readings(r, 1000.0, 2 * SETTLED) == [16] * (SETTLED - 1) + [32] * SETTLED + [64]
    assert [(c.before, c.after) for c in r.changes] == [(8, 16), (16, 32), (32, 64)]  # and never past 64
    # by default half of B_simple is the room, and a batch that no longer fits is kept, not shrunk
    half = ramp()
    assert readings(half, 40.0, SETTLED)[-1] == 16 and readings(half, 1.0, 2 * SETTLED)[-1] == 16
    # an unmeasured step counts no reading, and a run that does not ramp never moves
    idle = ramp()
    for _ in range(2 * SETTLED):
        idle.grow(idle.propose(1000.0, False, CPU), 0, 0)
    fixed = BatchRamp(TrainConfig(batch_size=4, grad_accum=2), 2)
    assert idle.global_batch == 8 and readings(fixed, 1e9, 2 * SETTLED)[-1] == 16 and not fixed.changes


def test_the_ramp_resumes_at_another_world_size_at_the_nearest_batch_it_can_make():
    r = ramp()
    readings(r, 1e9, 2 * SETTLED)
    state = json.loads(json.dumps(r.state_dict()))
    assert state["global_batch"] == 32 and len(state["changes"]) == 2
    wider = ramp(world=4)  # 16 an accumulation step: 32 is 2 of them
    assert wider.load_state_dict(state) and (wider.accum, wider.global_batch) == (2, 32)
    assert wider.resume_note == "batch ramp at global batch 32" and wider.changes == r.changes
    odd = ramp(world=3)  # 12 a step: 24 is the nearest at or under 32
    assert odd.load_state_dict(state) and odd.global_batch == 24 and "nearest" in odd.resume_note
    assert not BatchRamp(TrainConfig(batch_size=4), 2).load_state_dict(state)  # a fixed run keeps its flags
    assert not ramp().load_state_dict({"global_batch": "32"}) and not ramp().load_state_dict(None)


def test_the_rate_grows_with_the_batch_from_where_the_ramp_started_and_resumes_from_there():
    """By default a batch grown 4x trains at 2x the starting rate (sqrt); --lr-scaling's rule where it scales,
    --ramp-lr's where given; a run resumed on 4 ranks (starting batch 16, its own rate another) carries the rate
    from the checkpoint's start (batch 8 and its rate), so it trains at the rate the run it continues would have."""
    def grown(lr: LRPlan, world: int = 2, **train) -> BatchRamp:
        r = BatchRamp(TrainConfig(batch_size=4, batch_ramp="auto", **train), world, lr)
        readings(r, 1e9, 2 * SETTLED)  # 8 -> 16 -> 32
        return r

    plain = LRPlan(1e-3, "none", None, 8)
    r = grown(plain)
    assert r.global_batch == 32 and r.rate().peak_lr == pytest.approx(2e-3)
    assert "sqrt: global batch 32 / reference 8" in r.rate().describe()
    assert grown(LRPlan(1e-3, "linear", 8, 8)).rate().peak_lr == pytest.approx(4e-3)
    assert grown(plain, ramp_lr="none").rate().peak_lr == 1e-3
    assert grown(plain, ramp_lr="linear").rate().peak_lr == pytest.approx(4e-3)
    state = json.loads(json.dumps(r.state_dict()))
    wider = BatchRamp(TrainConfig(batch_size=4, batch_ramp="auto"), 4, LRPlan(5e-3, "none", None, 16))
    assert wider.load_state_dict(state) and wider.rate().peak_lr == pytest.approx(2e-3)
    assert "from 1e-3 at batch 8" in wider.plan_line(1000)
    legacy = BatchRamp(TrainConfig(batch_size=4, batch_ramp="auto"), 4, LRPlan(5e-3, "none", None, 16))
    assert legacy.load_state_dict({**state, "origin": None}) and legacy.rate().peak_lr == pytest.approx(5e-3 * 2 ** .5)


@pytest.mark.parametrize("flags, message", [
    ({"batch_ramp": "off", "ramp_limit": 1.0}, "--ramp-limit is a setting of --batch-ramp auto, which is off"),
    ({"batch_ramp": "off", "ramp_max_batch": 64}, "--ramp-max-batch is a setting of --batch-ramp auto"),
    ({"batch_ramp": "off", "ramp_lr": "none"}, "--ramp-lr is a setting of --batch-ramp auto"),
    ({"ramp_limit": 0.0}, "--ramp-limit 0: give a positive multiple"),
    ({"ramp_limit": math.nan}, "--ramp-limit nan: give a positive multiple"),
    ({"noise_every": 0}, "--noise-every 0 turns off"),
    ({"profile_steps": 2}, "--profile-steps 2 profiles a run's last steps"),
    ({"ramp_max_batch": 12}, "--ramp-max-batch 12: under twice this run's starting global batch"),
    ({"world": 1}, "one process with --grad-accum 1 has one: run on 2 or more ranks"),
])
def test_a_ramp_that_cannot_work_is_refused_in_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        ramp(**flags)


def test_the_schedule_runs_in_samples_so_a_grown_batch_keeps_its_shape():
    """Over 10 steps' worth of samples at the starting batch 8, a run that doubled after 4 steps reaches the same
    rate at the same samples; its state holds the samples, and one without them resumes at its steps' worth."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    plan = LRPlan(1.0, "linear", 8, 8)
    fixed = LRSchedule(optimizer, 1.0, lr_factor("cosine", 10, 0), plan=plan)
    grown = LRSchedule(optimizer, 1.0, lr_factor("cosine", 10, 0), plan=plan)
    for _ in range(6):
        fixed.step()
    for samples in (8, 8, 8, 8, 16):
        grown.step(samples)
    grown.set_plan(LRPlan(1.0, "linear", 8, 16))  # the rule carries the rate to the new batch
    assert grown.lr == pytest.approx(2 * fixed.lr) and grown.samples == fixed.samples == 48
    again = LRSchedule(optimizer, 1.0, lr_factor("cosine", 10, 0), plan=plan)
    again.load_state_dict(json.loads(json.dumps(fixed.state_dict())))
    assert again.lr == fixed.lr
    old = {k: v for k, v in fixed.state_dict().items() if k != "samples"}  # a checkpoint from before samples
    again.load_state_dict(old)
    assert again.samples == 48 and again.lr == fixed.lr


def test_the_benchmark_holds_the_ramp_against_the_best_fixed_batch_within_its_samples(tmp_path):
    """benchmarks.batch_ramp's verdicts on a made-up record: the best fixed batch is the fewest steps to the target
    among the batches reaching it on at most 1.2x batch 32's samples (a faster one past that does not count); the
    ramp's steps and samples are its first validation at or above the target; zero2 within 2 points of ddp."""
    from benchmarks import batch_ramp as bench

    def curve(batch, values, every=64):  # validations every `every` steps
        return [{"step": every * (i + 1), "value": v} for i, v in enumerate(values)]

    record = tmp_path / "record"
    record.mkdir()
    fixed = [(32, "none", curve(32, [0.5, 0.85, 0.95])),  # 90% at step 192: 6144 samples
             (64, "none", curve(64, [0.7, 0.92])),  # at step 128: 8192 samples, past 1.2 x 6144
             (128, "none", curve(128, [0.91])),  # at 64 steps but 8192 samples: too many
             (64, "sqrt", curve(64, [0.6, 0.8, 0.95], every=32))]  # at step 96: 6144 samples: the best
    (record / "results.jsonl").write_text("".join(json.dumps(
        {"status": "ok", "model": bench.MODEL, "set": "synthetic", "global_batch": b, "rule": rule, "curve": c}) + "\n"
        for b, rule, c in fixed))
    ramp_curve = [{"step": 40, "samples": 2000, "value": 0.8}, {"step": 80, "samples": 6000, "value": 0.93}]
    rows = [{"status": "ok", "set": "synthetic", "strategy": s, "curve": ramp_curve, "final": final,
             "batch_ramp": {"changes": [{"after": 64, "step": 40}]}} for s, final in (("ddp", 0.95), ("zero2", 0.92))]
    ddp, zero2 = bench.verdicts(rows, record)
    assert (ddp["best_batch"], ddp["best"]["steps"], ddp["best"]["rule"]) == (64, 96, "sqrt")
    assert ddp["ramp"] == {"steps": 80, "samples": 6000} and ddp["beats_best"] and ddp["path"] == [(64, 40)]
    assert ddp["within_ddp"] is None and zero2["within_ddp"] is False  # 3 points apart
    slow = [{**rows[0], "curve": [{"step": 100, "samples": 6000, "value": 0.93}]}]
    assert not bench.verdicts(slow, record)[0]["beats_best"]  # 100 steps against 96
