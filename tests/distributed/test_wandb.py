"""W&B from a real 2-rank job: one offline run, read back from its .wandb transaction log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import TINY, _env, python_train, read_jsonl, read_metrics, run_cmd, torchrun_train

from tests.helpers.wandb_reader import read_offline_run

SECRET = "sk-test-0123456789abcdef"


def _wandb_env(**extra) -> dict[str, str]:
    env = _env()
    for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED"):
        env.pop(k, None)
    env["MY_SERVICE_TOKEN"] = SECRET
    env.update(extra)
    return env


@pytest.mark.slow
def test_disabled_writes_no_wandb_files(tmp_path):
    proc = python_train(["--strategy", "single", *TINY, "--output-dir", str(tmp_path), "--wandb-mode", "disabled"],
                        env=_wandb_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "wandb_run_id").exists()
    records = read_jsonl(tmp_path)
    assert [r["step"] for r in records if "train/loss" in r] == [2, 4, 6]
    assert any("val/exact_match" in r for r in records)


def test_broken_wandb_install_degrades_to_jsonl(tmp_path):
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text("raise ImportError('simulated broken wandb')\n")
    env = _wandb_env()
    env["PYTHONPATH"] = f"{fake}:{env['PYTHONPATH']}"
    run_dir = tmp_path / "run"
    proc = run_cmd([sys.executable, "scale_ocr/train.py", "--strategy", "single", *TINY, "--output-dir",
                    str(run_dir), "--wandb-mode", "offline"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "scale-ocr: warning: wandb cannot be imported" in proc.stderr
    assert read_metrics(run_dir)["steps"] == 6


@pytest.mark.slow
def test_unreachable_server_in_online_mode_falls_back_offline(tmp_path):
    env = _wandb_env(WANDB_API_KEY="x" * 40, WANDB_BASE_URL="http://127.0.0.1:9", WANDB_INIT_TIMEOUT="3",
                     HOME=str(tmp_path))
    run_dir = tmp_path / "run"
    proc = python_train(["--strategy", "single", *TINY, "--output-dir", str(run_dir), "--wandb-mode", "online"],
                        env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "W&B online mode could not start" in proc.stderr and "wandb sync" in proc.stderr
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 6


def _check_offline_run(run_dir: Path) -> str:
    """The job's one offline run, read back: project, group, config, history, summary, no secrets; its id."""
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs  # one run per job, not one per rank
    run = read_offline_run(runs[0])
    assert run.project == "scale-ocr" and run.group == "g1"
    assert run.run_id == (run_dir / "wandb_run_id").read_text().strip()
    cfg = run.config
    for key in ("model", "data", "optim", "train", "strategy", "world_size", "global_batch", "launcher",
                "backend", "devices", "versions", "ds_config", "dataset"):
        assert key in cfg, key
    assert cfg["world_size"] == 2 and cfg["strategy"]["strategy"] == "ddp" and len(cfg["devices"]) == 2
    assert cfg["versions"]["torch"] and cfg["launcher"] == "torchrun" and cfg["train"]["max_steps"] == 4
    steps = [h for h in run.history if "train/loss" in h]
    assert steps and {"train/lr", "train/grad_norm", "train/samples_per_sec", "train/step_time",
                      "memory/peak_bytes_max", "memory/peak_bytes_mean", "train/mfu"} <= set(steps[0])
    assert any("val/exact_match" in h for h in run.history)
    summary = read_metrics(run_dir)
    for key in ("strategy", "world_size", "steps", "exact_match", "cer", "samples_per_sec", "peak_memory_bytes",
                "mfu"):
        assert run.summary[key] == pytest.approx(summary[key]) if isinstance(summary[key], float) \
            else run.summary[key] == summary[key]
    for key in ("time_breakdown", "memory_breakdown"):  # nested: where the step time and the peak memory went
        assert run.summary[key] == summary[key] and summary[key], key
    # Secrets in the environment reach neither the run nor our files.
    for f in [*runs[0].glob("*.wandb"), run_dir / "config.json", run_dir / "metrics.jsonl"]:
        assert SECRET.encode() not in f.read_bytes(), f
    return run.run_id


@pytest.mark.slow
def test_two_rank_offline_run_reads_back_and_a_resumed_job_appends_to_it(tmp_path):
    run_dir = tmp_path / "run"
    base = ["--strategy", "ddp", "--train-samples", "64", "--val-samples", "16", "-b", "4", "--log-every", "2",
            "--max-chars", "5", "--epochs", "2", "--save-every", "4", "--output-dir", str(run_dir),
            "--wandb-group", "g1", "--wandb-tags", "ci", "cpu"]
    env = _wandb_env(HOME=str(tmp_path))
    first = torchrun_train([*base, "--max-steps", "4"], env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = _check_offline_run(run_dir)
    second = torchrun_train([*base, "--max-steps", "8", "--resume", "auto"], env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(run_id) for r in runs)
    later = read_offline_run(runs[-1])
    assert later.run_id == run_id
    assert [h["_step"] for h in later.history if "train/loss" in h] == [6, 8]
    # metrics.jsonl keeps the first part and appends the rest.
    assert [r["step"] for r in read_jsonl(run_dir) if "train/loss" in r] == [2, 4, 6, 8]
