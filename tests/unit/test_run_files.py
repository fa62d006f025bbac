"""A run directory is ours or refused, and a full disk is one line: links, foreign files, ENOSPC, EFBIG.

The refusals run ``main`` in this process (they stop before a model is built). The disk faults are real processes
on a real fault: a small tmpfs mounted for the test (ENOSPC; needs root, skipped with the reason otherwise) and
``RLIMIT_FSIZE`` as ``ulimit -f`` sets it (EFBIG; Python ignores SIGXFSZ, so the write fails instead of killing).
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TRAIN, _env, torchrun_train

from scale_ocr.checkpoint.manifest import verify_manifest
from scale_ocr.config import LoggingConfig
from scale_ocr.disk import EXIT_DISK_FULL, DiskFault, write_atomic
from scale_ocr.errors import UserError
from scale_ocr.tracking.jsonl import JsonlLogger
from scale_ocr.tracking.wandb_logger import open_wandb
from scale_ocr.train import main

# The smallest real run: one checkpoint of it is ~400 KB (a 357 KB shard), a model file ~76 KB.
MODEL = ["vitstr_tiny", "--model-width", "32", "--model-depth", "1", "--input-size", "16x64", "--vocab", "digits"]
SMALL = [*MODEL, "--strategy", "single", "--train-samples", "32", "--val-samples", "4", "-b", "4", "--max-chars", "5",
         "--log-every", "2", "--wandb-mode", "disabled"]


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("scale-ocr: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the run directory that a link in it points to: it must come through untouched."""
    path = tmp_path / "precious.txt"
    path.write_text("precious\n")
    return path


@pytest.mark.parametrize("name", [".scale-ocr.lock", "config.json", "metrics.jsonl"])
def test_symlinked_run_file_is_refused(tmp_path, victim, capsys, name):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / name).symlink_to(victim)
    code = main([*SMALL, "--max-steps", "1", "--output-dir", str(run_dir)])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and f"{run_dir / name} is a symbolic link (to {victim})" in line and "remove it" in line, line
    assert victim.read_text() == "precious\n" and (run_dir / name).is_symlink()
    assert sorted(p.name for p in run_dir.iterdir()) == sorted({name, ".scale-ocr.lock"})  # nothing else written


def test_a_wandb_link_out_of_the_run_is_refused_at_start(tmp_path, capsys):
    """W02: ``RUN/wandb`` replaced by a link to a folder outside, then the run resumed: W&B wrote its offline run
    into the link's target. check_run_entries refuses it as the other run entries: one line, exit 2, nothing
    written there."""
    run_dir, victim = tmp_path / "run", tmp_path / "victim_w02"
    run_dir.mkdir()
    victim.mkdir()
    (run_dir / "wandb").symlink_to(victim)
    code = main([*SMALL[:-2], "--wandb-mode", "offline", "--max-steps", "1", "--output-dir", str(run_dir)])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and f"{run_dir / 'wandb'} is a symbolic link (to {victim})" in line, line
    assert list(victim.iterdir()) == [] and (run_dir / "wandb").is_symlink()


def test_wandb_never_writes_through_a_link_planted_after_the_start_up_check(tmp_path, capsys):
    """W02, mid-run: W&B's folder is checked (and made ours) just before W&B starts; a link there disables W&B
    with one warning and the run logs to metrics.jsonl, W&B writes nothing through it."""
    run_dir, target = tmp_path / "run", tmp_path / "victim_dir"
    run_dir.mkdir()
    target.mkdir()
    (run_dir / "wandb").symlink_to(target)
    assert open_wandb(LoggingConfig(wandb_mode="offline"), run_dir, {}, resume=True) is None
    err = capsys.readouterr().err
    assert "scale-ocr: warning: W&B is not started" in err and "is a symbolic link" in err, err
    assert list(target.iterdir()) == [] and not (run_dir / "wandb_run_id").exists()


def test_foreign_owned_entry_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    os.chown(metrics, os.geteuid() + 4242, -1)  # tests run as root; as anyone else chown fails and this skips
    code = main([*SMALL, "--max-steps", "1", "--output-dir", str(run_dir)])
    line = _one_line(capsys.readouterr().err)
    assert code == 2 and f"{metrics} belongs to uid {os.geteuid() + 4242}, not to this user" in line, line
    assert metrics.read_text() == '{"step": 1}\n' and not (run_dir / "config.json").exists()


def test_writers_refuse_a_link_planted_after_the_start_up_check(tmp_path, victim):
    run_dir = tmp_path / "run"
    JsonlLogger(run_dir).close()
    (run_dir / "metrics.json").symlink_to(victim)
    with pytest.raises(UserError, match="metrics.json is a symbolic link"):
        write_atomic(run_dir / "metrics.json", "{}", what="the run summary", kept="-")
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(UserError, match="metrics.jsonl is a symbolic link"):
        JsonlLogger(run_dir, append=True)  # O_NOFOLLOW: the stream is never opened through it
    assert victim.read_text() == "precious\n"


def _train(args: list[str], limit_bytes: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:  # what `ulimit -f` does in the shell that launches the job
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, str(TRAIN), *args], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300, preexec_fn=limit if limit_bytes else None)


@pytest.fixture
def small_fs(tmp_path: Path):
    """``small_fs(size)``: a tmpfs of ``size`` mounted under tmp_path (unmounted afterwards)."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"fs{len(mounts)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"a small file system cannot be mounted here (mount -t tmpfs: {proc.stderr.strip()}); "
                        "a full disk needs root or a loop device")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_full_disk_during_a_checkpoint_save_is_one_line_and_keeps_the_previous(small_fs):
    run_dir = small_fs("700k") / "run"  # room for the step-2 checkpoint, not for step 4's beside it
    proc = _train([*SMALL, "--max-steps", "4", "--save-every", "2", "--output-dir", str(run_dir)])
    line = _one_line(proc.stderr)
    assert proc.returncode == EXIT_DISK_FULL, proc.stderr[-2000:]
    ckpts = run_dir / "checkpoints"
    assert f"could not write checkpoint {ckpts / 'step_00000004'} (ENOSPC: the file system is full" in line, line
    assert "KiB needed" in line and "free there" in line and "checkpoints/step_00000002, the newest" in line, line
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000002"]  # the partial one is removed
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    assert verify_manifest(ckpts / "step_00000002")  # intact, every file as its manifest says


def test_file_size_limit_during_a_save_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train([*SMALL, "--max-steps", "2", "--save-every", "2", "--output-dir", str(run_dir)],
                  limit_bytes=200_000)  # `ulimit -f 195`: the 357 KB shard cannot be written
    line = _one_line(proc.stderr)
    assert proc.returncode == EXIT_DISK_FULL, proc.stderr[-2000:]
    assert ("unexpected pos" not in proc.stderr
            and "EFBIG: the file size limit (ulimit -f) is reached (195.3 KiB a file)" in line)
    assert "the partial checkpoint was removed (no earlier checkpoint exists)" in line, line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == []


def test_export_to_a_full_disk_is_one_line_and_keeps_the_previous_export(tmp_path, small_fs):
    run_dir = tmp_path / "run"
    assert main([*SMALL, "--max-steps", "2", "--save-every", "2", "--no-eval", "--output-dir", str(run_dir)]) == 0
    out = small_fs("40k") / "model.safetensors"  # the export needs ~76 KB
    out.write_bytes(b"the previous export")
    proc = subprocess.run([sys.executable, "-m", "scale_ocr", "export", str(run_dir), str(out)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=120)
    line = _one_line(proc.stderr)
    assert proc.returncode == EXIT_DISK_FULL and f"could not write the export {out} (ENOSPC" in line, line
    assert "KiB needed" in line and "the previous model.safetensors is kept" in line, line
    assert out.read_bytes() == b"the previous export" and sorted(p.name for p in out.parent.iterdir()) == [out.name]


@pytest.mark.slow
def test_full_disk_during_a_two_rank_save_ends_both_ranks_with_one_line(small_fs):
    run_dir = small_fs("700k") / "run"
    proc = torchrun_train([*SMALL, "--strategy", "ddp", "--max-steps", "4", "--save-every", "2",
                           "--output-dir", str(run_dir)], timeout=240)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("scale-ocr: error:")]
    assert len(lines) == 1 and "could not write checkpoint" in lines[0] and "ENOSPC" in lines[0], proc.stderr[-3000:]
    # The one traceback is torchrun's own report of its workers' exit codes (ChildFailedError), none is a rank's.
    assert proc.stderr.count("Traceback") == 1 and "ChildFailedError" in proc.stderr, proc.stderr[-3000:]
    # Both ranks end with the same code, unless torchrun, seeing rank 0's exit first, stops the other (SIGTERM, -15).
    codes = re.findall(r"exitcode  : (-?\d+)", proc.stderr)
    assert sorted(codes) in (["74", "74"], ["-15", "74"]) and "exitcode  : 74" in proc.stderr.split("Root Cause")[1], \
        proc.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_00000002"]


def _fill(where: Path, leave: int = 0) -> None:
    """Fill ``where``'s file system, leaving about ``leave`` bytes."""
    with open(where / "filler", "wb") as f:
        try:
            f.write(b"\0" * (os.statvfs(where).f_bavail * os.statvfs(where).f_frsize - leave))
        except OSError:
            pass


def test_full_disk_during_a_metrics_write_is_one_line_and_leaves_whole_records(small_fs):
    run_dir = small_fs("64k") / "run"
    logger = JsonlLogger(run_dir)
    logger.log({"loss": 1.0}, step=1)
    _fill(run_dir.parent)
    with pytest.raises(DiskFault) as info:  # a one-process job: raised at once (a multi-rank one ends at agreement)
        for step in range(2, 200):
            logger.log({"loss": 1.0, "note": "x" * 512}, step=step)
    line = str(info.value)
    assert "\n" not in line and f"could not write metrics {run_dir / 'metrics.jsonl'} (ENOSPC" in line, line
    assert "metrics.jsonl up to step" in line and "free space there" in line, line
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]  # no half record
    assert records[0] == {**records[0], "step": 1, "loss": 1.0}


def test_full_disk_under_wandb_stops_the_run_instead_of_losing_records_silently(small_fs, monkeypatch):
    """W&B's own writer drops records on a full disk and says so only in its debug log: the logger checks first."""
    where = small_fs("4m")
    monkeypatch.setenv("WANDB_DIR", str(where))
    (where / "run").mkdir()
    logger = open_wandb(LoggingConfig(wandb_mode="offline"), where / "run", {"lr": 1e-3})
    try:
        logger.log({"loss": 1.0}, step=1)
        _fill(where, leave=64 << 10)
        with pytest.raises(DiskFault) as info:
            logger.log({"loss": 0.5}, step=2)
        line = str(info.value)
        assert "\n" not in line and "could not write W&B's files in" in line and str(where) in line, line
        assert ("ENOSPC: the file system is full" in line
                and "metrics.jsonl and every checkpoint written are kept" in line)
    finally:
        (where / "filler").unlink(missing_ok=True)
        logger.broken = False
        logger.close()


def test_full_disk_when_config_json_is_written_is_one_line(small_fs, capsys):
    run_dir = small_fs("64k") / "run"
    run_dir.mkdir()
    _fill(run_dir.parent, leave=4096)  # one tmpfs page: the lock file's, none for config.json
    assert main([*SMALL, "--max-steps", "2", "--output-dir", str(run_dir)]) == EXIT_DISK_FULL
    line = _one_line(capsys.readouterr().err)
    assert f"could not write the run's config {run_dir / 'config.json'} (ENOSPC: the file system is full" in line, line
    assert not (run_dir / "config.json").exists() and not list(run_dir.glob(".config.json.tmp*"))
