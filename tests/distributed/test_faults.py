"""Faults of multi-process jobs: a stopped rank is named within --dist-timeout; SIGTERM to torchrun makes
every rank checkpoint together, and the next launch resumes; a rank killed on one of two (simulated) nodes
under ``torchrun --max-restarts`` resumes and ends with an uninterrupted run's weights."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import BIN, REPO, TRAIN, _env

from scale_ocr.distributed.process_group import free_port

ARGS = ["--strategy", "ddp", "--train-samples", "128", "--val-samples", "8", "-b", "4", "--max-chars", "5",
        "--log-every", "1", "--sched", "constant", "--wandb-mode", "disabled", "--epochs", "1"]


def _worker_pids(run_dir: Path) -> list[int]:
    """The training processes (not the launchers) of a run, oldest first."""
    found = subprocess.run(["pgrep", "-f", "--", f"train.py .*--output-dir {run_dir}"], capture_output=True, text=True)
    pids = [int(p) for p in found.stdout.split()]
    workers = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not any(b"torchrun" in c or b"torch.distributed.run" in c for c in cmd[:2]):
            workers.append(pid)
    return sorted(workers)


@pytest.mark.slow
def test_stopped_rank_ends_the_job_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), str(TRAIN), *ARGS, "--train-samples", "4096", "--dist-timeout", "10",
           "--output-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 2/"):
                break
        workers = _worker_pids(run_dir)
        assert len(workers) == 2
        stopped_at = time.time()
        os.kill(workers[-1], signal.SIGSTOP)  # the youngest worker: local rank 1
        _, err = proc.communicate(timeout=10 + 30 + 30)
        elapsed = time.time() - stopped_at
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    lines = [ln for ln in err.splitlines() if ln.startswith("scale-ocr: error:")]
    assert len(lines) == 1 and "rank 1 stopped responding" in lines[0] and "--dist-timeout" in lines[0], err
    assert proc.returncode != 0 and elapsed < 10 + 30, elapsed


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_on_every_rank_and_resumes(tmp_path):
    """torchrun forwards SIGTERM to its workers; they agree on the step, save together and exit 75; the next
    launch continues from that checkpoint."""
    run_dir = tmp_path / "run"
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), str(TRAIN), *ARGS, "--output-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("step 3/"):
            proc.send_signal(signal.SIGTERM)
            break
    _, err = proc.communicate(timeout=120)
    lines = [ln for ln in err.splitlines() if ln.startswith("scale-ocr: stopped:")]
    assert len(lines) == 1 and "SIGTERM received" in lines[0], err
    saved = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert saved in lines[0] and {p.name for p in (run_dir / "checkpoints" / saved).glob("rng_rank*.pt")} == {
        "rng_rank0.pt", "rng_rank1.pt"}
    again = subprocess.run(cmd[:6] + [str(free_port())] + cmd[7:], cwd=REPO, env=_env(), capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and f"at step {int(saved.split('_')[1])}" in again.stdout, again.stderr[-2000:]


def _two_nodes(run_dir: Path, extra: list[str]) -> list[subprocess.Popen]:
    """``torchrun --nnodes 2 --node_rank 0|1`` on 127.0.0.1, one rank each: two simulated nodes. Output goes to
    files: a pipe nobody reads while the test waits would fill up and block the job."""
    port, procs = free_port(), []
    for node in (0, 1):
        cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(port), *extra, str(TRAIN), *ARGS,
               "--train-samples", "64", "--save-every", "2", "--dist-timeout", "10", "--output-dir", str(run_dir)]
        log = open(run_dir.parent / f"{run_dir.name}.node{node}.log", "w")  # noqa: SIM115 - closed by _finish
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
        procs[-1].log = log
    return procs


def _finish(procs: list[subprocess.Popen], run_dir: Path, timeout: float = 240) -> list[str]:
    """Both agents' output once they exit; agents and workers still running after ``timeout`` are killed."""
    deadline = time.time() + timeout
    while time.time() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    for pid in _worker_pids(run_dir):
        os.kill(pid, signal.SIGKILL)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)
        p.log.close()
    return [Path(p.log.name).read_text() for p in procs]


@pytest.mark.slow
def test_killed_rank_on_one_of_two_nodes_restarts_and_matches_an_uninterrupted_run(tmp_path):
    straight = tmp_path / "straight"
    outs = _finish(_two_nodes(straight, []), straight)
    assert (straight / "last_model.pt").is_file(), "\n".join(o[-1500:] for o in outs)

    run_dir = tmp_path / "killed"
    procs = _two_nodes(run_dir, ["--max-restarts", "2"])
    deadline = time.time() + 240
    while not (run_dir / "checkpoints" / "step_00000004").is_dir():
        assert time.time() < deadline and all(p.poll() is None for p in procs), "the job never saved step 4"
        time.sleep(0.3)
    victim = [pid for pid in _worker_pids(run_dir)  # node 1's worker: the child of node 1's agent
              if Path(f"/proc/{pid}/stat").read_text().split()[3] == str(procs[1].pid)]
    assert victim, "no worker of node 1"
    os.kill(victim[0], signal.SIGKILL)
    outs = _finish(procs, run_dir, timeout=300)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-1500:] for o in outs)
    assert "resumed from" in outs[0] and "Traceback" not in outs[0] + outs[1], outs[0][-3000:]
    wa = torch.load(straight / "last_model.pt", weights_only=True)
    wb = torch.load(run_dir / "last_model.pt", weights_only=True)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
