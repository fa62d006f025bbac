"""SLURM for real: the shipped ``examples/slurm/*.sbatch`` files submitted with ``sbatch`` to a SLURM controller and
two node daemons started on this host (``slurm_cluster.py``: 2 nodes x 1 task, as Debian's slurmd runs several
per host), then the run's metrics read back; and a job warned by ``--signal=USR1@N`` before its time limit, which
checkpoints, requeues itself and finishes with the steps of an uninterrupted run.

Timing of the warning. slurmctld looks at time limits every 30 s from its start and warns a job at the first look
that finds at most N + 30 s left; a requeued job may start again CRED_EXPIRE + 1 s after ``scontrol requeue``
(slurm_cluster.py sets 7 s; SLURM's default is 120). With a 1-minute limit and N = 7:

- the test submits within 3 s after a look (read from slurmctld's log), so the first run starts at most ~5 s after
  it; the next look finds at most 35 s left (N + 30 = 37) and warns it 25-29 s in, after its ~14 s of start-up;
- it checkpoints and is requeued ~2 s after the look, and the second run starts ~10-12 s after it: that run's
  first look finds 40 s or more left (no warning), its second comes ~48 s in.

The first run must still be training when warned, and the second must finish in its ~48 s, on a machine whose
pace moves twice over with the load of its neighbours (0.11 to 0.24 s a step here). So the warned job gets as
many steps as the first run would train in 45 s at the pace the uninterrupted train.sbatch run measured just
before (start-up and seconds per step): warned ~15 s before its end, it leaves the second run ~15 s of steps.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
from itertools import pairwise
from pathlib import Path

import pytest
from conftest import BIN, REPO, _env, fixture_dir, read_jsonl, read_metrics
from slurm_cluster import NODES, SlurmCluster, missing_programs

from scale_ocr.distributed.process_group import _slurm_first_host

MISSING = missing_programs()
needs_slurm = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
EXAMPLES = REPO / "examples" / "slurm"
WARN = 7  # --signal=USR1@WARN (see the module docstring)
# The shipped files, uninterrupted: 6 steps at 4 samples per rank.
SHORT = ["--strategy", "ddp", "--threads", "1", "--max-steps", "6", "--train-samples", "64", "--val-samples", "16",
         "-b", "4", "--log-every", "2", "--max-chars", "5", "--lr", "1e-3", "--wandb-mode", "disabled"]
FIRST_RUN = 45  # seconds the warned job's first run would train uninterrupted (module docstring)


def long_args(steps: int) -> list[str]:
    """The warned job's flags: SHORT's model and batch, ``steps`` steps of one epoch, every step logged."""
    return ["--strategy", "ddp", "--threads", "1", "--max-steps", str(steps), "--epochs", "1",
            "--train-samples", str(8 * steps), "--val-samples", "8", "-b", "4", "--log-every", "1",
            "--max-chars", "5", "--lr", "1e-3", "--sched", "constant", "--wandb-mode", "disabled"]


@pytest.fixture(scope="module")
def cluster():
    if MISSING:
        pytest.skip(MISSING)
    slurm = SlurmCluster().start()
    try:
        yield slurm
    finally:
        slurm.stop()


def job_env(runs: Path, train_args: list[str]) -> dict[str, str]:
    """What a user's shell passes to sbatch: the venv active, the script's two settings exported."""
    return _env() | {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RUNS_DIR": str(runs),
                     "TRAIN_ARGS": " ".join(train_args)}


def finished(slurm: SlurmCluster, job: str, log: Path, timeout: float) -> tuple[dict[str, str], str]:
    """Wait for the job; its last fields and its log, which must show it completed with exit code 0."""
    info = slurm.wait_job(job, timeout)
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), \
        f"job {job}: {info['JobState']} exit {info['ExitCode']}\n{text[-4000:]}\n{slurm.logs()}"
    return info, text


def optimizer_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir) if "train/loss" in r]


def pace(run_dir: Path, log: str) -> tuple[float, float]:
    """Seconds from an uninterrupted job's start to its first step, and seconds per step after it."""
    stamp = re.search(r"^scale-ocr: (\S+ \S+) job \d+ run 1 ", log, re.M).group(1)  # the script's first line
    started = datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()
    (s0, t0), *_, (s1, t1) = [(r["step"], r["time"]) for r in read_jsonl(run_dir) if "train/loss" in r]
    per_step = (t1 - t0) / (s1 - s0)
    return t0 - s0 * per_step - started, per_step


@pytest.fixture(scope="module")
def plain_run(cluster, tmp_path_factory) -> tuple[Path, dict[str, str], str]:
    """train.sbatch as shipped, uninterrupted, on the fresh cluster: its run directory, job fields and log."""
    with fixture_dir(tmp_path_factory, "plain") as runs:
        job = cluster.sbatch(["-J", "train", "-o", str(runs / "train.out"), str(EXAMPLES / "train.sbatch")],
                             job_env(runs, SHORT), REPO)
        info, text = finished(cluster, job, runs / "train.out", timeout=120)
        yield runs / "train", info, text


@pytest.mark.slow
@needs_slurm
def test_train_sbatch_trains_a_rank_on_each_of_two_nodes(plain_run):
    run_dir, info, text = plain_run
    assert info["NodeList"] == f"n[1-{len(NODES)}]" and info["NumNodes"] == "2", info
    metrics = read_metrics(run_dir)
    assert (metrics["world_size"], metrics["global_batch"], metrics["steps"]) == (2, 8, 6), metrics
    assert metrics["launcher"] == "slurm", metrics
    assert optimizer_steps(run_dir) == [2, 4, 6], text[-3000:]


@pytest.mark.slow
@needs_slurm
def test_warned_job_checkpoints_requeues_and_finishes_its_steps(cluster, plain_run, tmp_path):
    start_up, per_step = pace(plain_run[0], plain_run[2])
    steps = max(40, round((FIRST_RUN - start_up) / per_step))  # see the module docstring
    since = cluster.after_time_check(within=3)
    log = tmp_path / "warned.out"
    job = cluster.sbatch(["-J", "warned", "--time=1", f"--signal=USR1@{WARN}", "-o", str(log),
                          str(EXAMPLES / "train.sbatch")], job_env(tmp_path, long_args(steps)), REPO)
    info, text = finished(cluster, job, log, timeout=240)
    where = (f"({steps} steps at {per_step:.2f} s after {start_up:.1f} s of start-up, submitted {since:.1f} s after "
             f"a time-limit check)\n{text[-5000:]}")
    assert int(info["Restarts"]) >= 1, f"the first run trained all its steps before its warning {where}"
    runs = re.findall(r"^scale-ocr: \S+ \S+ job \d+ run (\d+) \(SLURM_RESTART_COUNT=(\d+)\)", text, re.M)
    assert [int(n) for n, _ in runs] == list(range(1, len(runs) + 1)) and len(runs) >= 2, where
    stops = re.findall(r"SIGUSR1 received: stopped after step (\d+) of \d+, checkpoint \S+ written", text)
    resumes = [int(s) for s in re.findall(r"^scale-ocr: resumed from \S+ at step (\d+)", text, re.M)]
    assert len(stops) == len(runs) - 1 and resumes == [int(s) for s in stops], where
    assert all(a < b for a, b in pairwise([0, *resumes, steps])), where  # every run made progress
    assert text.count("preempted, checkpoint written; requeueing it") == len(stops), where
    print(f"warned job {job}: {len(runs)} runs, stopped after steps {stops}; {where.splitlines()[0]}")
    run_dir = tmp_path / "warned"
    metrics = read_metrics(run_dir)
    assert (metrics["world_size"], metrics["global_batch"], metrics["steps"]) == (2, 8, steps), metrics
    assert metrics["launcher"] == "slurm", metrics
    assert optimizer_steps(run_dir) == list(range(1, steps + 1)), where  # each step once, as uninterrupted


@pytest.mark.slow
@needs_slurm
def test_torchrun_sbatch_trains_a_rank_on_each_of_two_nodes(cluster, tmp_path):
    job = cluster.sbatch(["-J", "torchrun", "-o", str(tmp_path / "torchrun.out"), str(EXAMPLES / "torchrun.sbatch")],
                         job_env(tmp_path, SHORT), REPO)
    info, text = finished(cluster, job, tmp_path / "torchrun.out", timeout=120)
    assert info["NodeList"] == f"n[1-{len(NODES)}]" and info["NumNodes"] == "2", info
    metrics = read_metrics(tmp_path / "torchrun")
    assert (metrics["world_size"], metrics["global_batch"], metrics["steps"]) == (2, 8, 6), metrics
    assert metrics["launcher"] == "torchrun", metrics
    assert optimizer_steps(tmp_path / "torchrun") == [2, 4, 6], text[-3000:]


@needs_slurm
@pytest.mark.parametrize("nodelist", ["n[1-2]", "a[01,03]", "x1,y[2-3]", "gpu[03-05,09],cpu1",
                                      "rack[1-2]-node[01-04],z9", "node-[7-8]", "login1"])
def test_first_host_of_a_node_list_is_scontrols(nodelist, tmp_path):
    """The rendezvous host a bare ``srun`` rank picks (no MASTER_ADDR) is the first of ``scontrol show hostnames``."""
    conf = tmp_path / "slurm.conf"  # scontrol parses node lists locally, but will not start without a config
    conf.write_text("ClusterName=x\nSlurmctldHost=localhost\n")
    listed = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True,
                            env={"PATH": os.environ.get("PATH", ""), "SLURM_CONF": str(conf)}).stdout.split()
    assert _slurm_first_host(nodelist) == listed[0]
