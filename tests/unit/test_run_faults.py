"""The run directory and the loop under faults: one job per directory, resume always continues,
preemption checkpoints, divergence stops with the last good checkpoint. One process, plain python."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    HOOKED_TRAIN,
    REPO,
    TINY,
    TRAIN,
    _env,
    fixture_dir,
    make_folder,
    python_train,
    read_jsonl,
    read_metrics,
)
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from scale_ocr.run.run_dir import RunLock
from scale_ocr.train import main

SMALL = ["--strategy", "single", "--train-samples", "32", "--val-samples", "4", "-b", "4", "--max-chars", "5",
         "--log-every", "2", "--sched", "constant", "--wandb-mode", "disabled"]


def _one_line(err: str, kind: str = "error") -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith(f"scale-ocr: {kind}:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir) if "train/loss" in r]


def test_second_job_on_the_same_directory_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    holder = RunLock(run_dir)
    assert holder.acquire() is None  # "another job": flock conflicts across open files, even in one process
    try:
        code = main([*SMALL, "--max-steps", "1", "--output-dir", str(run_dir)])
    finally:
        holder.release()
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and "in use by another scale-ocr job" in line and f"pid {os.getpid()}" in line
    assert not (run_dir / "config.json").exists()


def test_stale_lock_of_a_dead_job_is_taken_over(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".scale-ocr.lock").write_text(json.dumps({"pid": 999999, "host": "gone", "argv": ["x"],
                                                         "started": "yesterday"}))
    assert main([*SMALL, "--max-steps", "1", "--output-dir", str(run_dir)]) == 0
    assert read_metrics(run_dir)["steps"] == 1


def test_fresh_run_moves_an_earlier_run_aside(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # Checkpoints off (every run with them on ends with one, which the second run would continue from).
    assert main([*SMALL, "--max-steps", "1", "--save-minutes", "0", "--output-dir", str(run_dir)]) == 0
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert main([*SMALL, "--max-steps", "2", "--output-dir", str(run_dir)]) == 0  # no checkpoint: a new run
    assert "moved it to" in capsys.readouterr().out
    (old,) = tmp_path.glob("run.old-*")
    assert {n: (old / n).read_bytes() for n in before} == before  # the earlier run, byte for byte
    assert read_metrics(run_dir)["steps"] == 2


def test_non_empty_directory_of_something_else_is_refused(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code = main([*SMALL, "--max-steps", "1", "--output-dir", str(tmp_path)])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and "holds no scale-ocr run" in line and "notes.txt" in line
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_resume_auto_is_the_default_and_metrics_are_not_repeated(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = [*SMALL, "--save-every", "2", "--output-dir", str(run_dir)]
    assert main([*args, "--max-steps", "4"]) == 0
    # A crash after step 4 was logged but before its checkpoint: step 2 is the newest.
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts / "step_00000004")
    (ckpts / "latest").write_text("step_00000002\n")
    (ckpts / "step_00000006.tmp").mkdir()  # and a save interrupted later still
    capsys.readouterr()
    assert main([*args, "--max-steps", "6"]) == 0  # no --resume flag
    out = capsys.readouterr().out
    assert "at step 2" in out and "step_00000006.tmp" in out and not (ckpts / "step_00000006.tmp").exists()
    assert _steps(run_dir) == [2, 4, 6]  # step 4 trained twice, logged once
    assert read_metrics(run_dir)["steps"] == 6
    # The same command on the finished run: nothing to train is said, not a silent exit 0.
    code = main([*args, "--max-steps", "6"])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and "nothing to train" in line and "--max-steps" in line


def test_a_run_that_ends_before_its_bad_streak_is_long_enough_to_stop_it_does_not_exit_0(tmp_path, capsys):
    """Both steps bad, fewer than --max-bad-steps (5): before, the run exited 0 having trained nothing and written no
    model (seen when ZeRO-3's weight norm counted uninitialized padding)."""
    run_dir = tmp_path / "run"
    code = main([*SMALL, "--lr", "1e30", "--max-steps", "2", "--output-dir", str(run_dir)])
    line = _one_line(capsys.readouterr().err)
    assert code == 4 and "training diverged: 2 consecutive steps up to step 2" in line
    assert not (run_dir / "last_model.pt").exists() and not list(run_dir.glob("checkpoints/step_*"))


def test_diverging_run_stops_with_its_last_good_checkpoint(tmp_path, capsys):
    # From the first step: --lr 1e30 throws the weights to ~1e28 while that step's loss and gradient are finite.
    # The weight check makes that step bad, so no checkpoint of those weights is ever written.
    wild = tmp_path / "wild"
    code = main([*SMALL, "--lr", "1e30", "--save-every", "1", "--max-bad-steps", "3", "--max-steps", "8",
                 "--output-dir", str(wild)])
    err = capsys.readouterr().err
    line = _one_line(err)
    assert code == 4 and "training diverged" in line and "no checkpoint was saved" in line
    assert "nothing to resume" in line and "resume from it" not in line  # the advice names what exists
    assert "step 1: the updated weights" in err, err
    assert not list(wild.glob("checkpoints/step_*")) and not (wild / "last_model.pt").exists()
    # Two good steps, then the same rate from step 2: step_00000002 is the last good checkpoint, and says so.
    run_dir = tmp_path / "run"
    assert main([*SMALL, "--save-every", "1", "--max-steps", "2", "--output-dir", str(run_dir)]) == 0
    capsys.readouterr()
    good_model = (run_dir / "last_model.pt").stat().st_mtime_ns
    code = main([*SMALL, "--lr", "1e30", "--save-every", "1", "--max-bad-steps", "3", "--max-steps", "8",
                 "--output-dir", str(run_dir)])
    err = capsys.readouterr().err
    line = _one_line(err)
    assert code == 4 and "training diverged" in line and "step_00000002 (weights finite, norm" in line, line
    assert "`--resume auto` (the default) continues from it" in line, line
    assert "step 3: the updated weights" in err and err.count("scale-ocr: warning: step") == 3, err
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    meta = json.loads((run_dir / "checkpoints" / "step_00000002" / "trainer.json").read_text())
    assert meta["weights"]["finite"] and meta["weights"]["within_bound"] and meta["loss"] < 1e3, meta
    dcp_to_torch_save(str(run_dir / "checkpoints" / "step_00000002"), str(tmp_path / "full.pt"))
    state = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    weights = [v.float() for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()]  # buffers too
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(w) for w in weights])))
    assert abs(norm - meta["weights"]["norm"]) <= 1e-3 * norm  # the recorded norm is these weights'
    assert norm < meta["weights"]["bound"] / 100 and max(float(w.abs().max()) for w in weights) < 100
    assert (run_dir / "last_model.pt").stat().st_mtime_ns == good_model  # the good run's, not rewritten


def test_a_nan_validation_loss_writes_no_model_and_does_not_exit_0(tmp_path, capsys, monkeypatch):
    """N05's end: a run resumed from a checkpoint whose BatchNorm statistics had blown up validated NaN, exited 0 and
    wrote best and last models from it. A NaN validation loss at the end is exit 4, and nothing is written from it."""
    from scale_ocr.tasks.recognition import RecognitionTask

    evaluate = RecognitionTask.evaluate

    def nan_loss(self, *args, **kwargs):
        result = evaluate(self, *args, **kwargs)
        result.metrics["val_loss"] = float("nan")
        return result

    monkeypatch.setattr(RecognitionTask, "evaluate", nan_loss)
    run_dir = tmp_path / "run"
    code = main([*SMALL, "--max-steps", "3", "--save-every", "2", "--output-dir", str(run_dir)])
    line = _one_line(capsys.readouterr().err)
    assert code == 4 and "the validation loss at step 3 is nan" in line, line
    assert "the last good checkpoint, checkpoints/step_00000002" in line and "no model was written" in line, line
    assert not list(run_dir.glob("*_model.pt")) and not (run_dir / "checkpoints" / "step_00000003").exists()


def test_a_resume_after_the_training_labels_changed_is_refused(tmp_path, capsys):
    """X06: a folder run resumed after its labels.json changed continued mid-epoch on another dataset, although
    config.json recorded train_labels_sha256. Refused, as a shard set whose index changed is."""
    words = {f"{i}.png": w for i, w in enumerate(["hello", "world", "scale", "ocr42", "Text", "CTC", "gloo", "rank"])}
    train, val = make_folder(tmp_path / "train", words), make_folder(tmp_path / "val", dict(list(words.items())[:4]))
    args = [*SMALL, "--train-path", str(train), "--val-path", str(val), "--save-every", "1", "--vocab", "latin",
            "--output-dir", str(tmp_path / "run")]
    assert main([*args, "--max-steps", "1"]) == 0
    capsys.readouterr()
    labels = json.loads((train / "labels.json").read_text())
    (train / "labels.json").write_text(json.dumps({**labels, "0.png": "jello"}))
    code = main([*args, "--max-steps", "3"])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and "the checkpoint's data position belongs to another dataset" in line, line
    assert "--train-path" in line and "--resume none" in line, line
    (train / "labels.json").write_text(json.dumps(labels))  # the data it trained on: the same resume goes on
    (val / "labels.json").write_text(json.dumps({**json.loads((val / "labels.json").read_text()), "0.png": "jello"}))
    code = main([*args, "--max-steps", "3"])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and "best score was measured on another validation set" in line and "--val-path" in line, line


def _launch(args: list[str]) -> subprocess.Popen:
    # A shell's background job (`make test &`) inherits SIGINT ignored, and Python keeps an inherited SIG_IGN:
    # give the run the default disposition a terminal's foreground job has, so Ctrl-C is tested as users send it.
    return subprocess.Popen([sys.executable, str(TRAIN), *args], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _signal_after_step(proc: subprocess.Popen, sig: int, step: int = 2) -> tuple[str, str]:
    """Send ``sig`` once the run printed ``step``; returns (stdout, stderr) after it exits. A run that never printed
    the step, or ended before the signal went, fails here with both streams (a signal test that sent nothing
    would otherwise read as the run ignoring it)."""
    out, sent = [], None
    for line in proc.stdout:
        out.append(line)
        if line.startswith(f"step {step}/"):
            sent = proc.poll() is None  # send_signal does nothing to a run that already ended
            proc.send_signal(sig)
            break
    rest, err = proc.communicate(timeout=120)
    streams = f"stdout:\n{''.join(out)}{rest}\nstderr:\n{err}"
    assert sent is not None, f"the run never printed 'step {step}/'; {streams}"
    assert sent, f"the run ended (exit {proc.returncode}) before the signal was sent; {streams}"
    return "".join(out) + rest, err


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_resumed_run_ends_bitwise_equal(tmp_path):
    common = [*SMALL, "--log-every", "1", "--train-samples", "64", "--max-steps", "10"]
    straight = subprocess.run([sys.executable, str(TRAIN), *common, "--output-dir", str(tmp_path / "a")], cwd=REPO,
                              env=_env(), capture_output=True, text=True, timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]
    b = tmp_path / "b"
    proc = _launch([*common, "--output-dir", str(b)])
    out, err = _signal_after_step(proc, signal.SIGTERM)
    line = _one_line(err, "stopped")
    assert proc.returncode == 75 and "SIGTERM received" in line, err
    saved = (b / "checkpoints" / "latest").read_text().strip()
    assert saved in line and int(saved.split("_")[1]) < 10
    again = subprocess.run([sys.executable, str(TRAIN), *common, "--output-dir", str(b)], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and f"at step {int(saved.split('_')[1])}" in again.stdout, again.stderr[-2000:]
    wa = torch.load(tmp_path / "a" / "last_model.pt", weights_only=True)
    wb = torch.load(b / "last_model.pt", weights_only=True)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ctrl_c_is_one_line(tmp_path):
    proc = _launch([*SMALL, "--log-every", "1", "--train-samples", "256", "--output-dir", str(tmp_path / "r")])
    out, err = _signal_after_step(proc, signal.SIGINT, step=1)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 130 and len(lines) == 1 and lines[0].startswith("scale-ocr: interrupted (Ctrl-C)"), \
        f"exit {proc.returncode}; stdout:\n{out}\nstderr:\n{err}"


def test_ctrl_c_during_a_checkpoint_save_is_one_line_and_exit_130(tmp_path):
    """G01: DCP wraps a Ctrl-C during its write in a CheckpointException (a BaseException): 150 lines (the traceback
    twice, once as `[rank0]:`) and exit 1. Now the interrupt line alone, exit 130, and the partial save removed."""
    run_dir = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, str(HOOKED_TRAIN), "--stall-in-dcp", "60", *SMALL, "--log-every", "1",
                             "--save-every", "2", "--output-dir", str(run_dir)], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    tmp = run_dir / "checkpoints" / "step_00000002.tmp"
    deadline = time.monotonic() + 120
    while not tmp.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # inside the stalled write
    sent = proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert sent and proc.returncode == 130 and len(lines) == 1, f"exit {proc.returncode}; {out}\nstderr:\n{err}"
    assert lines[0].startswith("scale-ocr: interrupted (Ctrl-C); checkpoints already written are kept"), err
    assert not tmp.exists() and not (run_dir / "checkpoints" / "latest").exists()  # nothing partial is left


def test_sigusr1_checkpoints_and_exits_75(tmp_path):
    """SLURM's warning before a time limit (``--signal=USR1@T``) stops the run the way SIGTERM does."""
    run_dir = tmp_path / "r"
    proc = _launch([*SMALL, "--log-every", "1", "--train-samples", "256", "--output-dir", str(run_dir)])
    _, err = _signal_after_step(proc, signal.SIGUSR1, step=1)
    assert proc.returncode == 75 and "SIGUSR1 received" in _one_line(err, "stopped")
    assert (run_dir / "checkpoints" / "latest").is_file()


def test_timed_checkpoints_without_save_every(tmp_path):
    """--save-minutes (default 10) checkpoints by wall time, and a run that saved ends with a checkpoint."""
    run_dir = tmp_path / "r"
    assert main([*SMALL, "--max-steps", "3", "--save-minutes", "0.0001", "--keep-last", "0",
                 "--output-dir", str(run_dir)]) == 0
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert saved == ["step_00000001", "step_00000002", "step_00000003"]


def test_watchdog_prints_an_alive_line_on_long_steps(monkeypatch, capsys):
    import scale_ocr.run.watchdog as wd

    monkeypatch.setattr(wd, "ALIVE_EVERY", 0.5)
    dog = wd.Watchdog(rank=0, world_size=1, timeout=5, is_main=True).start()
    dog.progress(3, 10)
    time.sleep(1.6)
    dog.close()
    err = capsys.readouterr().err
    assert "scale-ocr: alive: step 3/10" in err and "1 of 1 ranks responding" in err


def test_no_save_model_trains_without_gathering_the_model(tmp_path):
    """--no-save-model (memory probes): the run trains and reports, and writes no single-file model."""
    run_dir = tmp_path / "run"
    proc = python_train(["vitstr_tiny", "--strategy", "single", *TINY, "--no-save-model", "--output-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_metrics(run_dir)["steps"] == 6
    assert not (run_dir / "last_model.pt").exists() and not (run_dir / "best_model.pt").exists()


def test_a_run_that_waits_on_its_data_says_so(tmp_path, capsys, monkeypatch):
    """Time spent waiting for the loader is measured (metrics.json, every log line) and, when it is a tenth of
    training or more, one line says how to take loading off the ranks' critical path."""
    from scale_ocr.data import synthetic

    render = synthetic.SyntheticWords.__getitem__

    def slow(self, index):
        time.sleep(0.03)  # a third of a step or more on an idle core: on a loaded one (CI) still over the tenth
        return render(self, index)

    monkeypatch.setattr(synthetic.SyntheticWords, "__getitem__", slow)
    run_dir = tmp_path / "run"
    assert main([*SMALL, "--max-steps", "8", "--output-dir", str(run_dir)]) == 0
    err = capsys.readouterr().err
    share = read_metrics(run_dir)["data_share"]
    assert 0.1 <= share <= 1 and f"waited for data {share:.0%}" in err and "--workers N" in err
    assert all(0 <= r["train/data_share"] <= 1 for r in read_jsonl(run_dir) if "train/loss" in r)


VALIDATED = [*SMALL, "--save-every", "2", "--keep-last", "0", "--eval-every", "2", "--max-steps", "10"]


@pytest.fixture(scope="module")
def validated_run(tmp_path_factory):
    """One uninterrupted run that validates and checkpoints every 2 steps, for each rewind to copy."""
    with fixture_dir(tmp_path_factory, "validated") as root:
        assert main([*VALIDATED, "--output-dir", str(root / "whole")]) == 0
        yield root / "whole"


@pytest.mark.parametrize("rewind", [4, 8])  # a validation within the epoch; the epoch's end (8 steps of 4 samples)
def test_a_checkpoint_at_a_validated_step_keeps_that_validation_for_the_resumed_run(validated_run, tmp_path, capsys,
                                                                                     rewind):
    """A run resumed from a checkpoint of a step it validated has every validation of an uninterrupted run, once:
    the checkpoint is written after that step's validation (a resumed run does not validate the step again)."""
    def val_steps(run_dir: Path) -> list[int]:
        return [r["step"] for r in read_jsonl(run_dir) if "val/exact_match" in r]

    args = VALIDATED
    whole, cut = validated_run, tmp_path / "cut"
    shutil.copytree(whole, cut)
    for ckpt in (cut / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > rewind:
            shutil.rmtree(ckpt)
    (cut / "checkpoints" / "latest").write_text(f"step_{rewind:08d}\n")
    assert main([*args, "--output-dir", str(cut)]) == 0
    assert f"at step {rewind}" in capsys.readouterr().out
    assert val_steps(cut) == val_steps(whole) == [2, 4, 6, 8, 10]


ALLOCATOR_FAILURE = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                     "tried to allocate 37748736 bytes. Error code 12 (Cannot allocate memory)")


def test_model_files_that_do_not_fit_in_memory_lose_nothing(tmp_path, capsys, monkeypatch):
    """The allocator fails while last_model.pt is written (after training, as a 0.76B ZeRO-3 run's rank 0 did when it
    gathered the whole model): one line naming the file, its bytes and the checkpoint written before it; exit 3."""
    from scale_ocr.checkpoint import model_files
    from scale_ocr.checkpoint.export import export

    def put(self, tensor):
        raise RuntimeError(ALLOCATOR_FAILURE)

    monkeypatch.setattr(model_files.TorchFile, "put", put)
    run_dir = tmp_path / "run"
    code = main([*SMALL, "--max-steps", "2", "--output-dir", str(run_dir)])
    line = _one_line(capsys.readouterr().err)
    assert code == 3 and "out of memory on rank 0 while writing last_model.pt and best_model.pt (" in line
    assert " MiB in fp32, a tensor at a time: at most " in line
    assert "nothing is lost: checkpoints/step_00000002 holds this step's state" in line and "scale-ocr export" in line
    assert not list(run_dir.glob("*.pt")) and not list(run_dir.glob(".*.tmp*"))  # no file, no partial one
    monkeypatch.undo()
    export(run_dir, tmp_path / "model.safetensors")  # the trained model, from the checkpoint written first


def test_a_checkpoint_that_does_not_fit_in_memory_keeps_the_last_good_one(tmp_path, capsys, monkeypatch):
    import torch.distributed.checkpoint as dcp

    save, calls = dcp.save, []

    def save_once(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError(ALLOCATOR_FAILURE)
        return save(*args, **kwargs)

    monkeypatch.setattr(dcp, "save", save_once)
    run_dir = tmp_path / "run"
    code = main([*SMALL, "--max-steps", "4", "--save-every", "2", "--output-dir", str(run_dir)])
    line = _one_line(capsys.readouterr().err)
    assert code == 3 and "while writing checkpoint step_00000004 (" in line and "of model and optimizer state" in line
    assert "checkpoints/step_00000002, the newest complete one, is kept" in line
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]  # the partial one removed
    monkeypatch.undo()
    assert main([*SMALL, "--max-steps", "4", "--save-every", "2", "--output-dir", str(run_dir)]) == 0  # resumes
    assert "resumed from" in capsys.readouterr().out and read_metrics(run_dir)["steps"] == 4
