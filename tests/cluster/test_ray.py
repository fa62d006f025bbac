"""Ray Train on a real local Ray cluster: ``ray start --head --num-cpus 2`` on this host, shared by the tests here.

``scale-ocr ray-train --num-workers 2 --max-failures 1`` trains to ``--max-steps`` at world size 2 while rank 0's
worker process is SIGKILLed after the first checkpoint: Ray restarts the worker group, which resumes from
scale-ocr's checkpoint and finishes (exit 0). The fast tests need no cluster: what the driver refuses before Ray
is involved, what a worker returns for a user error instead of raising it, and the line of a run Ray gave up on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from conftest import BIN, REPO, _env, read_jsonl, read_metrics

from scale_ocr.distributed.process_group import free_port
from scale_ocr.errors import UserError

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray Train is not installed: pip install 'scale-ocr[ray]'")

MAX_STEPS = 100
# A model of a few thousand weights, so most of the time is Ray's (its actors and workers starting) and the kill
# lands well inside the run: 8 steps an epoch, a checkpoint every 10.
FLAGS = ["vitstr_tiny", "--model-width", "32", "--model-depth", "1", "--model-heads", "2", "--input-size", "16x64",
         "--vocab", "digits", "--strategy", "ddp", "--max-steps", str(MAX_STEPS), "--epochs", "100",
         "--train-samples", "64", "--val-samples", "8", "-b", "4", "--max-chars", "5", "--log-every", "10",
         "--save-every", "10", "--sched", "constant", "--wandb-mode", "disabled"]
RESUMED = re.compile(r"scale-ocr: resumed from (\S+) at step (\d+)")
# Token authentication, the token in the environment of the head (and so of every worker) and of the drivers: the
# cluster neither depends on nor writes ~/.ray/auth_token, whose presence changes what `ray start` does.
RAY_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@pytest.fixture(scope="module")
def ray_address():
    """A one-node Ray cluster of 2 CPUs on this host; its address. Stopped by killing its ``ray start --block``
    and what that started (``ray stop`` would end every Ray instance on the host, not only this one)."""
    # Short: Ray's socket paths under it must fit in 107 bytes.
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    log = temp / "head.log"
    with open(log, "w") as out:
        head = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "2", "--port", str(free_port()),
             "--node-ip-address", "127.0.0.1", "--temp-dir", str(temp), "--include-dashboard=false",
             "--disable-usage-stats"], env={**_env(), **RAY_ENV}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield re.search(r"ray start --address='([^']+)'", log.read_text()).group(1)
    finally:
        _stop(head)
        shutil.rmtree(temp, ignore_errors=True)


def _stop(head: subprocess.Popen) -> None:
    """SIGKILL ``ray start --block`` and everything it started: its GCS, raylet and agents, and the raylet's
    workers, which run in sessions of their own (so not in its process group) but are its descendants."""
    try:
        family = [head, *psutil.Process(head.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in family:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs([p for p in family if isinstance(p, psutil.Process)], timeout=30)
    head.wait(timeout=30)


def _launch(cmd: list[str], address: str, log: Path) -> subprocess.Popen:
    env = {**_env(), **RAY_ENV, "RAY_ADDRESS": address}
    with open(log, "w") as out:  # a file, not a pipe nobody reads while the test waits
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@needs_ray
@pytest.mark.slow
def test_two_workers_train_to_max_steps_and_resume_after_a_worker_is_killed(ray_address, tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "driver.log"
    driver = _launch([str(BIN / "scale-ocr"), "ray-train", "--num-workers", "2", "--max-failures", "1",
                      "--storage-path", str(tmp_path / "ray"), "--", *FLAGS, "--output-dir", str(run_dir)],
                     ray_address, log)
    try:
        latest, deadline = run_dir / "checkpoints" / "latest", time.monotonic() + 180
        while not latest.is_file():
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        # Rank 0 holds the run directory's lock, which names its pid: its Ray worker process.
        os.kill(json.loads((run_dir / ".scale-ocr.lock").read_text())["pid"], signal.SIGKILL)
        killed_after = int(latest.read_text().strip().rsplit("_", 1)[1])
        assert not (run_dir / "metrics.json").exists(), "the run ended before the kill: raise MAX_STEPS"
        rc = driver.wait(timeout=240)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    out = log.read_text()
    assert rc == 0, out[-4000:]
    resumed = RESUMED.findall(out)
    assert len(resumed) == 1 and int(resumed[0][1]) >= killed_after and resumed[0][0].startswith(str(run_dir)), out
    assert "lost contact with another rank" in out and "Ray Train restarts the workers" in out, out[-4000:]
    metrics = read_metrics(run_dir)
    assert (metrics["launcher"], metrics["world_size"], metrics["steps"]) == ("ray", 2, MAX_STEPS), metrics
    steps = [r["step"] for r in read_jsonl(run_dir) if "train/loss" in r]
    assert steps == list(range(10, MAX_STEPS + 1, 10)), steps  # each logged once: the resume trimmed the log


def test_a_user_error_in_a_worker_is_returned_not_raised(tmp_path, monkeypatch):
    """The function Ray calls on every worker, run here as a 1-rank job of its own: a user error (a run directory
    that holds something else) comes back as its exit code and line, which ``finish`` prints on the driver;
    raised, Ray would retry it --max-failures times."""
    from scale_ocr.cli.ray_train import train_loop_per_worker
    from scale_ocr.distributed.process_group import destroy_distributed

    monkeypatch.chdir(tmp_path)  # the worker enters the driver's folder; this test's folder is given back after
    run_dir = tmp_path / "taken"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("not a scale-ocr run")
    try:
        outcome = train_loop_per_worker({"argv": [*FLAGS, "--output-dir", str(run_dir)], "cwd": str(tmp_path)})
    finally:
        destroy_distributed()  # Ray's to do after a worker's function returns; here, this process's
    assert outcome == {"exit_code": 2, "line": f"scale-ocr: error: --output-dir {run_dir} is not empty and holds no "
                       "scale-ocr run (notes.txt); pick a new or empty directory"}
    assert (run_dir / "notes.txt").read_text() == "not a scale-ocr run"


def test_a_restart_continues_this_jobs_checkpoints_not_the_given_resume(tmp_path, capsys):
    """``--resume PATH`` (or ``none``) is where the job's first attempt starts; once the job has checkpointed, a
    restart continues from there with ``--resume auto``, instead of starting over and moving that work aside."""
    from scale_ocr.cli.ray_train import continue_own_run

    other, run_dir = tmp_path / "other_run", tmp_path / "run"
    other.mkdir()
    (run_dir / "checkpoints").mkdir(parents=True)
    argv = [*FLAGS, "--resume", str(other), "--output-dir", str(run_dir)]
    assert continue_own_run(argv, time.time()) == argv  # the first attempt: nothing of this job yet
    (run_dir / "checkpoints" / "latest").write_text("step_00000010\n")
    assert continue_own_run(argv, time.time() + 60) == argv  # a checkpoint older than the job: not its own
    assert continue_own_run(argv, time.time() - 60) == [*argv, "--resume", "auto"]
    assert capsys.readouterr().out == (f"scale-ocr: Ray Train restarted the workers: continuing from this job's own "
                                       f"{run_dir / 'checkpoints' / 'step_00000010'}, not --resume {other}\n")
    auto = [*FLAGS, "--output-dir", str(run_dir)]
    assert continue_own_run(auto, time.time() - 60) == auto  # --resume auto finds it by itself


@needs_ray
def test_the_example_driver_builds_on_the_package():
    """``examples/ray/driver.py`` imports what it uses from scale_ocr and Ray (run, it needs a cluster)."""
    import importlib.util as util

    spec = util.spec_from_file_location("ray_example_driver", REPO / "examples" / "ray" / "driver.py")
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its main() runs only as a script
    assert callable(module.main)


def test_mistakes_are_refused_before_ray_is_involved(tmp_path, capsys):
    """Each mistake is found before Ray is imported or a cluster joined: one line, exit 2."""
    from scale_ocr.cli import ray_train

    out = tmp_path / "r"
    assert ray_train.main(["--num-workers", "2", "--", "--strategy", "dp", "--output-dir", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "scale-ocr: error: --strategy dp runs in one process, but this job has 2 ranks (launched by ray); start it "
        "with plain `python` or pick ddp, fsdp or zero2"]
    with pytest.raises(SystemExit) as stop:  # argparse's own usage line and error, as every scale-ocr command
        ray_train.main(["--num-workers", "2", "--max-steps", "4"])
    assert stop.value.code == 2 and "training flags go after --" in capsys.readouterr().err
    assert not out.exists()


def test_without_ray_installed_the_line_names_the_extra(monkeypatch, capsys, tmp_path):
    from scale_ocr.cli import ray_train

    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where it is not installed
    assert ray_train.main(["--num-workers", "2", "--", "--output-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith("install it with `pip install 'scale-ocr[ray]'`"), err


@needs_ray
def test_ray_train_v1_is_refused_in_one_line(monkeypatch):
    """Under Ray Train's V1 API (RAY_TRAIN_V2_ENABLED=0) ``ray.train.Result`` is V1's, which carries no value
    returned by the workers, so no outcome could reach the driver: refused, naming the switch."""
    import ray.air.result
    import ray.train

    from scale_ocr.cli.ray_train import import_ray

    monkeypatch.setattr(ray.train, "Result", ray.air.result.Result)  # the class `import ray.train` gives under V1
    with pytest.raises(UserError, match="needs Ray Train's V2 API, and Ray .* gives V1 here: unset RAY_TRAIN_V2"):
        import_ray()


@needs_ray
def test_a_run_ray_gave_up_on_is_one_line_naming_each_rank():
    """What ``trainer.fit()`` raises once the restarts are used up (or for a failure Ray does not retry), as Ray
    builds it: a dead worker's RayActorError, a training function's exception wrapped with its traceback."""
    from ray.exceptions import ActorDiedError
    from ray.train import ControllerError, WorkerGroupError
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from scale_ocr.cli.ray_train import failure
    from scale_ocr.errors import RunStopped

    reset = UserExceptionWithTraceback(RuntimeError("Connection reset by peer\n(gloo)"), "Traceback ...")
    lost = failure(WorkerGroupError("workers failed", {1: ActorDiedError(), 0: reset}), "/runs/x")
    assert lost.exit_code == 69 and str(lost) == (
        "Ray Train gave up on the run (--max-failures): rank 0: Connection reset by peer; rank 1: The actor died "
        "unexpectedly before finishing this task; the checkpoints in /runs/x are kept, and the same command "
        "continues from the newest")
    stop = RunStopped("SIGTERM received: the checkpoint is written", 75, "stopped")
    preempted = failure(WorkerGroupError("", {0: UserExceptionWithTraceback(stop, "Traceback ...")}), "/runs/x")
    assert (str(preempted), preempted.exit_code, preempted.prefix) == (str(stop), 75, "stopped")
    short = failure(ControllerError(RuntimeError("Insufficient cluster resources.\nThe group requires 3 CPUs")), "/r")
    assert short.exit_code == 1 and "Insufficient cluster resources. The group requires 3 CPUs;" in str(short)


def test_documented_ray_commands_parse():
    """The ``scale-ocr ray-train`` and ``examples/ray/driver.py`` lines of the docs take today's options and
    training flags."""
    import shlex

    from scale_ocr.cli.args import build_parser
    from scale_ocr.cli.ray_train import split_args

    launch = re.compile(r"(?:scale-ocr ray-train|examples/ray/driver\.py)(?=\s|$)")
    found = 0
    for page in (REPO / "docs" / "launchers.md", REPO / "examples" / "ray" / "README.md"):
        blocks = re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)
        for line in (ln for block in blocks for ln in block.replace("\\\n", " ").splitlines()):
            match = launch.search(line)
            if match:
                opts, train = split_args(shlex.split(line[match.end():], comments=True))
                build_parser().parse_args(train)  # argparse exits on a flag it does not know
                found += 1
    assert found >= 4, found
