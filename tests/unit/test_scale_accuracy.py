"""The scale-accuracy benchmark's maths and plan, on made-up results rows (no training): samples to a threshold,
the best rule per batch, how far the default rule keeps accuracy, the report, what a resumed run skips, and how
it continues a job it was interrupted in."""

from __future__ import annotations

import json
import os
import time

import pytest

from benchmarks import scale_accuracy as sa
from benchmarks import scale_accuracy_plan as sap
from benchmarks import scale_accuracy_report as rep
from scale_ocr.config import DEFAULT_LR_SCALING
from scale_ocr.errors import UserError


def _row(batch, rule, values, model="crnn", data="synthetic", ref=64, kind="recognition", status="ok"):
    every = 256
    curve = [{"step": every * (i + 1) // batch, "samples": every * (i + 1), "seconds": 1.0 + i, "value": v}
             for i, v in enumerate(values)]
    return {"kind": kind, "model": model, "set": data, "global_batch": batch, "rule": rule, "reference_batch": ref,
            "world_size": 2, "micro_batch": min(32, batch // 2), "grad_accum": max(1, batch // 64), "samples": 1024,
            "status": status, "error": None if status == "ok" else "exit 1", "curve": curve if status == "ok" else [],
            "eval_every": 256 // batch, "peak_lr": 3e-3, "wall_seconds": 10.0, "train_size": 512, "val_size": 64,
            "threads_per_rank": 1, "preset": "test", "hardware": {"cpu": "x", "cores": 2},
            "versions": {"git": "abc", "torch": "2"}}


def test_samples_to_a_threshold_and_the_best_rule():
    curve = _row(32, "sqrt", [0.3, 0.55, 0.85, 0.9])["curve"]
    assert [rep.samples_to(curve, t) for t in rep.THRESHOLDS] == [512, 768, 1024]
    assert rep.samples_to(curve, 0.95) is None
    cells = {"none": _row(128, "none", [0.5, 0.8, 0.9, 0.91]), "linear": _row(128, "linear", [0.8, 0.9, 0.9, 0.93]),
             "sqrt": _row(128, "sqrt", [0.5, 0.6, 0.9, 0.93])}
    assert rep.best_rule(cells, "sqrt") == "linear"  # tie on the final: linear reached 90% first
    cells["linear"]["curve"] = cells["sqrt"]["curve"]
    assert rep.best_rule(cells, "sqrt") == "sqrt"  # a full tie: the default
    cells["sqrt"] = _row(128, "sqrt", [], status="failed")
    assert rep.best_rule(cells, "sqrt") == "linear"
    low = {r: _row(512, r, [0.0, v]) for r, v in (("none", 0.0), ("linear", 0.014), ("sqrt", 0.0))}
    assert rep.best_rule(low, "sqrt") is None  # every rule under LEARNED: no winner


def test_the_default_holds_up_to_the_last_batch_before_it_drops_a_point():
    assert rep.holds_up_to({32: 0.900, 64: 0.905, 128: 0.8905, 256: 0.85, 512: 0.95}) == (128, 0.9)
    assert rep.holds_up_to({32: 0.9, 64: None, 128: 0.95}) == (32, 0.9)  # a batch that did not finish stops it
    assert rep.holds_up_to({32: None, 64: 0.9}) == (None, None)


def test_report_and_summary_from_rows_alone(tmp_path, monkeypatch):
    monkeypatch.setattr("scale_ocr.config.DEFAULT_LR_SCALING", "sqrt")  # the report's arithmetic, whatever the default
    rows = [_row(32, r, [0.5, 0.8, 0.9, 0.90]) for r in ("none", "linear", "sqrt")]
    rows += [_row(64, "sqrt", [0.5, 0.8, 0.9, 0.91])]  # the reference batch: one job stands for every rule
    rows += [_row(128, "none", [0.4, 0.7, 0.8, 0.85]), _row(128, "linear", [0.6, 0.9, 0.9, 0.92]),
             _row(128, "sqrt", [0.5, 0.8, 0.9, 0.895])]
    rows += [_row(256, "sqrt", [0.1, 0.2, 0.3, 0.5], status="failed"), _row(256, "sqrt", [0.3, 0.5, 0.7, 0.8])]
    rows += [_row(b, "sqrt", [0.1, 0.3], model="db", data="synthetic-pages", ref=2, kind="detection") for b in (4, 32)]
    rows += [_row(4, "none", [0.1, 0.4], model="db", data="synthetic-pages", ref=2, kind="detection")]  # another rule
    rows += [_row(32, "sqrt", [0.0, 0.05], model="vit"), _row(64, "none", [0.0, 0.05], model="vit")]  # no verdict
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "command.txt").write_text("python -m benchmarks.scale_accuracy --preset test\n")
    report = rep.build_report(tmp_path).read_text()
    summary = json.loads((tmp_path / "summary.json").read_text())
    s = summary["recognition"][0]
    assert (s["default_holds_up_to"], s["reference_final"], s["best_rule_there"]) == (128, 0.9, "linear")
    assert s["default_is_best_there"] is False and s["batches"]["64"]["final"] == {r: 0.91 for r in rep.RULES}
    assert "| 64 | 2 x 32 x 1 | every rule (ran as sqrt) |" in report
    assert "| 64 | 2 x 32 x 1 | every rule (ran as none) |" in report  # the first rule's job is still every rule's
    assert "| 64 | 2 x 32 x 1 | none" not in report and "| 64 | 2 x 32 x 1 | linear" not in report  # shown once
    assert "up to global batch **128**; there the best rule is linear (the default trails it)" in report
    assert [(d["global_batch"], d["rule"], d["final_recall"]) for d in summary["detection"]] == [
        (4, "sqrt", 0.3), (4, "none", 0.4), (32, "sqrt", 0.3)]  # every rule run, the default's first
    assert "| 4 | 2 x 2 x 1 | sqrt (default) | 3.00e-03 | 30.0 |" in report and "| 4 | 2 x 2 x 1 | none | " in report
    assert s["wins_above_reference"] == {"linear": 1, "sqrt": 1}  # 128: linear; 256: sqrt alone finished
    assert ("| crnn | synthetic words | 90.0 | 128 | linear | no | linear at 1 of 2, sqrt at 1 of 2 |" in report
            and "| vit | synthetic words | 5.0 | no verdict | - | - |" in report)
    assert {r: (v["holds_up_to"], v["is_best_there"]) for r, v in s["as_default"].items()} == {
        "none": (64, True), "linear": (128, True), "sqrt": (128, False)}  # the same verdict, each rule as default
    assert "| crnn | synthetic words | 64, best there | 128, best there | 128, trails linear |" in report
    assert ("Best where it holds in every group above: `none`, `linear`. By these runs the default is `linear`: "
            "best where it holds in 1 of 1 group(s), and the best rule above the reference batch at 1 of 2 batch(es) "
            "(today's default, `sqrt`: 0 and 1).") in report  # vit learned nothing: not a group
    assert "INCONCLUSIVE: under the default rule (sqrt) the smallest batch ends at 5.0% exact match" in report
    assert "training samples per job: 1,024 on synthetic words;" in report  # the header: each set's budget
    assert "1,024 training samples per job." in report  # and each group's
    assert "`results.jsonl` holds 1 line(s) a later line of the same job replaces" in report  # 256's failed try
    assert (tmp_path / "final.png").is_file() and (tmp_path / "curves.png").is_file()


def test_plan_splits_batches_skips_shared_rules_and_finished_jobs(tmp_path):
    args = sa.parse(["--preset", "record", "--out", str(tmp_path)])
    assert sap.split_batch(512, 2, 32) == (32, 8) and sap.split_batch(32, 2, 32) == (16, 1)
    jobs = sap.plan(args)
    crnn = [j for j in jobs if j.model == sap.CRNN and j.set == "synthetic"]
    assert len(crnn) == 13 and [j.rule for j in crnn if j.global_batch == 64] == [DEFAULT_LR_SCALING]
    assert {j.steps for j in crnn if j.global_batch == 512} == {192}
    assert {j.samples for j in jobs if j.set == "real"} == {196608}  # the real-looking set's own budget
    assert {j.samples for j in sap.plan(sa.parse(["--preset", "record", "--samples", "4096"])) if j.kind ==
            "recognition"} == {4096}  # --samples: every set's
    assert [(j.kind, j.global_batch, j.micro_batch, j.grad_accum) for j in jobs[:2]] == [
        ("detection", 4, 2, 1), ("detection", 32, 2, 8)]  # the cheapest group first
    assert [(j.model, j.set) for j in jobs[2::13]] == [(sap.CRNN, "synthetic"), (sap.CRNN, "real"),
                                                      (sap.VIT, "synthetic"), (sap.VIT, "real")]
    done = _row(32, "none", [0.5], model=sap.CRNN)
    assert crnn[0].key == rep.key_of(done)
    done |= {"samples": 98304, "micro_batch": 16, "grad_accum": 1, "eval_every": 256}
    assert sap.finished(jobs, [done]) == {crnn[0].key}
    shared = _row(64, "none", [0.5], model=sap.CRNN) | {"samples": 98304, "micro_batch": 32, "eval_every": 128}
    assert sap.finished(jobs, [shared]) == {crnn[3].key}  # the reference batch, run under another rule: done
    with pytest.raises(UserError, match="other samples.*--supersede"):
        sap.finished(jobs, [done | {"samples": 1024}])  # another budget in the same folder: refused
    assert sap.finished(jobs, [done, done | {"samples": 1024}], supersede=True) == set()  # its last line: again
    assert sap.finished(jobs, [done | {"samples": 1024}, done], supersede=True) == {crnn[0].key}
    assert sap.finished(jobs, [done | {"samples": 1024}, done]) == {crnn[0].key}  # replaced: resumes without it
    done["samples"] = 1024
    seconds, rates = sap.estimate(jobs, [done | {"wall_seconds": 1024 / 64}])
    assert rates[sap.CRNN] == 64.0 and seconds > 0
    with pytest.raises(UserError, match="--real-crops"):
        sa.check(sa.parse(["--sets", "crops"]))
    with pytest.raises(UserError, match="not a multiple"):
        sap.split_batch(33, 2, 32)


def test_convergence_compares_the_recipes_after_the_same_steps_in_points():
    from benchmarks import convergence

    def row(data, recipe, ems):
        curve = [{"step": 64 * (i + 1), "seconds": 1.0, "exact_match": em} for i, em in enumerate(ems)]
        return {"set": data, "recipe": recipe, "status": "ok", "curve": curve, "world_size": 2, "batch_size": 32}

    rows = [row("real", "defaults", [0.1, 0.58]), row("real", "bare", [0.2, 0.6]),
            row("crops", "defaults", [0.3, 0.5]), row("crops", "bare", [0.3, 0.53]),
            row("synthetic", "defaults", [0.01]), row("synthetic", "bare", [0.02])]
    lines = convergence.equal_steps(rows)
    assert (lines[0].startswith("- synthetic, global batch 64, after 64 optimizer steps each")
            and "INCONCLUSIVE" in lines[0])
    assert "real-looking, global batch 64, after 128 optimizer steps each: defaults 58.0% vs bare 60.0%, " \
           "-2.0 points: PASS" in lines[1]
    assert "defaults 50.0% vs bare 53.0%, -3.0 points: FAIL" in lines[2]


def test_a_record_in_parts_stops_before_a_job_past_max_minutes_and_reports_what_is_left(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("scale_ocr.config.DEFAULT_LR_SCALING", "sqrt")  # the rule of the rows below
    args = sa.parse(["--preset", "record", "--out", str(tmp_path), "--max-minutes", "30"])
    crnn = next(j for j in sap.plan(args) if j.model == sap.CRNN)  # 98,304 samples at 236/s: about 7 min
    assert sa.fits(args, crnn, 5, [], spent=0.0, first=True)
    assert not sa.fits(args, crnn, 5, [], spent=25 * 60.0, first=False)
    assert "stopped before crnn_mobilenet_v3_small-synthetic-g32-none with 5 job(s) to run" in capsys.readouterr().out
    with pytest.raises(UserError, match="--max-minutes 30.0: the first job to run, .* needs about 8 min"):
        sa.fits(args, crnn, 5, [], spent=25 * 60.0, first=True)  # a limit that runs nothing: one line, exit 2
    slow = [_row(32, "none", [0.5]) | {"model": sap.CRNN, "set": "real", "samples": 1000, "wall_seconds": 100.0}]
    assert not sa.fits(args, crnn, 5, slow, spent=0.0, first=False)  # the model's rate here, 10/s, says 180 min
    fast = _row(32, "none", [0.5]) | {"model": sap.CRNN, "set": crnn.set, "samples": 100_000, "wall_seconds": 100.0}
    assert sa.fits(args, crnn, 5, [*slow, fast], spent=0.0, first=False)  # its own set's rate wins: 2 min
    rows = [_row(32, "sqrt", [0.5, 0.9]), _row(64, "sqrt", [0.5, 0.9])]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "command.txt").write_text("python -m benchmarks.scale_accuracy --preset test\n")
    planned = [{"kind": "recognition", "model": "crnn", "set": "synthetic", "global_batch": g, "rule": "sqrt",
                "samples": 1024, "name": f"crnn-g{g}"} for g in (32, 64, 128)]
    (tmp_path / "plan.json").write_text(json.dumps(planned))
    report = rep.build_report(tmp_path).read_text()
    assert "**In progress: 1 planned job(s) have no result yet** (crnn-g128)" in report
    assert "| crnn | synthetic words | 90.0 | in progress (1 to run) | - | - |" in report
    assert json.loads((tmp_path / "summary.json").read_text())["to_run"] == ["crnn-g128"]


def test_batches_above_one_where_no_rule_learned_are_not_trained(tmp_path, monkeypatch, capsys):
    """At a fixed sample budget a larger batch takes fewer steps: past a batch where every rule ended under 10%,
    the run trains nothing more of that group (unless --train-all) and the report says which and why."""
    argv = ["--models", sap.CRNN, "--batches", "32,64,128", "--rules", "none,sqrt", "--det-batches", "",
            "--out", str(tmp_path)]
    args = sa.parse(argv)
    ends = {32: 0.5, 64: 0.05}  # 32 learns; 64, the reference batch (one job for every rule), does not

    def fake_run(args, job, data, sizes, work, context):
        return _row(job.global_batch, job.rule, [0.0, ends[job.global_batch]], model=job.model) | {
            "samples": job.samples, "micro_batch": job.micro_batch, "grad_accum": job.grad_accum,
            "eval_every": job.eval_every, "metric": "exact_match", "lr_line": None}

    monkeypatch.setattr(sa, "job_data", lambda args, job, work: ([], (1, 1)))
    monkeypatch.setattr(sa, "run_one", fake_run)
    sa.run(args)
    out = capsys.readouterr().out
    assert "5 to run: at most " in out and "less where a batch learns nothing" in out  # a bound, not a forecast
    assert ("crnn_mobilenet_v3_small-synthetic-g128-none: not trained: every rule ended under 10% at global batch 64"
            in out)
    assert len(rep.load_rows(tmp_path)) == 3  # g32 x 2 rules, g64 once
    jobs = sap.plan(args)
    assert sap.to_train(args, jobs, rep.load_rows(tmp_path)) == []
    assert [j.global_batch for j in sap.to_train(sa.parse([*argv, "--train-all"]), jobs,
                                                rep.load_rows(tmp_path))] == [128, 128]
    report = rep.build_report(tmp_path).read_text()
    assert ("In progress" not in report
            and "Not trained: global batch 128. Every rule ended under 10% at batch 64" in report)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["not_trained"] == [f"{sap.CRNN}-synthetic-g128-none", f"{sap.CRNN}-synthetic-g128-sqrt"]
    assert summary["recognition"][0]["default_holds_up_to"] == 32  # the verdict stands on what was trained


def test_an_interrupted_job_continues_from_its_checkpoint_and_counts_the_time_its_curve_kept(tmp_path, monkeypatch):
    """A session's end kills a job: run again, it continues from the checkpoint its try left (same train.py
    arguments), its curve's seconds leave out the time between tries, and the row says where it resumed; a
    finished try's folder, or one of other arguments, starts afresh."""
    args = sa.parse(["--models", sap.CRNN, "--batches", "32", "--rules", "none", "--det-batches", "",
                     "--out", str(tmp_path)])
    job, work = sap.plan(args)[0], tmp_path / "work"
    run_dir = work / "runs" / job.name
    argv = sa.command(args, job, ["--train-path", "x"], 1000, run_dir)
    (run_dir / "checkpoints" / "step_00000005").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_00000005")
    (run_dir / "checkpoints" / "step_00000005" / "trainer.json").write_text('{"step": 5}')
    train_argv = argv[argv.index(str(sa.TRAIN)) + 1:]
    (run_dir / "config.json").write_text(json.dumps({"argv": train_argv}))
    os.utime(run_dir / "config.json", (1000.0, 1000.0))  # a folder from before tries.json: its one try began here
    (run_dir / "metrics.jsonl").write_text('{"step": 2, "time": 1010.0, "val/exact_match": 0.25}\n'
                                           '{"step": 4, "time": 1020.0, "train/loss": 1.0}\n')
    assert sa.earlier_tries(run_dir, argv) == ([{"t0": 1000.0, "from_step": 0}], 5)
    other = [*train_argv[:-2], "--seed", "1"]  # another job's arguments: not continued
    assert sa.earlier_tries(run_dir, [*argv[:argv.index(str(sa.TRAIN)) + 1], *other]) == ([], 0)
    assert sa.fits(args, job, 1, [], 0.0, first=True, done=0.5)

    def resumed(cmd, threads, timeout, memory):
        assert cmd[cmd.index("--resume") + 1] == "auto"
        with (run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps({"step": job.steps, "time": time.time() + 3, "val/exact_match": 0.5}) + "\n")
        return "ok", None, 50.0

    monkeypatch.setattr(sa, "run_job", resumed)
    context = {"threads": 1, "stamp": {}}
    row = sa.run_one(args, job, ["--train-path", "x"], (1000, 10), work, context)
    assert row["status"] == "ok" and row["resumed_at"] == [5] and row["wall_seconds"] == 20.0 + 50.0
    assert [p["seconds"] for p in row["curve"]] == [10.0, pytest.approx(23.0, abs=1.0)]
    assert "(resumed at step 5)" in rep._wall(row)
    tries = json.loads(sa.tries_file(run_dir).read_text())
    assert [t["from_step"] for t in tries] == [0, 5] and tries[-1]["ended"] == "ok"
    assert sa.earlier_tries(run_dir, argv) == ([], 0)  # a finished try is not continued: a new one starts afresh
    monkeypatch.setattr(sa, "run_job", lambda cmd, *a: ("failed", "exit 1", 1.0))
    row = sa.run_one(args, job, ["--train-path", "x"], (1000, 10), work, context)
    assert row["resumed_at"] == [] and not (run_dir / "checkpoints").exists() and row["curve"] == []
