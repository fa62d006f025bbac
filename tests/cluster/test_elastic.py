"""torchrun elastic across nodes: ``examples/torchrun/elastic.sh`` (``--nnodes 1:2``, c10d rendezvous) on two
simulated nodes, two agents on 127.0.0.1 with one rank each. The node that does not host the rendezvous is killed
mid-run (its agent and its worker, as a node that vanishes); the survivor sees it within ``--dist-timeout``, goes
on alone from the last checkpoint, and a new node started later joins at the next restart: the job ends at
``--max-steps`` at world size 2 again. The run prints what each membership change cost (``pytest -s``).
Without the script's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, a worker warns that a join would hang the job."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import BIN, REPO, _env

from scale_ocr.distributed.process_group import free_port

SCRIPT = REPO / "examples" / "torchrun" / "elastic.sh"
FLAGS = shlex.split(SCRIPT.read_text().split("exec torchrun", 1)[1].replace("\\\n", " "))


def flag(name: str) -> int:
    return int(FLAGS[FLAGS.index(name) + 1])


MAX_STEPS, SAVE_EVERY, DIST_TIMEOUT = flag("--max-steps"), flag("--save-every"), flag("--dist-timeout")
STEP = re.compile(r"^step (\d+)/\d+ ", re.M)
RESUMED = re.compile(r"^scale-ocr: resumed from \S+ at step (\d+)(.*)$", re.M)
WORLD = re.compile(r"Rendezvous complete for workers.*?group_world_size=(\d+)", re.S)


class Node:
    """One simulated node: ``bash examples/torchrun/elastic.sh`` (which execs torchrun) with its output in a file."""

    def __init__(self, name: str, tmp: Path, env: dict[str, str]) -> None:
        self.log_path = tmp / f"node_{name}.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=REPO, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.monotonic()

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def workers(self) -> list[int]:
        """The agent's worker processes (torchrun starts each in a session of its own)."""
        found = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == str(self.proc.pid):  # the parent pid
                found.append(int(stat.parent.name))
        return found

    def hosts_rendezvous(self, port: int) -> bool:
        """Whether this agent serves the c10d rendezvous store: on 127.0.0.1 every agent's address matches the
        endpoint, and the first to bind the port hosts it."""
        return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN
                   for c in psutil.Process(self.proc.pid).net_connections("tcp"))

    def kill(self) -> None:
        """Gone like a node that lost power: agent and workers, at once."""
        for pid in self.workers():
            os.kill(pid, signal.SIGKILL)
        os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self.proc.wait(timeout=30)
        self.log.close()


def steps_after_resume(text: str, nth: int = 1) -> list[int]:
    """The steps printed after the ``nth`` "resumed from" line."""
    parts = re.split(r"^scale-ocr: resumed from .*$", text, flags=re.M)
    return [int(s) for s in STEP.findall(parts[nth])] if len(parts) > nth else []


def wait_for(check, what: str, nodes: list[Node], timeout: float) -> float:
    """Poll ``check()`` until true; the time it became true. Fails naming ``what`` with the logs' tails."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline or not any(n.proc.poll() is None for n in nodes):
            logs = "\n".join(f"--- {n.log_path.name}\n{n.text()[-2500:]}" for n in nodes)
            pytest.fail(f"{what} did not happen within {timeout:.0f} s\n{logs}")
        time.sleep(0.1)
    return time.monotonic()


def latest_step(run_dir: Path) -> int:
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().split("_")[1]) if latest.is_file() else 0


@pytest.mark.slow
def test_node_leaves_and_another_joins_the_job_ends_at_max_steps_at_world_size_two(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    # The simulated nodes share this host's cores: one thread per rank, or their threads would fight over them.
    env = {**_env(), "RDZV_ENDPOINT": f"127.0.0.1:{port}", "LOCAL_ADDR": "127.0.0.1", "OUTPUT_DIR": str(run_dir),
           "PATH": f"{BIN}:{os.environ['PATH']}", "LOGLEVEL": "INFO", "OMP_NUM_THREADS": "1"}
    nodes, t = [Node("a", tmp_path, env), Node("b", tmp_path, env)], {}
    try:
        wait_for(lambda: any(n.hosts_rendezvous(port) for n in nodes), "the rendezvous store starting", nodes, 60)
        survivor, leaver = sorted(nodes, key=lambda n: not n.hosts_rendezvous(port))  # the host must stay
        wait_for(lambda: latest_step(run_dir) >= SAVE_EVERY, "a checkpoint at world size 2", nodes, 90)
        t["kill"] = time.monotonic()
        leaver.kill()
        saved, before = latest_step(run_dir), max(int(s) for n in nodes for s in STEP.findall(n.text()))
        lost = re.compile(r"^scale-ocr: error: .*(lost contact|stopped responding)", re.M)
        t["seen"] = wait_for(lambda: lost.search(survivor.text()), "the survivor naming the lost node", nodes,
                             DIST_TIMEOUT + 30)
        t["alone"] = wait_for(lambda: len(WORLD.findall(survivor.text())) >= 2, "the rendezvous at world size 1",
                              nodes, 90)
        t["resumed"] = wait_for(lambda: RESUMED.search(survivor.text()), "the resume at world size 1", nodes, 60)
        wait_for(lambda: steps_after_resume(survivor.text()), "a step at world size 1", nodes, 30)
        joiner = Node("c", tmp_path, env)  # the ranks of a round follow the nodes' order: it may be rank 0 now
        nodes.append(joiner)
        t["together"] = wait_for(lambda: len(WORLD.findall(survivor.text())) >= 3, "the rendezvous with the new node",
                                 nodes, 60)
        both = lambda: RESUMED.findall(survivor.text()) + RESUMED.findall(joiner.text())  # noqa: E731
        t["resumed2"] = wait_for(lambda: len(both()) >= 2, "the resume at world size 2", nodes, 60)
        t["end"] = wait_for(lambda: all(n.proc.poll() is not None for n in (survivor, joiner)), "the end of the job",
                            nodes, 120)
    finally:
        for n in nodes:
            n.stop()
    out, logs = survivor.text(), "\n".join(f"--- {n.log_path.name}\n{n.text()[-3000:]}" for n in nodes)
    assert survivor.proc.returncode == 0 and joiner.proc.returncode == 0, logs
    assert [int(w) for w in WORLD.findall(out)] == [2, 1, 2] and [int(w) for w in WORLD.findall(joiner.text())] == [2]
    assert t["seen"] - t["kill"] < DIST_TIMEOUT, logs  # the survivor names the lost node within --dist-timeout
    (left, alone_note), (joined, together_note) = both()
    assert int(left) == saved and "global batch of 4 instead of 8" in alone_note, logs  # the last checkpoint
    alone = steps_after_resume(out)
    assert int(joined) == alone[-1] and "global batch of 8 instead of 4" in together_note, logs  # saved on SIGTERM
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == MAX_STEPS and metrics["world_size"] == 2, metrics
    assert "Traceback" not in out + joiner.text() and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in out, logs
    print(f"\nelastic: a node left after step {before} at world size 2; named {t['seen'] - t['kill']:.1f} s after "
          f"the kill; rendezvous alone {t['alone'] - t['seen']:.1f} s; resumed from step {left} "
          f"({before - int(left)} steps lost) {t['resumed'] - t['alone']:.1f} s later; trained steps "
          f"{alone[0]}-{alone[-1]} alone; a node joined {t['together'] - joiner.started:.1f} s after its start and the "
          f"job resumed {t['resumed2'] - t['together']:.1f} s later; job {t['end'] - nodes[0].started:.0f} s")


@pytest.mark.slow
def test_elastic_torchrun_sharing_one_store_warns_that_a_join_would_hang(tmp_path):
    """torchrun's default (one store for every round, which a joining node's agent waits on forever): rank 0 reads
    ``--nnodes 1:2`` from its agent's command line and says so, once. A real agent; the worker only starts its
    process group, where the warning is given."""
    probe = tmp_path / "probe.py"
    probe.write_text("from scale_ocr.distributed.process_group import destroy_distributed, init_distributed\n"
                     "init_distributed()\ndestroy_distributed()\n")
    cmd = [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{free_port()}", "--rdzv_id", "probe", "--rdzv_conf", "last_call_timeout=1",
           str(probe)]
    env = {k: v for k, v in _env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("scale-ocr: warning:")]
    assert done.returncode == 0 and len(lines) == 1, done.stderr[-3000:]
    assert "--nnodes 1:2" in lines[0] and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in lines[0], lines
