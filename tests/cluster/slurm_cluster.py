"""A real SLURM cluster on this host for the tests: munged, slurmctld and two slurmd, started and stopped here.

Debian's slurm-wlm is built with multiple-slurmd support (``scontrol show config`` says ``MULTIPLE_SLURMD = Yes``),
so two node daemons run side by side, ``slurmd -N n1`` and ``slurmd -N n2``, each on its own port and spool
directory: a job of ``--nodes=2`` gets two nodes and one task on each, as on a cluster. Both nodes are this host
(``NodeAddr=127.0.0.1``), so the ranks meet over loopback.

Everything lives in one temporary directory (configuration, munge key and socket, state, spool, logs); the
daemons run in the foreground as children of the test process, and :meth:`SlurmCluster.stop` ends every job,
every daemon, and checks that no process of this cluster (a ``slurmstepd``, a rank) is left.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from scale_ocr.distributed.process_group import free_port

# program -> Debian package (``make engines`` installs them)
PROGRAMS = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "scontrol": "slurm-client",
            "sinfo": "slurm-client", "squeue": "slurm-client", "scancel": "slurm-client", "munged": "munge",
            "mungekey": "munge"}
NODES = ("n1", "n2")
CRED_EXPIRE = 7  # a requeued job may start again this + 1 s later (SLURM's default is 120; test_slurm.py says why 7)
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
_TIME_CHECK = "Testing job time limits"  # slurmctld's debug2 line each time it checks time limits (every 30 s)
_LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)\] (.*)$", re.M)


def missing_programs() -> str | None:
    """One line saying why this host cannot run the cluster (not installed, not root), or None."""
    missing = sorted({pkg for prog, pkg in PROGRAMS.items() if shutil.which(prog) is None})
    if missing:
        return (f"SLURM is not installed (missing Debian packages: {' '.join(missing)}; `make engines` installs "
                "slurm-wlm and munge, as CI does)")
    if os.geteuid() != 0:
        return "the SLURM tests start slurmd, which runs each job as its user: run them as root (CI does)"
    return None


def clean_env(base: dict[str, str]) -> dict[str, str]:
    """``base`` without the variables of any SLURM job the tests themselves may run in."""
    return {k: v for k, v in base.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}


class SlurmCluster:
    """Controller, munge and two node daemons in a temporary directory (see the module docstring)."""

    def __init__(self, cpus_per_node: int = 2) -> None:
        # Not under pytest's tmp_path: munged refuses a socket in a directory others cannot traverse, and
        # pytest's base directory is private (0700).
        self.dir = Path(tempfile.mkdtemp(prefix="scale_ocr_slurm."))
        self.dir.chmod(0o755)
        self.conf = self.dir / "slurm.conf"
        self.cpus = cpus_per_node
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = clean_env(dict(os.environ)) | {"SLURM_CONF": str(self.conf)}

    # -- start ------------------------------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> SlurmCluster:
        try:
            self._write_config()
            self._start_munge()
            self._spawn("slurmctld", ["slurmctld", "-D", "-c", "-f", str(self.conf)])
            for node in NODES:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            self._wait_idle(timeout)
        except BaseException:
            self.stop(check=False)
            raise
        return self

    def _write_config(self) -> None:
        host = socket.gethostname().split(".")[0]
        for sub in ("state", *(f"spool/{n}" for n in NODES)):
            (self.dir / sub).mkdir(parents=True)
        (self.dir / "plugstack.conf").write_text("")
        d = self.dir
        nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                          f"CPUs={self.cpus} State=UNKNOWN" for n in NODES)
        self.conf.write_text(f"""\
ClusterName=scaleocr
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.sock,cred_expire={CRED_EXPIRE}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=debug2
SlurmdDebug=info
PlugStackConfig={d}/plugstack.conf
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobRequeue=1
ReturnToService=2
FirstJobId={int.from_bytes(os.urandom(2), "big") + 1000}
KillWait=5
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")

    def _start_munge(self) -> None:
        key = self.dir / "munge.key"
        subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True, capture_output=True)
        self._spawn("munged", ["munged", "--foreground", f"--socket={self.dir}/munge.sock", f"--key-file={key}",
                               f"--pid-file={self.dir}/munged.pid", f"--log-file={self.dir}/munged.log",
                               f"--seed-file={self.dir}/munged.seed"])
        self._wait(lambda: (self.dir / "munge.sock").exists(), 10, "munged did not create its socket")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.dir / f"{name}.out", "w")  # noqa: SIM115 - the child holds it; closed with ours below
        self.procs[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        out.close()

    def _wait_idle(self, timeout: float) -> None:
        def idle() -> bool:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
            return out.count("idle") == len(NODES)
        self._wait(idle, timeout, "the SLURM nodes did not become idle")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [f"{name} exited with {p.returncode}" for name, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout:.0f} s ({'; '.join(dead) or 'still waiting'});\n"
                                   + self.logs())
            time.sleep(0.2)

    # -- use --------------------------------------------------------------------------------------------------
    def run(self, cmd: list[str], env: dict[str, str] | None = None, check: bool = True,
            **kw) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        env = clean_env(env if env is not None else self.env) | {"SLURM_CONF": str(self.conf)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(self, args: list[str], env: dict[str, str], cwd: Path) -> str:
        """``sbatch ARGS`` from ``cwd`` with ``env`` (what the job inherits); the job id."""
        return self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, NodeList, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Wait until the job ended (requeues included); its last fields."""
        deadline = time.monotonic() + timeout
        while (info := self.job(job_id))["JobState"] not in FINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info['JobState']} after {timeout:.0f} s;\n" + self.logs())
            time.sleep(0.5)
        return info

    def time_checks(self) -> list[float]:
        """When slurmctld checked time limits (and sent ``--signal`` warnings): epoch seconds, oldest first. It
        does so every 30 s from its start (``PERIODIC_TIMEOUT`` in slurmctld/controller.c); its start counts as
        the first."""
        found = []
        for stamp, line in _LOG_TIME.findall((self.dir / "slurmctld.log").read_text(errors="replace")):
            if line.startswith("Running as primary controller") or _TIME_CHECK in line:
                found.append(datetime.datetime.fromisoformat(stamp).timestamp())
        return found

    def after_time_check(self, within: float, timeout: float = 40.0) -> float:
        """Return at most ``within`` seconds after a time-limit check (waiting for the next one if needed): a job
        submitted now gets its ``--signal`` warning at a check whose place in the job is known. Seconds since it."""
        deadline = time.monotonic() + timeout
        while True:
            checks = self.time_checks()
            if checks and (since := time.time() - checks[-1]) <= within:
                return since
            if time.monotonic() > deadline:
                raise TimeoutError(f"slurmctld logged no time-limit check within {timeout:.0f} s;\n" + self.logs())
            time.sleep(0.1)

    def logs(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # -- stop -------------------------------------------------------------------------------------------------
    def stop(self, check: bool = True) -> None:
        """Cancel every job, stop the daemons (node daemons first) and check that nothing of this cluster runs."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--user", "root"], check=False)
            deadline = time.monotonic() + 20
            while self.run(["squeue", "-h"], check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.3)
        for name in [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        left = self._leftovers()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not left:
            shutil.rmtree(self.dir, ignore_errors=True)
        if check and left:
            raise AssertionError(f"processes of the SLURM cluster were left running (killed now): {left}; "
                                 f"logs kept in {self.dir}")

    def _leftovers(self, grace: float = 10.0) -> dict[int, str]:
        """Processes still running that belong to this cluster: its directory on their command line, or its
        SLURM_CONF in their environment (slurmstepd and the job's tasks inherit it)."""
        deadline = time.monotonic() + grace
        while True:
            found = {}
            marker, conf = str(self.dir).encode(), f"SLURM_CONF={self.conf}".encode()
            for proc in Path("/proc").glob("[0-9]*"):
                try:
                    cmd = (proc / "cmdline").read_bytes()
                    if int(proc.name) == os.getpid() or not cmd:
                        continue
                    if marker in cmd or conf in (proc / "environ").read_bytes().split(b"\0"):
                        found[int(proc.name)] = cmd.replace(b"\0", b" ").decode(errors="replace").strip()
                except (OSError, ValueError):
                    continue
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.3)
