import pytest

from scale_ocr.distributed import process_group as d
from scale_ocr.errors import UserError


@pytest.mark.parametrize("env,launcher", [
    ({}, "python"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}, "torchrun"),
    ({"CROSS_RANK": "0", "LOCAL_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2"}, "deepspeed"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "env"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"}, "slurm"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "python"),  # a one-task allocation is a plain process
])
def test_detect_launcher(env, launcher):
    assert d.detect_launcher(env) == launcher


def test_slurm_env_uses_global_rank(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(k, "")  # recorded, so whatever the code under test sets is undone
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[03-04]")
    rank, world, local_rank, local_world = d._read_env("slurm")
    assert (rank, world, local_rank, local_world) == (5, 8, 1, 4)
    import os

    assert os.environ["MASTER_ADDR"] == "gpu03" and os.environ["RANK"] == "5"
    assert d.peek_launch() == (8, "slurm")


@pytest.mark.parametrize("nodes,first", [("node7", "node7"), ("gpu[03-05,09],cpu1", "gpu03"), ("a[1,2]", "a1")])
def test_slurm_first_host(nodes, first):
    assert d._slurm_first_host(nodes) == first


def test_single_process_group_round_trip():
    info = d.init_distributed()
    try:
        assert (info.rank, info.world_size, info.launcher, info.backend) == (0, 1, "python", "gloo")
        assert d.all_reduce_sum([1.0, 2.0], info.device) == [1.0, 2.0]
    finally:
        d.destroy_distributed()
    d.destroy_distributed()  # idempotent


def test_round_store_skips_the_dead_rounds_address(monkeypatch):
    """torchrun's agent store still holds the dead round's published address: rank 1 must wait for this
    round's rank 0 instead of connecting there, and both end up on one store with one round id."""
    import datetime
    import threading
    import time

    import torch.distributed as tdist

    from scale_ocr.distributed import round_store as rs

    agent = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    agent.set(rs.KEY, f"{d.free_port()} deadround")  # the previous round's rank 0, now gone
    got = {}
    peer = threading.Thread(target=lambda: got.update(one=rs.round_store(1, 2, timeout_s=10)))
    peer.start()
    time.sleep(1.0)  # rank 1 is reading the stale address meanwhile
    store0, id0 = rs.round_store(0, 2, timeout_s=10)
    peer.join(timeout=10)
    store1, id1 = got["one"]
    assert id0 == id1 != "deadround"
    store1.set("hello", "from rank 1")
    assert store0.get("hello") == b"from rank 1"


def test_rank_threads_honour_the_users_choice_but_not_torchruns_default(monkeypatch):
    """--threads wins, then an OMP_NUM_THREADS the user set; torchrun's own OMP_NUM_THREADS=1 (set when its
    environment had none, read back from the launcher's /proc environ) leaves the cores / local ranks default."""
    import os
    import subprocess
    import sys

    from scale_ocr.distributed.cores import usable_cores

    cores = usable_cores().usable  # affinity and cgroup quota, not the host's count
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert d.rank_threads(5, 2, "python") == (5, "--threads")
    assert d.rank_threads(None, 2, "python") == (3, "OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launchers = {}
    for name, env in (("chosen", {"OMP_NUM_THREADS": "1"}), ("default", {})):  # what a torchrun was started with
        launchers[name] = subprocess.Popen([sys.executable, "-c", "print(flush=True); import time; time.sleep(60)"],
                                           env=env, stdout=subprocess.PIPE)
        launchers[name].stdout.readline()  # exec'd: /proc/PID/environ is its own, no longer this process's copy
    try:
        monkeypatch.setattr(os, "getppid", lambda: launchers["chosen"].pid)
        assert d.rank_threads(None, 1, "torchrun") == (1, "OMP_NUM_THREADS")
        monkeypatch.setattr(os, "getppid", lambda: launchers["default"].pid)
        assert d.rank_threads(None, 1, "torchrun") == (cores, f"{cores} cores / 1 local ranks")
    finally:
        for proc in launchers.values():
            proc.kill()
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert d.rank_threads(None, 1, "python")[0] == cores


@pytest.mark.parametrize("procid,printed", [("1", False), ("0", True)])
def test_a_flag_mistake_under_srun_is_printed_by_rank_0_alone(monkeypatch, capsys, procid, printed):
    """srun starts every task of the job with the same command line: its mistake is one line, from rank 0."""
    from scale_ocr import train

    for k in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.setenv(k, "")  # recorded, so whatever the code under test sets is undone
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", procid)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("MASTER_PORT", str(d.free_port()))  # rank 0, which failed too, listens there for no one
    monkeypatch.setattr("scale_ocr.errors.RANK_ZERO_GRACE_S", 0.5)
    assert train.main(["--batch-size", "0", "--wandb-mode", "disabled"]) == 2
    err = capsys.readouterr().err
    assert ("--batch-size" in err) is printed, err


def test_a_rank_asks_whether_rank_0_is_at_the_rendezvous(monkeypatch):
    """Under srun a rank with a mistake of its own finds rank 0's store listening; one whose rank 0 failed too
    does not, and gives up after the grace."""
    import os
    import socket
    import time

    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with socket.socket() as rank_zero:
        rank_zero.bind(("127.0.0.1", 0))
        rank_zero.listen()
        monkeypatch.setenv("MASTER_PORT", str(rank_zero.getsockname()[1]))
        assert d.rendezvous_address("slurm") == ("localhost", os.environ["MASTER_PORT"])
        assert d.rank_zero_at_rendezvous("slurm")(0.0)
    t0 = time.monotonic()
    assert not d.rank_zero_at_rendezvous("slurm")(1.0)  # the port closed: rank 0 is not there
    assert 1.0 <= time.monotonic() - t0 < 5.0
    monkeypatch.delenv("MASTER_PORT")
    assert not d.rank_zero_at_rendezvous("env")(5.0)  # nowhere to ask: at once


def test_a_second_process_group_in_one_process_gets_fresh_deepspeed_groups():
    """DeepSpeed caches the groups it makes; the teardown drops them, so the next engine in this process (a second
    run through the Python API) does not meet a group of the destroyed world ("Group ... is not registered")."""
    import deepspeed
    from deepspeed.utils import groups

    for _ in range(2):
        d.init_distributed("gloo")
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, dist_init_required=False)
        assert groups._get_broadcast_src_rank() == 0  # through DeepSpeed's cached world group
        d.destroy_distributed()


LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID", "RAY_RAYLET_PID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
               "SLURM_NTASKS_PER_NODE", "SLURM_NNODES", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
               "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")


def clear_launch(monkeypatch):
    for k in LAUNCH_KEYS:
        monkeypatch.setenv(k, "")  # recorded, so whatever the code under test sets is undone
        monkeypatch.delenv(k)


@pytest.mark.parametrize("env,named", [
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, "SLURM_PROCID=3 is not below SLURM_NTASKS=2"),  # V01
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1 is not below WORLD_SIZE=1"),  # V04
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "two"}, "SLURM_NTASKS='two'"),  # V05
    ({"RANK": "0", "WORLD_SIZE": "2x"}, "WORLD_SIZE='2x'"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK=2"),
    ({"OMPI_COMM_WORLD_SIZE": "1e3"}, "OMPI_COMM_WORLD_SIZE='1e3'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "x"}, "SLURM_JOB_ID='x'"),
])
def test_a_launch_environment_that_lies_is_one_line(env, named):
    """V01/V04/V05: a rank outside its world, a size that is no number, is refused before any rendezvous, naming
    the variable and the launcher (not a hang, not a traceback)."""
    with pytest.raises(UserError, match="launch environment from") as caught:
        d.read_launch(env)
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_a_valid_launch_is_read_whole():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2(x2)"}
    assert d.read_launch(env) == d.Launch("slurm", 3, 4, 1, 2)
    assert d.read_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == d.Launch("env", 1, 2, 1, 2)
    assert d.read_launch({"RANK": "5", "MASTER_PORT": "in use"}) == d.Launch("python", 0, 1, 0, 1)  # not read


def test_the_refusal_is_printed_by_the_rank_that_reads_it(monkeypatch, capsys):
    """RANK=1 WORLD_SIZE=1: the report prints rank 0's lines alone, but this rank is the only one."""
    from scale_ocr import train

    clear_launch(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert train.main(["--wandb-mode", "disabled"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "RANK=1 is not below WORLD_SIZE=1" in err, err


def test_one_process_meets_on_its_own_port(monkeypatch):
    """V03: a plain-python job is one process; a MASTER_PORT left in the shell, in use, is not its port."""
    import os
    import socket

    clear_launch(monkeypatch)
    monkeypatch.setenv("RANK", "3")  # stale, without WORLD_SIZE: still one process, and rank 0 of it
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        monkeypatch.setenv("MASTER_PORT", str(other.getsockname()[1]))
        info = d.init_distributed()
        try:
            assert (info.rank, info.world_size, os.environ["RANK"]) == (0, 1, "0")
        finally:
            d.destroy_distributed()
        assert (os.environ["RANK"], os.environ["MASTER_PORT"]) == ("3", str(other.getsockname()[1]))
        assert "WORLD_SIZE" not in os.environ


def test_rank_zero_on_a_port_in_use_is_one_line(monkeypatch):
    """V03 with the ranks described by hand: rank 0 cannot host the rendezvous on MASTER_PORT."""
    import socket

    clear_launch(monkeypatch)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = str(other.getsockname()[1])
        for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", port)):
            monkeypatch.setenv(k, v)
        with pytest.raises(UserError, match=f"MASTER_PORT={port} .* is in use by another program"):
            d.init_distributed()


def test_auto_reads_the_checked_local_world_not_a_stale_variable(monkeypatch, tmp_path):
    """A plain-python job does not read LOCAL_WORLD_SIZE; --strategy auto must not trip over one left in the shell."""
    from scale_ocr.cli.args import parse_config
    from scale_ocr.planning.auto import resolve_auto

    clear_launch(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "abc")
    cfg = resolve_auto(parse_config(["--strategy", "auto", "--output-dir", str(tmp_path / "run")]), 1, "python")
    assert cfg.strategy.strategy != "auto"


KERNELS = """
import os, sys, torch
from scale_ocr.distributed.process_env import prepare_process
prepare_process()
print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], file=sys.stderr)
conv = torch.nn.Conv2d(16, 16, 3, padding=1)
with torch.no_grad():
    for width in (400, *range(401, 1000), 400):  # about 2,400 kernels with their reorders, then the first again
        conv(torch.zeros(1, 16, 4, width))
"""


@pytest.mark.parametrize("user, last", [(None, "cache_hit"), ("1024", "cache_miss")])
def test_onednn_keeps_the_kernels_of_many_shapes_unless_the_user_set_its_cache(user, last):
    """prepare_process, called before the first kernel, gives oneDNN room for an epoch's shapes: the first shape's
    convolution is still cached after 600 others (cache_hit in oneDNN's own log); the user's capacity is kept."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    env.update({"ONEDNN_VERBOSE": "profile_create", "OMP_NUM_THREADS": "1", **({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": user}
                                                                             if user else {})})
    out = subprocess.run([sys.executable, "-c", KERNELS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.split()[0] == (user or "16384")
    creates = [line for line in out.stdout.splitlines() if "create:" in line and ",convolution," in line]
    assert len(creates) >= 600 and f"create:{last}," in creates[-1]


def test_every_scale_ocr_command_prepares_its_process_first(monkeypatch):
    """The dispatcher sets the variables before it even reads the command (its jobs inherit them)."""
    import os

    from scale_ocr.cli.main import main
    from scale_ocr.distributed.kernel_cache import CAPACITY, VARIABLE

    monkeypatch.setenv(VARIABLE, "")  # recorded as unset before the test, so it is removed again after it
    monkeypatch.delenv(VARIABLE)
    assert main(["no-such-command"]) == 2
    assert os.environ[VARIABLE] == str(CAPACITY)
