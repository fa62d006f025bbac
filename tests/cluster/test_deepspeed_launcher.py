"""DeepSpeed's multi-node launcher for real on this host: ``examples/deepspeed/launch.sh`` under pdsh (zero2) and
under Open MPI (ddp), 2 "nodes" x 1 rank, both host names resolving to 127.0.0.1.

A module fixture starts an sshd on a free loopback port with a host key and a client key made here (nothing under
/root/.ssh or /etc/ssh is read or written; sshd's privilege-separation folder /run/sshd is created when missing and
removed afterwards). An ``ssh`` first on PATH adds ``-F`` with this test's ssh_config, the way a user's
``~/.ssh/config`` names cluster nodes, so DeepSpeed's own ssh check, pdsh and mpirun all reach the nodes through it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, _env, read_metrics, run_cmd

from scale_ocr.distributed import process_group as d
from scale_ocr.distributed.process_group import free_port
from scale_ocr.errors import UserError

NODES = ("node1", "node2")
SBIN = "/usr/sbin:/usr/local/sbin:" + os.environ.get("PATH", "")


def _configs(root: Path, port: int) -> None:
    (root / "sshd_config").write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {root}/host_key\nAuthorizedKeysFile {root}/authorized_keys\n"
        f"PidFile {root}/sshd.pid\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PubkeyAuthentication yes\nPermitRootLogin prohibit-password\nUsePAM no\n"
        "StrictModes no\n")  # the keys sit under pytest's temp folder, whose parents sshd's strict mode would refuse
    (root / "ssh_config").write_text(
        f"Host {' '.join(NODES)}\n  HostName 127.0.0.1\n  Port {port}\n  IdentityFile {root}/client_key\n"
        f"  IdentitiesOnly yes\n  StrictHostKeyChecking yes\n  UserKnownHostsFile {root}/known_hosts\n"
        "  BatchMode yes\n  LogLevel ERROR\n")
    host_key = (root / "host_key.pub").read_text().split()[:2]
    (root / "known_hosts").write_text(f"[127.0.0.1]:{port} {' '.join(host_key)}\n")
    shutil.copy(root / "client_key.pub", root / "authorized_keys")
    (root / "bin").mkdir()
    (root / "bin" / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {root}/ssh_config "$@"\n')
    (root / "bin" / "ssh").chmod(0o755)
    (root / "hostfile").write_text("".join(f"{node} slots=1\n" for node in NODES))


def _wait_for_ssh(root: Path, env: dict[str, str], sshd: subprocess.Popen) -> None:
    deadline = time.time() + 15
    while True:
        probe = subprocess.run(["ssh", NODES[0], "true"], env=env, capture_output=True, text=True, timeout=15)
        if probe.returncode == 0:
            return
        if sshd.poll() is not None or time.time() > deadline:
            pytest.fail(f"the test's sshd did not accept a login: {probe.stderr.strip()} / "
                        f"{(root / 'sshd.log').read_text()[-800:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """An sshd on loopback; ``env`` reaches ``node1``/``node2`` through it, ``hostfile`` lists them."""
    tools = {t: shutil.which(t, path=SBIN) for t in ("sshd", "ssh", "ssh-keygen", "pdsh", "mpirun")}
    missing = [t for t, path in tools.items() if path is None]
    if missing or os.geteuid() != 0:
        pytest.skip(f"needs root and {', '.join(tools)} (`make engines` installs them); missing: {missing or 'root'}")
    root = tmp_path_factory.mktemp("ssh_nodes")
    root.chmod(0o700)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True)
    port = free_port()
    _configs(root, port)
    privsep = Path("/run/sshd")  # sshd refuses to start without it; the package's service would create it
    made = not privsep.exists()
    privsep.mkdir(mode=0o755, exist_ok=True)
    log = (root / "sshd.log").open("w")
    sshd = subprocess.Popen([tools["sshd"], "-D", "-e", "-f", str(root / "sshd_config")], stderr=log,
                            start_new_session=True)
    env = {**_env(), "PATH": f"{root / 'bin'}:{os.environ['PATH']}"}
    try:
        _wait_for_ssh(root, env, sshd)
        yield SimpleNamespace(root=root, env=env, hostfile=root / "hostfile", log=root / "sshd.log")
    finally:
        os.killpg(sshd.pid, signal.SIGTERM)
        sshd.wait(timeout=30)
        log.close()
        if made:
            shutil.rmtree(privsep, ignore_errors=True)


def _logins(nodes) -> int:
    return nodes.log.read_text().count("Accepted publickey")


def _launch(nodes, run_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``examples/deepspeed/launch.sh`` with its hostfile, as a user runs it. A .deepspeed_env (DS_ENV_FILE names it)
    carries WANDB_MODE to every rank: the runner exports nothing else of the sort, and a rank without it writes W&B
    files."""
    (nodes.root / "deepspeed_env").write_text("WANDB_MODE=disabled\n")
    env = {**nodes.env, "DS_ENV_FILE": str(nodes.root / "deepspeed_env"), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OUTPUT_DIR": str(run_dir), **env}
    proc = run_cmd(["bash", str(REPO / "examples" / "deepspeed" / "launch.sh"), *args], timeout=240, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert not (run_dir / "wandb").exists()
    return proc


@pytest.mark.slow
def test_pdsh_runs_a_two_node_zero2_job(nodes, tmp_path):
    run_dir, before = tmp_path / "run", _logins(nodes)
    proc = _launch(nodes, run_dir)
    out = proc.stdout + proc.stderr
    for rank, node in enumerate(NODES):  # pdsh prefixes each node's lines with its name
        assert f"{node}: " in out and f"nnodes=2, num_local_procs=1, node_rank={rank}" in out, out[-3000:]
    metrics = read_metrics(run_dir)
    assert (metrics["world_size"], metrics["launcher"], metrics["strategy"], metrics["steps"]) == (
        2, "deepspeed", "zero2", 2)
    assert _logins(nodes) - before >= 3  # DeepSpeed's ssh check, then pdsh to each node


@pytest.mark.slow
def test_openmpi_runs_a_two_node_job(nodes, tmp_path):
    """ddp keeps the test in its time budget: what is new here is the launcher (ranks from OMPI_COMM_WORLD_*,
    the rendezvous from -x MASTER_ADDR/PORT); zero2 on these ranks is the same engine the pdsh test runs."""
    run_dir, before = tmp_path / "run", _logins(nodes)
    _launch(nodes, run_dir, "--strategy", "ddp", LAUNCHER="openmpi", MPI_ARGS="--allow-run-as-root")
    metrics = read_metrics(run_dir)
    assert (metrics["world_size"], metrics["launcher"], metrics["strategy"], metrics["steps"]) == (2, "mpi", "ddp", 2)
    assert _logins(nodes) - before >= 3  # DeepSpeed's ssh check, then mpirun's orted on each node


OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}


def _mpi_env(monkeypatch, extra: dict[str, str]) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "CROSS_RANK", "LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.setenv(key, "")  # recorded, so whatever the code under test sets is undone
        monkeypatch.delenv(key)
    for key, value in {**OMPI, **extra}.items():
        monkeypatch.setenv(key, value)


def test_mpi_ranks_come_from_open_mpi(monkeypatch):
    _mpi_env(monkeypatch, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29511", "RANK": "0",  # -x RANK: no rank's own
                           "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})  # mpirun inside sbatch: the batch step's
    assert d.detect_launcher() == "mpi" and d.peek_launch() == (2, "mpi")
    assert d._read_env("mpi") == (1, 2, 0, 1)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("1", "2", "0")
    assert d.detect_launcher({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}) == "python"


def test_mpi_without_master_addr_is_one_line_naming_the_fix(monkeypatch):
    _mpi_env(monkeypatch, {"MASTER_PORT": "29511"})
    with pytest.raises(UserError, match="without MASTER_ADDR.*deepspeed_env.*-x MASTER_ADDR") as err:
        d._read_env("mpi")
    assert "\n" not in str(err.value) and os.environ["RANK"] == "1"  # exported first: rank 0 alone prints
