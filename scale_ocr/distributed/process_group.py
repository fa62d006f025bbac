"""Process-group set-up for every launcher: torchrun, the deepspeed launcher, SLURM, plain python."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from scale_ocr.distributed.cores import usable_cores, warn_if_oversubscribed
from scale_ocr.distributed.launch_env import LAUNCHER_NAMES, Launch, detect_launcher, read_launch
from scale_ocr.distributed.round_store import round_store, uses_agent_store, warn_if_joins_would_hang
from scale_ocr.errors import UserError

__all__ = ["DistInfo", "Launch", "detect_launcher", "init_distributed", "peek_launch", "read_launch"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job. ``rank`` is global: use it for sampling and rank-0 duties."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str
    round_id: str = ""  # unique to this launch round under torchrun's elastic agent (see round_store)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_ENV_SET: dict[str, str | None] = {}  # variables init_distributed set for a plain-python job: their old values


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a rendezvous started right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Launchers that end every rank as soon as one exits with an error (srun, by default, waits for each to exit).
ENDS_THE_REST_ON_FAILURE = frozenset({"torchrun", "deepspeed", "mpi"})


def ends_the_rest_on_failure(launcher: str) -> bool:
    """Whether ``launcher`` (a :func:`detect_launcher` name) ends the other ranks once one exits with an error."""
    return launcher in ENDS_THE_REST_ON_FAILURE


def rendezvous_address(launcher: str, env: dict[str, str] | os._Environ = os.environ) -> tuple[str | None, str | None]:
    """``(MASTER_ADDR, MASTER_PORT)``, where rank 0's store listens: the environment's, and under srun, which sets
    neither, the job's first host and a port from its job id."""
    if launcher != "slurm":
        return env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    host = env.get("MASTER_ADDR", _slurm_first_host(env.get("SLURM_JOB_NODELIST", "127.0.0.1")))
    job = env.get("SLURM_JOB_ID", "0")  # read_launch refused a job id that is not a number
    return host, env.get("MASTER_PORT", str(29500 + int(job) % 1000 if job.isdigit() else 29500))


def rank_zero_at_rendezvous(launcher: str) -> Callable[[float], bool]:
    """For a rank that found a mistake before the ranks meet, under a launcher that leaves each rank to exit by
    itself: whether rank 0's store accepts a connection at :func:`rendezvous_address` within the seconds given,
    that is, whether rank 0 passed the checks this rank failed (see :func:`scale_ocr.errors.found_by_every_rank`)."""
    def waiting(within_s: float) -> bool:
        host, port = rendezvous_address(launcher)
        if not host or not (port or "").isdigit():
            return False
        deadline = time.monotonic() + within_s
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=1.0):
                    return True
            except OSError:  # not listening (yet), or no such host
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.5)

    return waiting


def _read_env(launcher: str) -> tuple[int, int, int, int]:
    """Rank, world size, local rank and local world size, checked (:func:`read_launch`); under srun and mpirun also
    exported the way torch's ``env://`` rendezvous and the other readers expect them."""
    env = os.environ
    launch = read_launch(env)
    ranks = launch.rank, launch.world_size, launch.local_rank, launch.local_world_size
    if launcher == "slurm":
        host, port = rendezvous_address(launcher, env)  # torch's env:// rendezvous reads these; srun sets neither
        env.setdefault("MASTER_ADDR", host)
        env.setdefault("MASTER_PORT", port)
        for key, value in zip(("RANK", "WORLD_SIZE", "LOCAL_RANK"), ranks, strict=False):
            env.setdefault(key, str(value))
    elif launcher == "mpi":
        _export_mpi_ranks(env, ranks)
        _check_mpi_address(env, ranks)
    return ranks


def _export_mpi_ranks(env: dict[str, str] | os._Environ, ranks: tuple[int, int, int, int]) -> None:
    """Open MPI's ``OMPI_COMM_WORLD_*`` ranks, also exported as ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
    ``LOCAL_WORLD_SIZE`` for every reader that knows only those (torch's ``env://``, DeepSpeed's engine, the one-line
    error report, which prints on rank 0 alone). They overwrite any value passed with ``mpirun -x``: a value every
    rank received alike is no rank's own."""
    for key, value in zip(("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), ranks, strict=True):
        env[key] = str(value)


def _check_mpi_address(env: dict[str, str] | os._Environ, ranks: tuple[int, int, int, int]) -> None:
    """Ranks under ``mpirun`` without mpi4py: the rendezvous address comes from ``MASTER_ADDR``/``MASTER_PORT``,
    which DeepSpeed's ``--launcher openmpi`` does not pass on (it drops ``--master_addr``), so the user exports them."""
    missing = [key for key in ("MASTER_ADDR", "MASTER_PORT") if not env.get(key, "").strip()]
    if missing:
        raise UserError(
            f"mpirun started rank {ranks[0]} of {ranks[1]} without {' and '.join(missing)}, where the ranks meet; "
            "add MASTER_ADDR=<rank 0's host> and MASTER_PORT=<a free port> to .deepspeed_env (deepspeed --launcher "
            "openmpi passes its lines to every rank; its --master_addr is not passed), or pass them with mpirun's "
            "-x (deepspeed --launcher_args '-x MASTER_ADDR=HOST -x MASTER_PORT=PORT')")


def _slurm_first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, as ``scontrol show hostnames`` lists it first: ``gpu[03-05,09],cpu1``
    -> ``gpu03``, ``rack[1-2]-node[01-04]`` -> ``rack1-node01``."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])*", nodelist).group(0)  # up to the first comma outside brackets
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], first)


def peek_launch() -> tuple[int, str]:
    """World size and launcher from the environment, checked whole (:func:`read_launch`: a rank outside the world,
    a size that is not a number, is one line now, not a hang at the rendezvous), without starting anything.

    Under srun and mpirun the rank is also exported as ``RANK``/``WORLD_SIZE`` here, before the command line is read,
    so a mistake found before the rendezvous is printed by rank 0 alone (the one-line report reads ``RANK``), not once
    per rank as every task of the job starts."""
    launch = read_launch()
    if launch.launcher == "slurm":
        os.environ.setdefault("RANK", str(launch.rank))  # as _read_env: what srun's user exported wins
        os.environ.setdefault("WORLD_SIZE", str(launch.world_size))
    elif launch.launcher == "mpi":  # exported now, so an error before the rendezvous is printed by rank 0 alone
        _export_mpi_ranks(os.environ, (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size))
    return launch.world_size, launch.launcher


def _torchrun_default_threads(launcher: str) -> bool:
    """Whether ``OMP_NUM_THREADS`` is torchrun's own default rather than the user's: torchrun sets it to 1 for its
    workers when its environment lacks it, so its initial environment (the parent's ``/proc/PID/environ``) tells."""
    if launcher != "torchrun" or os.environ.get("OMP_NUM_THREADS") != "1":
        return False
    try:
        parent = Path(f"/proc/{os.getppid()}/environ").read_bytes().split(b"\0")
    except OSError:
        return True  # cannot tell (no procfs): torchrun's 1 is far more often its default than a choice
    return not any(entry.startswith(b"OMP_NUM_THREADS=") for entry in parent)


def rank_threads(requested: int | None, local_world: int, launcher: str) -> tuple[int, str]:
    """Intra-op threads for a CPU rank and where the number came from: ``--threads``, else an ``OMP_NUM_THREADS``
    the user set, else the cores this job may use (affinity and cgroup quota: :mod:`~scale_ocr.distributed.cores`)
    divided by its local ranks (oversubscribed threads slow every rank)."""
    if requested:
        return requested, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0 and not _torchrun_default_threads(launcher):
        return int(env), "OMP_NUM_THREADS"
    cores = usable_cores().usable
    return max(1, cores // local_world), f"{cores} cores / {local_world} local ranks"


def init_distributed(backend: str | None = None, timeout_s: float = 300.0, threads: int | None = None) -> DistInfo:
    """Read the launcher's environment, pick device and backend, and start the process group.

    A process group is started even for a single plain-python process (on a free loopback port) so
    that every strategy, DeepSpeed and FSDP included, runs unchanged at world size 1. The backend's own timeout is a
    minute longer than ``timeout_s`` (``--dist-timeout``), so the :mod:`~scale_ocr.run.watchdog`, which names the
    silent rank, speaks first.
    """
    launcher = detect_launcher()
    rank, world, local_rank, local_world = _read_env(launcher)
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise UserError("--backend nccl needs CUDA GPUs, and none is visible; drop --backend to use gloo on CPU")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"local rank {local_rank} has no GPU (only {torch.cuda.device_count()} visible); "
                "start at most one process per GPU"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        count, source = rank_threads(threads, local_world, launcher)
        torch.set_num_threads(count)
        if rank == 0:  # one line per job: the user's count is honoured, and its cost said
            warn_if_oversubscribed(count, source, local_world)
    backend = backend or ("nccl" if use_cuda else "gloo")
    round_id = ""
    if launcher == "torchrun" and rank == 0:
        warn_if_joins_would_hang()  # torch's own agents would hang, silently, when a node joins
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s + 60)
        if launcher == "python":
            _describe_one_process()
        if world > 1 and uses_agent_store():
            store, round_id = round_store(rank, world, timeout_s)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            with _port_in_use_is_one_line(launcher, rank):
                dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    return DistInfo(rank, world, local_rank, local_world, device, backend, launcher, round_id)


def _describe_one_process() -> None:
    """A plain-python job is one process: it is described the way launchers describe one (DeepSpeed reads
    LOCAL_RANK; the one-line report reads RANK), whatever the shell still holds from another job, and its rendezvous
    is a free loopback port of its own: a ``MASTER_PORT`` left in the shell, perhaps in use, is not needed by a job
    that meets no one. The old values come back on teardown."""
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port()))):
        if os.environ.get(key) != value:
            _ENV_SET.setdefault(key, os.environ.get(key))
            os.environ[key] = value


@contextlib.contextmanager
def _port_in_use_is_one_line(launcher: str, rank: int) -> Iterator[None]:
    """Rank 0 hosts the ranks' meeting point (torch's TCPStore) on ``MASTER_PORT``: a port another program holds
    is one line naming it, not torch's traceback."""
    try:
        yield
    except RuntimeError as exc:  # torch's DistNetworkError
        text = str(exc)
        if rank != 0 or not ("EADDRINUSE" in text or "address already in use" in text.lower()):
            raise
        port = os.environ.get("MASTER_PORT", "")
        raise UserError(f"MASTER_PORT={port} (from {LAUNCHER_NAMES.get(launcher, launcher)}) is in use by another "
                        "program (a job still running, or one that did not exit), so rank 0 cannot host the ranks' "
                        f"rendezvous there; give every rank another free port, e.g. MASTER_PORT={free_port()}"
                        ) from None


def destroy_distributed(clean: bool = True) -> None:
    """Tear the process group down (safe to call twice or when none was started); ``clean``: the job ended normally,
    so wait for every rank first (after an error, peers may be stuck in a collective this rank will never join)."""
    if dist.is_available() and dist.is_initialized():
        # Engines keep async work handles (fairscale's OSS broadcasts, for one) in reference cycles;
        # freed at interpreter exit after the group is gone, gloo can abort the process. Free them now.
        gc.collect()
        if clean:
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a peer that already failed must not hide our own error
                pass
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        if ds_comm is not None and ds_comm.cdb is not None:
            # DeepSpeed caches the groups it made (its world clone, ZeRO's) at module level and drops them only in
            # its own teardown; left behind, the next engine in this process (a second run through the Python API)
            # would use groups of the destroyed world and fail with "Group ... is not registered".
            ds_comm.destroy_process_group()
        else:
            dist.destroy_process_group()
    while _ENV_SET:
        key, old = _ENV_SET.popitem()
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum floats over ranks (identity when no process group is running)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_max(value: float, device: torch.device) -> float:
    """Max of one float over ranks."""
    return all_reduce_maxes([value], device)[0]


def all_reduce_maxes(values: list[float], device: torch.device) -> list[float]:
    """Each float's max over ranks (identity when no process group is running)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
