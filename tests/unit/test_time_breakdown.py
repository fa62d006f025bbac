"""The time breakdown (run/breakdown.py, run/profiling.py), the oversubscription line (distributed/cores.py) and the
peak-memory breakdown (memory/meter.py), on hand-made profiles and tiny modules: no process group needed."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scale_ocr.distributed.cores import Cores, cgroup_quota, oversubscription
from scale_ocr.memory.meter import ActivationProbe, peak_breakdown
from scale_ocr.run.breakdown import PHASES, RANGE_PREFIX, StepClock, compact, split_exposed
from scale_ocr.run.profiling import exposed_comm

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
MAIN, GLOO = 1, 2


def ev(name: str, start: float, end: float, thread: int = MAIN, device=CPU):
    return SimpleNamespace(name=name, thread=thread, device_type=device,
                           time_range=SimpleNamespace(start=start, end=end))


def test_exposed_communication_on_gloo_is_what_no_compute_hides():
    """One step of 100 us: data 0-10, compute 10-70, optimizer 70-90, other 90-100. DDP's bucket all-reduce runs on
    gloo's thread from 40 to 80: backward computes until 60, so 60-70 is exposed in compute and 70-75 in the
    optimizer (its first op starts at 75); the gloo thread's own copy (aten::copy_) is not compute. The per-step
    agreement is synchronous: c10d::allreduce_ on the calling thread 92-94 (an operator nested in it serves the
    collective) plus gloo's 94-98, exposed whole."""
    events = [ev(RANGE_PREFIX + p, a, b) for p, a, b in (("data", 0, 10), ("compute", 10, 70),
                                                           ("optimizer", 70, 90), ("other", 90, 100))]
    events += [ev("aten::convolution", 10, 40), ev("aten::mm", 40, 60), ev("aten::add_", 75, 90),
               ev("gloo:all_reduce", 40, 80, GLOO), ev("aten::copy_", 41, 79, GLOO),
               ev("c10d::allreduce_", 92, 94), ev("record_param_comms", 92.1, 92.3), ev("aten::empty", 92.5, 93),
               ev("gloo:all_reduce", 94, 98, GLOO)]
    got = exposed_comm(events, on_gpu=False, steps=1)
    assert got["phase_share"] == pytest.approx({"data": 0.0, "compute": 10 / 60, "optimizer": 5 / 20, "other": 0.6})
    assert got["exposed_share"] == pytest.approx((10 + 5 + 6) / 100)
    assert got["in_flight_share"] == pytest.approx((40 + 6) / 100)


def test_exposed_communication_on_a_gpu_is_read_from_the_device_timeline():
    """NCCL kernels against compute kernels; host-side ranges (launches) are not the device's work."""
    events = [ev(RANGE_PREFIX + "compute", 0, 100), ev("aten::mm", 0, 100),
              ev("sm90_gemm", 0, 50, 7, CUDA), ev("ncclDevKernel_AllReduce", 30, 80, 8, CUDA)]
    got = exposed_comm(events, on_gpu=True, steps=1)
    assert got["exposed_share"] == pytest.approx(0.3) and got["in_flight_share"] == pytest.approx(0.5)
    assert exposed_comm([ev("aten::mm", 0, 1)], on_gpu=False, steps=1) is None  # no loop phases profiled


def test_phases_tile_the_step_and_exposed_communication_moves_out_of_them():
    clock = StepClock(torch.device("cpu"))
    for timed in (False, True, True):
        clock.begin(timed)
        for micro in range(2):
            clock.lap("data")
            clock.forward_done()  # on a GPU, the forward's device time; on CPU, the thread's time over the compute
            sum(i * i for i in range(20000))  # compute the thread spends CPU time on: the step's work
            time.sleep(0.03)  # a wait, as in a collective for a slower rank: compute's wall time, none of its work
            clock.lap("compute", then="optimizer" if micro else "data")
        clock.lap("optimizer")
        clock.end_step()
    totals, steps = clock.timed_totals()
    assert steps == 2 and set(totals) == set(PHASES) and all(v >= 0 for v in totals.values())
    assert sorted(clock.work) == [0, 1] and 0 < sum(clock.work.values()) < totals["compute"] - 0.1  # 4 waits of 30 ms
    parts = split_exposed({"data": 1.0, "compute": 6.0, "optimizer": 2.0, "other": 1.0},
                          {"data": 0.0, "compute": 0.5, "optimizer": 0.25, "other": 0.0})
    assert parts == {"data": 1.0, "compute": 3.0, "optimizer": 1.5, "other": 1.0, "exposed_comm": 3.5}
    assert sum(parts.values()) == 10.0  # the parts still add up to the step
    assert compact({**parts, "sum_seconds": 10.0}) == "compute 30% comm 35% data 10% opt 15% other 10%"
    assert compact({**parts, "sum_seconds": 10.0, "straggler_share": 0.021}).endswith("other 10%; straggler 2.1%")
    assert split_exposed(totals, None)["exposed_comm"] is None


def test_oversubscription_is_one_line_with_the_numbers_and_the_fix():
    line = oversubscription(2, "OMP_NUM_THREADS", 2, Cores(affinity=2, quota=None))
    assert line == ("scale-ocr: warning: OMP_NUM_THREADS=2 x 2 local ranks = 4 threads on 2 usable cores (affinity 2, "
                    "cgroup quota none): threads wait for each other at every operator, and steps can run many times "
                    "slower (20x measured at 2 x 2 on 2 cores); export OMP_NUM_THREADS=1 or pass --threads 1")
    assert oversubscription(1, "OMP_NUM_THREADS", 2, Cores(2, None)) is None
    assert oversubscription(4, "--threads", 2, Cores(64, 4.0)).endswith("pass --threads 2")  # the quota binds
    assert "start at most 2 local ranks" in oversubscription(1, "2 cores / 4 local ranks", 4, Cores(8, 1.5))
    assert Cores(8, 1.5).usable == 2 and Cores(8, None).usable == 8 and Cores(1, 0.2).usable == 1


def test_cgroup_quota_is_the_tightest_on_the_path(tmp_path: Path):
    """v1: the parent's 1.5 cores bind a child with none; v2: cpu.max "max" is no limit, "50000 100000" half a core."""
    for rel, quota in (("cpu/job", "150000"), ("cpu/job/step", "-1")):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "cpu.cfs_quota_us").write_text(quota)
        (tmp_path / rel / "cpu.cfs_period_us").write_text("100000")
    (tmp_path / "v2" / "pod").mkdir(parents=True)
    (tmp_path / "v2" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "v2" / "pod" / "cpu.max").write_text("50000 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("3:cpu,cpuacct:/job/step\n")
    (tmp_path / "cpu,cpuacct").symlink_to(tmp_path / "cpu")
    assert cgroup_quota(tmp_path, proc) == 1.5
    proc.write_text("0::/pod\n")
    assert cgroup_quota(tmp_path / "v2", proc) == 0.5
    proc.write_text("0::/\n")
    assert cgroup_quota(tmp_path / "v2", proc) is None
    assert cgroup_quota(tmp_path, tmp_path / "missing") is None


def test_activations_are_the_tensors_saved_for_backward_less_the_parameters():
    """Linear(256, 64) then ReLU at batch 8: backward keeps the input (8x256 fp32) and the ReLU output (8x64 fp32);
    the weight it also saves is a parameter, counted by the meter, not here. Measured once."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.ReLU())
    probe = ActivationProbe()
    for _ in range(2):
        with probe.watch(model):
            model(torch.randn(8, 256)).sum().backward()
    assert probe.bytes == 8 * 256 * 4 + 8 * 64 * 4
    got = peak_breakdown(torch.device("cpu"), None, 1 << 20, probe.bytes)
    assert got["peak_rss"] == got["runtime"] + got["activations"] + got["heap"] and got["model_state"] is None


def test_rank_0_says_it_once_when_a_job_starts_oversubscribed(monkeypatch, capsys):
    """The user's OMP_NUM_THREADS is honoured (torch runs 2 threads) and the start-up line says what it costs."""
    from scale_ocr.distributed import process_group

    for var in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr("scale_ocr.distributed.cores.usable_cores", lambda: Cores(affinity=1, quota=None))
    before = torch.get_num_threads()
    try:
        process_group.init_distributed("gloo")
        assert torch.get_num_threads() == 2
    finally:
        process_group.destroy_distributed()
        torch.set_num_threads(before)
    err = capsys.readouterr().err.splitlines()
    assert err == ["scale-ocr: warning: OMP_NUM_THREADS=2 x 1 local rank = 2 threads on 1 usable core (affinity 1, "
                   "cgroup quota none): threads wait for each other at every operator, and steps can run many times "
                   "slower (20x measured at 2 x 2 on 2 cores); export OMP_NUM_THREADS=1 or pass --threads 1"]


def test_the_scaling_report_stacks_each_strategys_step_and_names_its_limit(tmp_path: Path):
    """benchmarks.report from a results.jsonl whose jobs recorded a time and a memory breakdown (no jobs
    launched): a stacked bar of each, a table, and the part that limits each strategy."""
    import json

    from benchmarks.report import build_report

    def row(strategy, comm, compute):
        parts = {"data": 0.01, "compute": compute, "exposed_comm": comm, "optimizer": 0.02, "other": 0.01}
        mib = {"runtime": 500, "model_state": 100 if strategy == "ddp" else 50, "engine_buffers": 0,
               "activations": 200, "heap": 300 if strategy == "ddp" else -20}
        memory = {"rank": 0, "peak_rss": sum(mib.values()) * 2**20, "at_step": 0,
                  **{k: v * 2**20 for k, v in mib.items()}}
        metrics = {"hardware": {"host": "h", "cpu": "cpu", "cores": 2, "memory_bytes": 2**34, "gpus": []},
                   "versions": {"torch": "2", "deepspeed": "0", "fairscale": "0", "python": "3", "scale-ocr": "0",
                                "git": "abc"},
                   "samples_per_sec": 100, "samples_per_sec_p25": 90, "samples_per_sec_p75": 110,
                   "step_time_p50": sum(parts.values()), "step_time_p95": 0.3, "peak_memory_bytes": 2**30,
                   "time_breakdown": {**parts, "sum_seconds": sum(parts.values())}, "memory_breakdown": memory}
        cfg = {"model": "m", "strategy": strategy, "world_size": 2, "batch_size": 8, "repeat": 0,
               "key": f"m/{strategy}/ws2/r0", "params": 10**6, "precision": "fp32", "steps": 3, "warmup": 1,
               "preset": None, "threads_per_rank": 1, "launcher": "torchrun"}
        return {"config": cfg, "status": "ok", "error": None, "metrics": metrics}

    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (row("ddp", 0.02, 0.2),
                                                                                   row("fsdp", 0.3, 0.1))))
    report = build_report(tmp_path).read_text()
    assert "| ddp | 2 | 200.0 | 20.0 | 10.0 | 20.0 | 10.0 | 1.00 | compute |" in report
    assert "| fsdp | 2 | 100.0 | 300.0 | 10.0 | 20.0 | 10.0 | 1.00 | exposed communication |" in report
    assert (tmp_path / "time_m.png").stat().st_size > 5000
    assert "| ddp | 500 | 100 | 0 | 200 | 300 | 1100 | heap (freed, temporaries) |" in report
    assert "| fsdp | 500 | 50 | 0 | 200 | -20 | 730 | activations |" in report  # a negative heap is shown, not drawn
    assert (tmp_path / "memory_breakdown_m.png").stat().st_size > 5000
