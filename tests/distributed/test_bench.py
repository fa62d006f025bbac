"""The scaling benchmark: real jobs on a tiny model, OOM recorded as a result, reports rebuilt from results.jsonl."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
from conftest import fixture_dir, run_cmd

from benchmarks.harness import Config, classify, work_dir
from benchmarks.report import build_report
from benchmarks.scaling import PRESETS, Suite, plan
from scale_ocr.errors import UserError


def _bench(out: Path, *args: str, timeout: int = 600):
    return run_cmd([sys.executable, "-m", "benchmarks.scaling", *args, "--wandb-mode", "disabled", "--out", str(out)],
                   timeout=timeout)


def _results(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory):
    """DDP and ZeRO-2 at world size 2 on the smallest CRNN, plus the DataParallel baseline."""
    with fixture_dir(tmp_path_factory, "bench") as root:
        out = root / "tiny"
        proc = _bench(out, "--models", "crnn_mobilenet_v3_small", "--strategies", "dp,ddp,zero2", "--world-sizes",
                      "2", "--batch-size", "4", "--steps", "3", "--warmup", "1", "--precision", "fp32")
        assert proc.returncode == 0, proc.stderr[-3000:]
        yield out, proc
        shutil.rmtree(work_dir(out), ignore_errors=True)  # the runs' scratch, under benchmarks/.work


@pytest.mark.slow
def test_runner_measures_every_configuration(tiny_suite):
    out, proc = tiny_suite
    rows = _results(out)
    assert [r["config"]["key"] for r in rows] == [
        "crnn_mobilenet_v3_small/dp/ws1/r0", "crnn_mobilenet_v3_small/ddp/ws2/r0",
        "crnn_mobilenet_v3_small/zero2/ws2/r0"]
    launchers = {r["config"]["strategy"]: r["config"]["launcher"] for r in rows}
    assert launchers == {"dp": "python", "ddp": "torchrun", "zero2": "deepspeed"}
    for r in rows:
        m = r["metrics"]
        assert r["status"] == "ok", r
        assert m["timed_steps"] == 3 and m["samples_per_sec"] > 0
        assert m["samples_per_sec_p25"] <= m["samples_per_sec"] <= m["samples_per_sec_p75"]
        assert 0 < m["step_time_p50"] <= m["step_time_p95"]
        assert m["peak_memory_bytes"] > 0 and m["flops_per_sample"] > 0
        # Model state counted from the tensors agrees with the memory model.
        assert m["measured_over_predicted"] == pytest.approx(1.0, abs=0.1), r["config"]["key"]
        assert m["versions"]["torch"] and m["hardware"]["cores"] >= 1
        if r["config"]["world_size"] == 2:  # profiled after the timed steps: collectives were in flight
            assert 0 < m["comm_share"] <= 1
    by_key = {r["config"]["key"]: r["metrics"]["state_bytes"] for r in rows}
    # ZeRO-2 at two ranks holds half the Adam moments DDP replicates (plus its fp32 partition of the weights:
    # 6 of DDP's 8 bytes a parameter), and DDP as much as DataParallel's one copy.
    assert by_key["crnn_mobilenet_v3_small/zero2/ws2/r0"]["optimizer"] < \
        0.8 * by_key["crnn_mobilenet_v3_small/ddp/ws2/r0"]["optimizer"]
    assert by_key["crnn_mobilenet_v3_small/ddp/ws2/r0"]["model_state"] == pytest.approx(
        by_key["crnn_mobilenet_v3_small/dp/ws1/r0"]["model_state"], rel=0.01)
    dp = rows[0]["config"]
    # DataParallel: the largest world's global batch (2 x 4) in one process with every core.
    assert dp["batch_size"] == 8 and dp["threads_per_rank"] >= 2 * rows[1]["config"]["threads_per_rank"]
    report = (out / "report.md").read_text()
    for name in ("| dp | 1 |", "| ddp | 2 |", "| zero2 | 2 |", "measured ÷ predicted"):
        assert name in report, name
    for png in ("throughput", "memory", "ratio_to_dp"):
        assert (out / f"{png}_crnn_mobilenet_v3_small.png").stat().st_size > 5000


@pytest.mark.slow
def test_report_regenerates_from_results_alone(tiny_suite, tmp_path):
    out, _ = tiny_suite
    copy = tmp_path / out.name  # the report names its own directory in the rebuild command
    copy.mkdir()
    shutil.copy(out / "results.jsonl", copy / "results.jsonl")
    proc = run_cmd([sys.executable, "-m", "benchmarks.report", str(copy)])
    assert proc.returncode == 0, proc.stderr
    assert (copy / "report.md").read_text() == (out / "report.md").read_text()
    for png in sorted(out.glob("*.png")):
        assert (copy / png.name).read_bytes() == png.read_bytes(), png.name


@pytest.mark.slow
def test_time_check_sets_the_time_model_beside_the_record(tiny_suite, tmp_path):
    """``benchmarks.time_check`` runs ``estimate-memory --time --device host`` (host probes, each engine's one-rank
    step) at the record's settings and sets its prediction beside the measured step."""
    out, _ = tiny_suite
    check = tmp_path / "time"
    cmd = [sys.executable, "-m", "benchmarks.time_check", str(out), "--strategies", "zero2", "--out", str(check)]
    proc = run_cmd(cmd, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in (check / "results.jsonl").read_text().splitlines()]
    # One engine of the record's: ZeRO-2, whose optimizer step the model halves at 2 ranks (each steps its half).
    assert [(ln["model"], ln["strategy"], ln["world_size"]) for ln in lines] == [
        ("crnn_mobilenet_v3_small", "zero2", 2)]
    for ln in lines:
        engine, predicted = ln["engine_one_rank"], ln["predicted"]
        assert engine["compute"] > 0 and engine["threads"] >= 1, ln
        assert predicted["step_s"] == pytest.approx(predicted["compute_s"] + predicted["exposed_comm_s"]
                                                    + predicted["optimizer_s"] + predicted["other_s"])
        assert 0.2 < ln["ratio"] < 5, ln  # a broken model is off by far more; the 25% target is the benchmark's
        assert "gloo" in ln["source"] and "engine" in ln["source"]
    zero2 = lines[0]
    assert zero2["predicted"]["optimizer_s"] == pytest.approx(zero2["engine_one_rank"]["optimizer"] / 2)
    report = (check / "report.md").read_text()
    assert "## Predicted / measured step time" in report and "of 1 within 25%" in report
    assert (check / "command.txt").read_text().startswith("python -m benchmarks.time_check")
    again = run_cmd(cmd, timeout=60)  # a results folder is never rewritten
    assert again.returncode == 2 and "already holds results" in again.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_out_of_memory_is_a_result(tmp_path):
    """A job beyond its memory is recorded as oom; the suite carries on and reports it."""
    out = tmp_path / "oom"
    # vitstr_base's fp32 Adam state alone (85M x 16 bytes) is over a 1.2 GB per-process cap.
    proc = _bench(out, "--models", "vitstr_base", "--strategies", "single", "--world-sizes", "1", "--steps", "1",
                  "--warmup", "0", "--batch-size", "2", "--precision", "fp32", "--memory-limit-gb", "1.2")
    shutil.rmtree(work_dir(out), ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = _results(out)
    assert row["status"] == "oom", row
    assert "out of memory" in row["error"]
    assert row["metrics"]["predicted"]["model_state"] > 1.2 * 2**30  # the memory model saw it coming
    assert "**oom**" in (out / "report.md").read_text()


def test_classify_exit_codes_and_messages():
    assert classify(0, "") == ("ok", None)
    assert classify(3, "scale-ocr: error: out of memory on rank 1 (...)")[0] == "oom"
    assert classify(1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")[0] == "oom"
    assert classify(-9, "")[0] == "oom"  # the kernel's OOM killer
    status, error = classify(2, "noise\nscale-ocr: error: unknown model 'x'\n")
    assert status == "failed" and error == "scale-ocr: error: unknown model 'x'"


def test_plan_gives_dataparallel_the_whole_machine():
    suite = Suite(models=("m",), strategies=("dp", "ddp", "zero3"), world_sizes=(1, 2, 4), batch_size=8)
    jobs = plan(suite, cores=16, gpus=0)
    assert jobs[0] == Config("m", "dp", 1, 32, 0, 16, "python", "bf16")  # one process, all cores, 4 x 8 samples
    assert {(j.strategy, j.world_size, j.threads_per_rank, j.launcher) for j in jobs[1:]} == {
        ("ddp", 1, 4, "torchrun"), ("ddp", 2, 4, "torchrun"), ("ddp", 4, 4, "torchrun"),
        ("zero3", 1, 4, "deepspeed"), ("zero3", 2, 4, "deepspeed"), ("zero3", 4, 4, "deepspeed")}
    assert all(j.world_size <= 2 for j in plan(suite, cores=16, gpus=2))  # no more ranks than GPUs


def test_presets_name_registered_models_and_strategies():
    from scale_ocr.models import list_models
    from scale_ocr.strategies import list_strategies

    for name, suite in PRESETS.items():
        assert set(suite.models) <= set(list_models()), name
        assert set(suite.strategies) <= set(list_strategies()), name
    # The quick preset's largest model is big enough for sharding to show (issue 5).
    assert "vitstr_small" in PRESETS["quick"].models


def _handwritten(out: Path) -> Path:
    """A results.jsonl as the runner writes it: DataParallel, DDP at 1 and 2 ranks, FSDP, and one OOM."""
    def row(strategy, ws, sps, state, status="ok"):
        metrics = {"hardware": {"host": "h", "cpu": "cpu", "cores": 2, "memory_bytes": 2**34, "gpus": []},
                   "versions": {"torch": "2", "deepspeed": "0", "fairscale": "0", "python": "3", "scale-ocr": "0",
                                "git": "abc"}}
        if status == "ok":
            metrics.update(samples_per_sec=sps, samples_per_sec_p25=sps * 0.9, samples_per_sec_p75=sps * 1.1,
                           step_time_p50=8 / sps, step_time_p95=9 / sps, peak_memory_bytes=2**30,
                           state_bytes={"params": state, "grads": state, "optimizer": 2 * state, "other": 0,
                                        "host": 0, "model_state": 4 * state},
                           predicted={"params": state, "grads": state, "optimizer": 2 * state, "other": 0,
                                      "model_state": 4 * state, "ideal": 4 * state},
                           measured_over_predicted=1.0, achieved_tflops=0.1, mfu=None)
        cfg = {"model": "m", "strategy": strategy, "world_size": ws, "batch_size": 8, "repeat": 0,
               "key": f"m/{strategy}/ws{ws}/r0", "params": 10**6, "precision": "bf16", "steps": 3, "warmup": 1,
               "preset": None, "threads_per_rank": 1, "launcher": "torchrun"}
        return {"config": cfg, "status": status, "error": None if status == "ok" else "out of memory",
                "metrics": metrics}

    lines = [row("dp", 1, 100, 4e6), row("ddp", 1, 60, 4e6), row("ddp", 2, 110, 4e6), row("fsdp", 2, 90, 2e6),
             row("zero3", 2, 0, 0, status="oom")]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return out


def test_report_from_a_handwritten_results_file(tmp_path):
    """Rebuilding twice from the same results.jsonl gives the same bytes (fast; no jobs launched)."""
    _handwritten(tmp_path)
    first = build_report(tmp_path).read_text()
    pngs = {p.name: p.read_bytes() for p in tmp_path.glob("*.png")}
    assert build_report(tmp_path).read_text() == first
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.png")} == pngs and len(pngs) == 3
    assert "| ddp | 2 | 110.0 (99.0–121.0) | 1.10 | 92% |" in first
    assert "| fsdp | 1.9 | 1.9 | 3.8 | 0.0 | 7.6 | 7.6 | 1.000 | 50% | 7.6 |" in first
    assert "`m/zero3/ws2/r0`: **oom**: out of memory" in first


def test_wandb_summary_run_is_written_offline(tmp_path, monkeypatch):
    from benchmarks.report import log_to_wandb
    from tests.helpers.wandb_reader import read_offline_run

    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = _handwritten(tmp_path / "wb-suite")
    build_report(out)
    try:
        run_dir = Path(log_to_wandb(out, "offline"))
        deadline = time.time() + 30  # W&B's service writes the log asynchronously; give a loaded machine time

        def read():
            try:
                return read_offline_run(run_dir.parent)
            except (ValueError, StopIteration):  # no file yet, or a chunk still being written
                return None

        while ((run := read()) is None or run.run_id is None) and time.time() < deadline:
            time.sleep(0.5)
        assert run is not None
        assert run.group == "wb-suite" and run.project == "scale-ocr"
        logged = {k.split("/")[0] for h in run.history for k in h}  # media items log as KEY/_type, KEY/path, ...
        assert {"results", "throughput_m", "memory_m", "ratio_to_dp_m"} <= logged
    finally:
        shutil.rmtree(work_dir(out), ignore_errors=True)


@pytest.mark.slow
def test_overhead_runs_the_trainer_and_the_hand_written_loop(tmp_path):
    """benchmarks.overhead, for real: one pair, the trainer then the textbook loop, and the report's ratio is
    trainer / hand loop (the alternation over pairs is tested with a stub below)."""
    out = tmp_path / "overhead"
    proc = run_cmd([sys.executable, "-m", "benchmarks.overhead", "--strategies", "single", "--steps", "8",
                    "--pairs", "1", "-b", "4", "--wandb-mode", "disabled", "--out", str(out)], timeout=600)
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
        assert [(ln["side"], ln["pair"]) for ln in lines] == [("trainer", 0), ("hand", 0)]
        assert all(ln["status"] == "ok" and ln["samples_per_sec"] > 0 and ln["warmup"] == 2 for ln in lines)
        (row,) = json.loads((out / "summary.json").read_text())
        assert row["ratios"] == [pytest.approx(lines[0]["samples_per_sec"] / lines[1]["samples_per_sec"])]
        assert row["min"] == row["median"] == row["max"] and row["pairs"] == 1
        assert "| single | 1 | " in (out / "report.md").read_text()
    finally:
        shutil.rmtree(work_dir(out), ignore_errors=True)


def test_overhead_alternates_the_order_every_pair(tmp_path, monkeypatch):
    """Pairs run a b, b a, a b: drift in the machine's speed falls on both sides; each ratio pairs one pair's runs."""
    from benchmarks import overhead

    ran = []

    def fake(cmd, metrics, threads, timeout):
        side = "hand" if any("hand_loop" in c for c in cmd) else "trainer"
        ran.append(side)
        return "ok", None, 1.0, 100.0 + len(ran)

    monkeypatch.setattr(overhead, "timed_job", fake)
    monkeypatch.setattr(overhead, "data_args", lambda a, task, work: (["--data-cache", "x"], ["--data-cache", "x"]))
    out = tmp_path / "alternation"
    args = overhead.parse(["--strategies", "ddp", "--pairs", "3", "--out", str(out)])
    try:
        overhead.run(args)
    finally:
        shutil.rmtree(work_dir(out), ignore_errors=True)
    assert ran == ["trainer", "hand", "hand", "trainer", "trainer", "hand"]
    (row,) = overhead.summarize([json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()])
    assert row["ratios"] == [pytest.approx(101 / 102), pytest.approx(104 / 103), pytest.approx(105 / 106)]


def test_noise_scale_reports_agreement_and_the_cost_of_a_reading_within_one_run(tmp_path, monkeypatch):
    """benchmarks.noise_scale with stub jobs: part 1 one run per strategy at the same global batch, part 1b ddp again
    with its kernels one instruction set lower, part 2 one run per strategy at --noise-every 2 with every step
    logged; the report's spread is max / min of the distributed finals, the yardstick's the two ddp runs', and a
    reading's cost each measured step's time over its two neighbours' mean (fast; no job launched)."""
    from benchmarks import noise_scale

    ran = []
    finals = {"ddp": 40.0, "fsdp": 44.0, "zero2": 41.0, "zero3": 42.0, "single": 30.0}

    def fake_job(cmd, threads, timeout, limit, env=None):
        flags = ("--strategy", "--noise-every", "--log-every", "--grad-accum")
        ran.append([cmd[cmd.index(flag) + 1] for flag in flags] + [(env or {}).get("ATEN_CPU_CAPABILITY")])
        return "ok", None, 1.0

    def fake_read(run_dir):
        strategy = ran[-1][0] if len(ran) != 6 else "zero3"  # the yardstick's ddp reads 42 (zero3's) for 40
        # steps 1-30: unmeasured 100 ms with a drift of 1 ms a step, measured (even) 4% over their neighbours
        times = [[k, (0.1 + 0.001 * k) * (1.04 if k % 2 == 0 else 1)] for k in range(1, 31)]
        return {"curve": [{"step": 10, "b_simple": finals[strategy]}], "global_batch": 64, "train_loss": 1.0,
                "noise_scale": {"b_simple": finals[strategy], "b_small": 16, "b_big": 64, "readings": 2},
                "step_times": times}

    monkeypatch.setattr(noise_scale, "run_job", fake_job)
    monkeypatch.setattr(noise_scale, "read_run", fake_read)
    monkeypatch.setattr(noise_scale, "task_data", lambda task, work, n: ["--data-cache", "x"])
    monkeypatch.setattr(noise_scale, "window_rate", lambda side, m, w: 100.0)
    out = tmp_path / "noise"
    args = noise_scale.parse(["--strategies", "ddp,fsdp,zero2,zero3,single", "--cost-steps", "25", "--out", str(out)])
    try:
        noise_scale.run(args)
    finally:
        shutil.rmtree(work_dir(out), ignore_errors=True)
    # ranks x accumulation: 2 x 2 distributed, 1 x 4 single: one global batch
    assert [r[:4] for r in ran[:5]] == [[s, "10", "10", "4" if s == "single" else "2"] for s in ("ddp", "fsdp",
                                                                                               "zero2", "zero3",
                                                                                               "single")]
    assert {r[4] for r in ran[:5] + ran[6:]} == {None}  # only the yardstick's kernels are held lower
    assert ran[5][:4] == ["ddp", "10", "10", "2"] and ran[5][4] == noise_scale.lower_isa()[1]["ATEN_CPU_CAPABILITY"]
    assert [r[1:3] for r in ran[6:]] == [["2", "1"]] * 5
    report = noise_scale.write_report(out).read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agreement"]["spread"] == pytest.approx(44 / 40) and summary["agreement"]["pass"]
    assert summary["agreement"]["jitter"]["spread"] == pytest.approx(42 / 40)
    assert "spread **1.050**" in report
    ddp = next(r for r in summary["cost"] if r["strategy"] == "ddp")
    assert ddp["median"] == pytest.approx(1.04) and ddp["default_cost"] == pytest.approx(0.004)
    assert ddp["steps"] == len(range(12, 30, 2))  # after the first 10, each with both neighbours
    assert "1.100 (max / min; target <= 1.2): PASS" in report and (out / "b_simple.png").is_file()
    assert "| +4.0% | +0.40% | yes |" in report


def test_critical_batch_fits_the_knee_of_steps_to_target(tmp_path):
    """benchmarks.critical_batch on a record whose curves reach 50% at S(B) = 200 + 32,000/B steps (B_crit 160) finds
    that knee, takes each batch's fewest steps over its rules, counts a batch that stopped short as a lower bound,
    and sets a run's online B_simple beside the knee (fast: no job launched)."""
    from benchmarks import critical_batch

    record, run = tmp_path / "record", tmp_path / "run"
    record.mkdir()
    run.mkdir()
    lines = []
    for batch, rule, slower in ((32, "none", 1.0), (32, "sqrt", 1.5), (64, "none", 1.0), (128, "none", 1.0),
                                (512, "none", None)):
        steps = 200 + 32000 / batch
        # exact match rising linearly to 100% at 2 x the steps to 50% (never, for the batch that stopped short)
        curve = [{"step": k, "value": min(1.0, k / (2 * steps * slower)) if slower else 0.0}
                 for k in range(16, 4096 + 1, 16)]
        lines.append({"kind": "recognition", "model": "m", "set": "synthetic", "global_batch": batch, "rule": rule,
                      "status": "ok", "steps": 4096, "curve": curve})
    (record / "results.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    (run / "metrics.json").write_text(json.dumps({"noise_scale": {"b_simple": 300.0, "readings": 20},
                                                  "global_batch": 32}))
    # the run's B_simple grows as it trains; it reaches 50% at step 20 (B_simple 100 then), never 90%
    logged = [{"step": 10, "noise/b_simple": 60.0}, {"step": 20, "noise/b_simple": 100.0, "val/exact_match": 0.55},
              {"step": 30, "noise/b_simple": 300.0, "val/exact_match": 0.6}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged))
    out = tmp_path / "knee"
    assert critical_batch.main([str(record), "--noise", f"m/synthetic={run}", "--out", str(out)]) == 0
    rows = {r["target"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    half = rows[0.5]
    assert half["fit"]["b_crit"] == pytest.approx(160, rel=0.02) and half["points"]["32"]["rule"] == "none"
    assert half["points"]["512"] == {"steps": 4096.0, "reached": False, "rule": "none"}
    assert half["fit"]["short_of_target_but_predicted_there"] == [512]  # 262 predicted, 4,096 trained: inconsistent
    # along the way to 50% (readings 60 and 100 at batch 32, weighted 1 / (1 + b / 32)): 76.4, the knee 2.09x it
    path = (60 / (1 + 60 / 32) + 100 / (1 + 100 / 32)) / (1 / (1 + 60 / 32) + 1 / (1 + 100 / 32))
    assert half["b_simple"] == 100.0 and half["b_simple_path"] == pytest.approx(path) and path == pytest.approx(76.4,
                                                                                                             abs=0.1)
    assert half["ratio"] == pytest.approx(160 / path, rel=0.02) and not half["agree"]
    assert rows[0.9]["b_simple"] is None and rows[0.9]["ratio"] is None
    report = (out / "report.md").read_text()
    assert "| m | synthetic words | 50% | 32: 1200 (none), 64: 700 (none), 128: 450 (none), 512: 4096+ |" in report
    assert "| 100 | 76 | 2.09 (beyond 2x) |" in report
    assert (out / "knee_m_synthetic.png").stat().st_size > 5000
    with pytest.raises(UserError, match="already holds results"):  # a results folder is never rewritten
        critical_batch.main([str(record), "--out", str(out)])
    # a later record's group replaces the earlier one's whole (a refit at newer code), other groups stay
    later = tmp_path / "later"
    later.mkdir()
    moved = [{**ln, "global_batch": 2 * ln["global_batch"]} for ln in lines[:2]]
    (later / "results.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in moved))
    crops = {**lines[0], "set": "real"}
    (record / "results.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in [*lines, crops]))
    assert critical_batch.main([str(record), str(later), "--out", str(tmp_path / "refit")]) == 0
    rows = {(r["set"], r["target"]): r for r in json.loads((tmp_path / "refit" / "summary.json").read_text())["rows"]}
    assert list(rows["synthetic", 0.5]["points"]) == ["64"] and list(rows["real", 0.5]["points"]) == ["32"]
    assert f"real-looking crops of m from `{record}`" in (tmp_path / "refit" / "report.md").read_text()
