"""The launcher's environment, read and checked whole before anything starts: which launcher, and this process's
rank, world size, local rank and local world size, each an integer in range, or one line naming the variable.

A stale variable from the shell (``SLURM_PROCID=3`` beside ``SLURM_NTASKS=2``, ``RANK=1`` beside ``WORLD_SIZE=1``,
``WORLD_SIZE=2x``) would otherwise hang at the rendezvous, waiting for ranks that never come, or end in a traceback.
Nothing here connects anywhere or changes the environment.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from scale_ocr.errors import UserError, shown

Env = dict[str, str] | os._Environ

MAX_RANKS = 1 << 24  # more ranks than any job has had: a bigger value is a typo or garbage
_WHOLE = re.compile(r"\s*\+?[0-9]{1,9}\s*")  # ASCII digits only: int() would also take '1_0' and '٣'

# Who set the variables, as the error names it.
LAUNCHER_NAMES = {
    "torchrun": "torchrun", "deepspeed": "the deepspeed launcher", "ray": "Ray Train", "mpi": "mpirun (Open MPI)",
    "slurm": "srun (SLURM)", "env": "the shell, no launcher", "python": "plain python, no launcher",
}
_FIX = {
    "slurm": "srun sets these for each task: unset SLURM_* variables left in the shell from another job, or start "
             "the tasks with srun",
    "mpi": "mpirun sets these for each rank: unset OMPI_COMM_WORLD_* variables left in the shell, or start with mpirun",
    "env": "give each process its own RANK from 0 to WORLD_SIZE-1, or unset RANK and WORLD_SIZE to run one process",
}
_FIX_DEFAULT = "the launcher sets these: unset any left in the shell from another job and start again"


def launch_error(launcher: str, what: str) -> UserError:
    """The one line for a launch environment that cannot be right, printed by every process that reads it (the
    rank it names may be the wrong one, so no rank is trusted to speak for the rest)."""
    exc = UserError(f"launch environment from {LAUNCHER_NAMES.get(launcher, launcher)}: {what}; "
                    f"{_FIX.get(launcher, _FIX_DEFAULT)}")
    exc.by_this_rank = True
    return exc


def env_int(env: Env, key: str, default: int | None, launcher: str) -> int:
    """``env[key]`` as a whole number 0 <= n <= :data:`MAX_RANKS` (``default`` when unset), else one line."""
    text = env.get(key)
    if text is None:
        if default is None:
            raise launch_error(launcher, f"{key} is not set")
        return default
    if not _WHOLE.fullmatch(text) or int(text) > MAX_RANKS:
        raise launch_error(launcher, f"{key}={shown(text)} is not a whole number from 0 to {MAX_RANKS}")
    return int(text)


def detect_launcher(env: Env = os.environ) -> str:
    """Name the launcher that started this process: torchrun, deepspeed, ray, mpi, slurm, env or python."""
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "CROSS_RANK" in env or "LOCAL_SIZE" in env:  # set by deepspeed's launch.py
        return "deepspeed"
    if "RAY_RAYLET_PID" in env and "RANK" in env:  # a Ray Train worker: Ray set RANK and started the group
        return "ray"
    # Open MPI's mpirun (also DeepSpeed's --launcher openmpi). Before SLURM: an mpirun inside an sbatch script
    # hands every rank the batch step's SLURM_PROCID=0, while OMPI_COMM_WORLD_RANK is each rank's own.
    if env_int(env, "OMPI_COMM_WORLD_SIZE", 1, "mpi") > 1:
        return "mpi"
    if "SLURM_PROCID" in env and env_int(env, "SLURM_NTASKS", 1, "slurm") > 1:
        return "slurm"
    if "RANK" in env and "WORLD_SIZE" in env:
        return "env"
    return "python"


@dataclass(frozen=True)
class Launch:
    """This process's place in the job, as its launcher described it, every number checked."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _slurm_local_world(env: Env, world: int) -> int:
    """Tasks on this node: ``SLURM_NTASKS_PER_NODE`` (``4`` or ``4(x2)``), else the tasks shared by the nodes; never
    more than the tasks of the job (a node may be given fewer than --ntasks-per-node)."""
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    if per_node is not None:
        first = re.match(r"\s*([0-9]{1,9})", per_node)
        if not first:
            raise launch_error("slurm", f"SLURM_NTASKS_PER_NODE={shown(per_node)} is not a number of tasks")
        count = int(first.group(1))
    else:
        count = world // max(1, env_int(env, "SLURM_NNODES", 1, "slurm"))
    return min(world, max(1, count))


def _numbers(launcher: str, env: Env) -> tuple[tuple[int, str], tuple[int, str], tuple[int, str], tuple[int, str]]:
    """(value, variable) for the rank, world size, local rank and local world size ``launcher`` sets; the local
    world's variable is "" where it is derived, not given (srun without --ntasks-per-node)."""
    def get(key: str, default: int | None = None) -> tuple[int, str]:
        return env_int(env, key, default, launcher), key

    if launcher == "python":
        return (0, ""), (1, ""), (0, ""), (1, "")
    if launcher == "slurm":
        world = get("SLURM_NTASKS")
        local_world = (_slurm_local_world(env, world[0]), "")
        return get("SLURM_PROCID"), world, get("SLURM_LOCALID", 0), local_world
    if launcher == "mpi":
        return (get("OMPI_COMM_WORLD_RANK"), get("OMPI_COMM_WORLD_SIZE"), get("OMPI_COMM_WORLD_LOCAL_RANK", 0),
                get("OMPI_COMM_WORLD_LOCAL_SIZE", 1))
    world = get("WORLD_SIZE")
    local_key = "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in env else "LOCAL_SIZE" if "LOCAL_SIZE" in env else ""
    local_world = get(local_key) if local_key else (world[0], "")
    return get("RANK"), world, get("LOCAL_RANK", 0), local_world


def read_launch(env: Env = os.environ) -> Launch:
    """The launch ``env`` describes, checked whole: every rank and size a whole number, the world at least one rank,
    ``0 <= rank < world size``, ``local rank < local world size <= world size``; else one line naming the variables
    and the launcher (exit 2). Read only: nothing is connected to or set."""
    launcher = detect_launcher(env)
    (rank, rank_key), (world, world_key), (local, local_key), (local_world, local_world_key) = _numbers(launcher, env)
    if world < 1:
        raise launch_error(launcher, f"{world_key}={world}: a job needs at least one rank")
    if rank >= world:
        raise launch_error(launcher, f"{rank_key}={rank} is not below {world_key}={world}: ranks run from 0 to "
                                     f"{world - 1}, so this rank would wait for a rank that never comes")
    if local_world_key and not 1 <= local_world <= world:
        raise launch_error(launcher, f"{local_world_key}={local_world} is not from 1 to {world_key}={world}")
    if local_world_key and local >= local_world:
        raise launch_error(launcher, f"{local_key}={local} is not below {local_world_key}={local_world}")
    if local >= world:
        raise launch_error(launcher, f"{local_key}={local} is not below {world_key}={world}")
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS")  # read when a peer is lost, to say whether torchrun restarts
    if restarts is not None and not re.fullmatch(r"\s*[+-]?[0-9]{1,9}\s*", restarts):
        raise launch_error(launcher, f"TORCHELASTIC_MAX_RESTARTS={shown(restarts)} is not a number of restarts")
    if launcher != "python":  # a plain-python job picks its own port (init_distributed): the shell's is not read
        master_port(env, launcher)
        if launcher == "slurm" and "MASTER_PORT" not in env and not re.fullmatch(r"[0-9]{1,12}",
                                                                                 env.get("SLURM_JOB_ID", "0")):
            raise launch_error(launcher, f"SLURM_JOB_ID={shown(env['SLURM_JOB_ID'])} is not a job number, and the "
                                         "ranks' port is derived from it when MASTER_PORT is unset")
    return Launch(launcher, rank, world, local, local_world)


def master_port(env: Env, launcher: str, key: str = "MASTER_PORT") -> int | None:
    """``MASTER_PORT`` as a TCP port from 1 to 65535, None when unset; else one line."""
    text = env.get(key)
    if text is None:
        return None
    if not _WHOLE.fullmatch(text) or not 1 <= int(text) <= 65535:
        raise launch_error(launcher, f"{key}={shown(text)} is not a TCP port from 1 to 65535")
    return int(text)
