"""Measurements of this host for the time model (:mod:`scale_ocr.planning.time_model`), a few seconds each.

Each figure is the median of a few timed calls after a warm-up: the host as it is, neighbours included, as the
training steps the prediction is compared with see it (docs/memory.md, ``--device host``).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from scale_ocr.distributed.process_group import free_port


def _best(fn, repeats: int) -> float:
    """The median of ``repeats`` timed calls, after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _step_seconds(model_cfg, batch: int, precision: str, repeats: int) -> float:
    """Seconds of one forward and backward of ``batch`` samples of the model under the run's autocast."""
    from scale_ocr.precision import autocast_factory
    from scale_ocr.tasks import create_task

    task = create_task(model_cfg)
    model = task.build_model().train()
    inputs = task.dummy_inputs(batch)
    autocast = autocast_factory(precision, torch.device("cpu"))

    def step() -> None:
        with autocast():
            out = model(*inputs)
        out["loss"].float().mean().backward()  # every task's model returns its loss (as flops.py counts it)
        model.zero_grad(set_to_none=True)

    return _best(step, repeats)


def compute_rate(task, batch: int, precision: str, threads: int, flops_per_sample: float, ranks: int = 1,
                 repeats: int = 3) -> float:
    """Training FLOP/s of one rank of ``task``'s model on this CPU, on ``threads`` threads, with ``ranks`` ranks
    stepping at once (the slowest rank's rate: collectives wait for it)."""
    if ranks <= 1:
        before = torch.get_num_threads()
        torch.set_num_threads(max(1, threads))
        try:
            seconds = _step_seconds(task.cfg, batch, precision, repeats)
        finally:
            torch.set_num_threads(before)
    else:
        seconds = _spawn(_compute_worker, ranks, task.cfg, batch, precision, threads, repeats)[0]
    return flops_per_sample * batch / seconds


def _compute_worker(rank: int, world: int, init: str, out: str, model_cfg, batch: int, precision: str,
                    threads: int, repeats: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, threads))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    dist.barrier()  # every rank computes at once
    seconds = torch.tensor([_step_seconds(model_cfg, batch, precision, repeats)])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(f"{seconds.item()}")
    _leave(dist)


def _leave(dist) -> None:
    """Leave the probe's group together: a rank that tears gloo down while its peer is still in a collective or
    its own teardown can make the peer's gloo abort (seen once in CI: SIGABRT, and the whole estimate failed)."""
    dist.barrier()
    dist.destroy_process_group()


def _spawn(worker, nprocs: int, *args) -> list[float]:
    """Run ``worker(rank, nprocs, init, out, *args)`` in ``nprocs`` local processes over gloo; rank 0's numbers."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        mp.spawn(worker, args=(nprocs, f"tcp://127.0.0.1:{free_port()}", out, *args), nprocs=nprocs)
        return [float(v) for v in Path(out).read_text().split()]


def memory_bandwidth(megabytes: int = 256, threads: int = 1) -> float:
    """Bytes per second of a ``megabytes`` copy (read + write), on ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a = torch.ones(megabytes * 2**20 // 4)
        b = torch.empty_like(a)
        seconds = _best(lambda: b.copy_(a), 3)
    finally:
        torch.set_num_threads(before)
    return 2 * a.numel() * 4 / seconds


SIZES = (2**18, 2**22, 2**24)  # fp32 elements: 1, 16 and 64 MiB


def _all_reduce_worker(rank: int, world: int, init: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    rows = []
    for numel in SIZES:
        t = torch.ones(numel)
        dist.barrier()
        rows.append(f"{numel} {_best(lambda t=t: dist.all_reduce(t), 3)}")
    rows += [f"{_busy_call_seconds(world, slice_s)}" for slice_s in SLICES]
    if rank == 0:
        Path(out).write_text(" ".join(rows))
    _leave(dist)


SLICES = (0.3e-3, 3e-3)  # seconds of compute between calls: an engine's bookkeeping, and a layer's forward or backward


def _busy_call_seconds(world: int, slice_s: float) -> float:
    """Seconds a small all-gather adds between ``slice_s`` slices of compute, as engines call it: each rank
    computes, then waits for the other to arrive and for gloo's thread to get a core the compute is using (several
    times what the same call costs between idle ranks)."""
    import torch.distributed as dist

    a, small = torch.randn(192, 192), torch.ones(256)  # 1 KiB
    out = torch.empty(256 * world)
    reps = torch.tensor([max(1, round(slice_s / _best(lambda: a @ a, 5)))])
    dist.all_reduce(reps, op=dist.ReduceOp.MAX)  # the same slices on every rank
    calls = max(20, round(0.15 / slice_s))

    def run(comm: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            for _ in range(int(reps)):
                a @ a
            if comm:
                dist.all_gather_into_tensor(out, small)
        dist.barrier()
        return time.perf_counter() - t0

    run(True)
    extra = sorted(run(True) - run(False) for _ in range(5))
    return max(0.0, extra[2] / calls)  # the median of five


def gloo_link(world: int = 2) -> tuple[float, float, float]:
    """(bus bandwidth in bytes/s, seconds per call, seconds per call between a layer's compute) of gloo collectives
    between ``world`` local processes: the bandwidth from a least-squares line through (bytes moved per rank,
    seconds) of all-reduces at three sizes, the costs of a small all-gather between short and long slices of
    compute (:func:`_busy_call_seconds`; the line's intercept is too uncertain, and idle ranks answer faster than
    ranks that compute, as ranks in a job do)."""
    *values, latency, busy = _spawn(_all_reduce_worker, world)
    pairs = [(2 * (world - 1) / world * values[i] * 4, values[i + 1]) for i in range(0, len(values), 2)]
    mx = sum(x for x, _ in pairs) / len(pairs)
    my = sum(y for _, y in pairs) / len(pairs)
    slope = sum((x - mx) * (y - my) for x, y in pairs) / sum((x - mx) ** 2 for x, _ in pairs)
    return 1.0 / slope, latency, max(busy, latency)


def engine_cost(strategy: str, model_cfg, batch: int, precision: str, threads: int, steps: int = 10):
    """:class:`~scale_ocr.planning.time_model.EngineCost` of ``strategy`` on this host: a short training run on one
    rank (no communication), synthetic samples, read back from its metrics.json time breakdown."""
    import json
    import subprocess
    import sys

    from scale_ocr.config import MODEL_SIZE_FIELDS
    from scale_ocr.errors import UserError
    from scale_ocr.planning.time_model import EngineCost

    script = Path(__file__).resolve().parents[1] / "train.py"
    size = [] if model_cfg.input_size is None else ["--input-size", "x".join(map(str, model_cfg.input_size))]
    for field in MODEL_SIZE_FIELDS:
        if getattr(model_cfg, field, None) is not None:
            size += [f"--{field.replace('_', '-')}", str(getattr(model_cfg, field))]
    with tempfile.TemporaryDirectory(prefix="scale-ocr-engine-") as tmp:
        cmd = [sys.executable, str(script), model_cfg.arch, "--strategy", strategy, "--precision", precision,
               "-b", str(batch), "--max-steps", str(steps), "--epochs", "1000", "--train-samples", str(4 * batch),
               "--val-samples", str(batch), "--no-eval", "--log-every", "1000", "--sched", "constant", "--workers",
               "0", "--resume", "none", "--output-dir", tmp + "/run", "--wandb-mode", "disabled", *size]
        launcher = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        env = {**{k: v for k, v in os.environ.items() if k not in launcher}, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        metrics = Path(tmp, "run", "metrics.json")
        if done.returncode != 0 or not metrics.is_file():
            lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
            why = next((ln for ln in lines if ln.startswith("scale-ocr: error:")), lines[-1] if lines else "")
            raise UserError(f"measuring {strategy}'s own step on one rank failed (exit {done.returncode}: "
                            f"{why.strip()[:200]})")
        parts = json.loads(metrics.read_text())["time_breakdown"]
    return EngineCost(parts["compute"], parts["optimizer"], parts["other"] + parts["data"], threads)
