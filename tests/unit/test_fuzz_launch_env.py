"""Property-based fuzzing of the launcher's environment (docs/faults.md, "Fuzzing"; the probe's V01-V06).

Any values for the variables torchrun, the deepspeed launcher, srun, mpirun and Ray set (ranks, sizes, ports, a
node list) and for the W&B variables scale_ocr reads, in any combination: :func:`read_launch` returns a launch
whose numbers are in range (0 <= rank < world size, local rank < local world size <= world size), and the
start-up built on it (``peek_launch``, ``_read_env``, the rendezvous address, ``wandb_env``) takes it; or one
UserError line. Never another exception, and nothing connects anywhere. In-process, the environment patched.
"""

from __future__ import annotations

import os
import socket
from unittest import mock

from conftest import SURFACE_EXAMPLES
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_fuzz_oracle import outcome

from scale_ocr.distributed import process_group as d
from scale_ocr.tracking.wandb_logger import wandb_env

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "RAY_RAYLET_PID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "WANDB_INIT_TIMEOUT",
        "WANDB_MODE", "WANDB_DISABLED", "TORCHELASTIC_MAX_RESTARTS")
# What an environment can hold: no NUL, no lone surrogate (os.environ refuses both).
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
VALUES = st.one_of(
    st.integers(-2, 9).map(str), st.integers().map(str), st.integers(65530, 70000).map(str),
    st.floats().map(str), st.sampled_from(["", " 3", "+2", "3\n", "٣", "1_0", "0x10", "2x", "two", "nan", "1e3",
                                           "4(x2)", "2,1", "gpu[03-05,09]", "[", "offline", "disabled", "true",
                                           "\x1b[2J", "9" * 40, "-0"]),
    TEXT,
)
ENVS = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=10)


def _no_connection(*args, **kwargs):
    raise AssertionError("the launch environment's check connected somewhere")


def _start_up(env: dict[str, str]) -> None:
    launch = d.read_launch(env)
    assert 1 <= launch.world_size and 0 <= launch.rank < launch.world_size
    assert 0 <= launch.local_rank < launch.world_size and 1 <= launch.local_world_size <= launch.world_size
    assert d.peek_launch() == (launch.world_size, launch.launcher)
    assert d._read_env(launch.launcher) == (launch.rank, launch.world_size, launch.local_rank,
                                            launch.local_world_size)
    int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))  # as the line for a lost peer reads it
    host, port = d.rendezvous_address(launch.launcher)
    if launch.launcher == "slurm":
        assert host is not None and port is not None and 1 <= int(port) <= 65535


@settings(max_examples=SURFACE_EXAMPLES)
@given(ENVS)
@example({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"})  # V01
@example({"RANK": "1", "WORLD_SIZE": "1"})  # V04
@example({"SLURM_PROCID": "0", "SLURM_NTASKS": "two"})  # V05
@example({"RANK": "0", "WORLD_SIZE": "2x"})
@example({"RANK": "0", "WORLD_SIZE": "0"})
@example({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "123"})
def test_launch_environment_is_a_valid_launch_or_one_line(env):
    with mock.patch.dict(os.environ, env, clear=True), mock.patch.object(socket.socket, "connect", _no_connection):
        outcome(_start_up, env)


@settings(max_examples=SURFACE_EXAMPLES)
@given(ENVS, st.sampled_from(["auto", "online", "offline", "disabled"]))
@example({"WANDB_INIT_TIMEOUT": "abc"}, "offline")  # V06
def test_wandb_variables_are_a_mode_and_a_timeout_or_one_line(env, flag):
    with mock.patch.dict(os.environ, {**env, "HOME": "/nonexistent"}, clear=True):
        result, _ = outcome(wandb_env, flag, env)
    if result is not None:
        mode, timeout = result
        assert mode in ("online", "offline", "disabled", "shared") and 0 < timeout <= 24 * 3600
