"""``scale-ocr plan``: steps to a target at any batch through one run (McCandlish's S(B)), and the plan's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scale_ocr.cli.main import main as cli_main
from scale_ocr.config import RAMP_LIMIT
from scale_ocr.planning.to_target import SPREAD, StepsModel, path_mean, steps_band

ANCHOR_BATCH, ANCHOR_STEPS, B_SIMPLE = 16, 40, 112  # S_min = 40 / (1 + 112/16) = 5


def test_steps_model_passes_through_its_anchor_and_trades_steps_for_samples():
    """S(B) = S_min (1 + B_crit/B) through the anchor: exact there; above B_crit hardly fewer steps for many more
    samples (E(B_crit) = 2 E_min); the band's ends are B_crit / SPREAD and x SPREAD, and at the anchor it is a point."""
    model = StepsModel.anchored(ANCHOR_BATCH, ANCHOR_STEPS, B_SIMPLE)
    assert model.s_min == pytest.approx(5) and model.steps(ANCHOR_BATCH) == pytest.approx(ANCHOR_STEPS)
    # B_crit for a run to a target: B_simple along the way, each reading weighted by 1 / (1 + b / batch)
    w9, w112 = 1 / (1 + 9 / 16), 1 / (1 + 112 / 16)
    assert path_mean([10, 20, 30, 40, 50], [9, 9, 112, 112, 5000], 40, 16) == pytest.approx(
        (9 * w9 + 112 * w112) / (w9 + w112)) == pytest.approx(25.8, abs=0.05)
    assert model.samples(B_SIMPLE) == pytest.approx(2 * model.e_min) and model.steps(B_SIMPLE) == pytest.approx(10)
    band = steps_band(ANCHOR_BATCH, ANCHOR_STEPS, B_SIMPLE, ANCHOR_BATCH)
    assert band.low == pytest.approx(band.high) == pytest.approx(ANCHOR_STEPS)
    for batch in (4, 64, 1024):
        band = steps_band(ANCHOR_BATCH, ANCHOR_STEPS, B_SIMPLE, batch)
        ends = [StepsModel.anchored(ANCHOR_BATCH, ANCHOR_STEPS, B_SIMPLE * f).steps(batch)
                for f in (1 / SPREAD, SPREAD)]
        assert band.low == pytest.approx(min(ends)) and band.high == pytest.approx(max(ends))
        assert band.low < band.steps < band.high


CONFIG = {"model": {"arch": "crnn_mobilenet_v3_small", "input_size": [32, 128]}, "task": "recognition",
          "train": {"batch_size": ANCHOR_BATCH, "grad_accum": 1, "precision": "fp32"},
          "lr_plan": {"peak_lr": 0.001}, "world_size": 1}
METRICS = {"strategy": "single", "world_size": 1, "global_batch": ANCHOR_BATCH, "steps": 60, "epochs": 3}


def write_run(run_dir: Path, curves: list[dict], metrics: dict | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(CONFIG))
    (run_dir / "metrics.json").write_text(json.dumps(metrics or METRICS))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in curves))
    return run_dir


# B_simple along the way to the target (step 40) is B_SIMPLE; the reading after it (step 50) counts for nothing
CURVES = [{"step": s, "train/step_time": 0.5, "noise/b_simple": B_SIMPLE if s <= 40 else 9e4}
          for s in (10, 20, 30, 40, 50)]
CURVES += [{"step": 20, "val/exact_match": 0.3}, {"step": 40, "val/exact_match": 0.55}]


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_plan_through_a_run_on_a_datasheet_cluster(tmp_path, capsys):
    """The anchor is the first validation at the target (step 40) and the B_simple logged by then; each row's
    steps are S(B) at its global batch, its time those steps at its step time, and its batch at most the ramp's
    share of B_crit; pinned
    at the anchor's batch, the steps are the anchor's own."""
    run = write_run(tmp_path / "run", CURVES)
    code, out, err = _plan(capsys, str(run), "--target", "0.5", "--device", "h100", "--devices", "1,4,256", "--json",
                           "--plot", str(tmp_path / "plan.png"))
    assert code == 0, err
    doc = json.loads(out)
    anchor = doc["anchor"]
    assert (anchor["steps"], anchor["b_simple"], anchor["samples"]) == (ANCHOR_STEPS, pytest.approx(B_SIMPLE), 640)
    assert anchor["seconds"] == pytest.approx(20.0) and doc["s_min"] == pytest.approx(5)
    model = StepsModel(5, B_SIMPLE)
    for rows in doc["strategies"].values():
        for r in rows:
            assert r["fits"] and r["steps"] == pytest.approx(model.steps(r["global_batch"]))
            assert r["seconds"] == pytest.approx(r["steps"] * r["step_s"])
            assert r["global_batch"] <= RAMP_LIMIT * B_SIMPLE or r["per_device"] == 1
        assert rows[-1]["past_knee"] and not rows[0]["past_knee"]  # 256 devices: 256 samples a step at least
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
    code, out, err = _plan(capsys, str(run), "--target", "0.5", "--device", "h100", "--devices", "1,2",
                           "--global-batch", str(ANCHOR_BATCH), "--strategies", "ddp", "--json")
    rows = json.loads(out)["strategies"]["ddp"]
    assert [r["steps"] for r in rows] == [pytest.approx(ANCHOR_STEPS)] * 2, err
    assert [r["per_device"] for r in rows] == [16, 8]


@pytest.mark.parametrize(("curves", "metrics", "argv", "words"), [
    (CURVES, None, ["--target", "0.9"], "never reached exact_match 0.9 (its best validation exact_match was 0.55)"),
    ([r for r in CURVES if "noise/b_simple" not in r], None, ["--target", "0.5"], "logged no gradient noise scale"),
    (CURVES, {**METRICS, "batch_ramp": {"start_batch": 8}}, ["--target", "0.5"], "grew its batch"),
    (CURVES, None, ["--target", "50"], "--target 50 is not a fraction"),
    (CURVES, None, ["--target", "0.5", "--devices", "0,2"], "each count from 1"),
])
def test_what_the_plan_cannot_use_is_one_line(tmp_path, capsys, curves, metrics, argv, words):
    run = write_run(tmp_path / "run", curves, metrics)
    code, out, err = _plan(capsys, str(run), "--device", "h100", *argv)
    lines = [ln for ln in err.splitlines() if ln.startswith("scale-ocr")]
    assert code == 2 and len(lines) == 1 and words in lines[0] and "Traceback" not in err, err


def test_plan_check_holds_each_prediction_against_its_measured_run():
    """benchmarks.plan_check's verdict per device count: predicted over measured training seconds, within 30%."""
    from benchmarks.plan_check import verdicts

    runs = [{"kind": "run", "ranks": n, "status": "ok", "steps_to_target": 1536, "seconds_to_target": s, "final": 0.95}
            for n, s in ((2, 200.0), (1, 300.0))]
    plan = {"kind": "plan", "status": "ok", "rows": [
        {"devices": 1, "per_device": 32, "steps": 1536, "step_s": 0.25, "seconds": 384.0},
        {"devices": 2, "per_device": 16, "steps": 1536, "step_s": 0.125, "seconds": 192.0}]}
    found = {v["devices"]: v for v in verdicts([*runs, plan])}
    assert found[1]["ratio"] == pytest.approx(1.28) and found[1]["within"]
    assert found[2]["ratio"] == pytest.approx(0.96) and found[2]["within"]
    assert not verdicts([*runs, {**plan, "rows": [{**plan["rows"][0], "seconds": 400.0}]}])[0]["within"]
    # away from the anchor's batch (--away-batch): its run and plan line carry their global batch, the anchor's
    # lines of a record from before it none (32)
    away = [{"kind": "run", "ranks": 2, "global_batch": 64, "status": "ok", "steps_to_target": 1000,
             "seconds_to_target": 150.0, "final": 0.95},
            {"kind": "plan", "global_batch": 64, "status": "ok", "rows": [
                {"devices": 2, "per_device": 32, "steps": 800, "step_s": 0.15, "seconds": 120.0}]}]
    found = {(v["global_batch"], v["devices"]): v for v in verdicts([*runs, plan, *away])}
    assert set(found) == {(32, 1), (32, 2), (64, 2)} and found[(32, 2)]["ratio"] == pytest.approx(0.96)
    assert found[(64, 2)]["ratio"] == pytest.approx(0.8) and found[(64, 2)]["measured_steps"] == 1000
