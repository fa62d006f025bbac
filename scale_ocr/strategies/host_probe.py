"""Measurements of this host for the time model (:mod:`scale_ocr.strategies.time_model`), a few seconds each.

* :func:`compute_rate`: the model's own training FLOP/s here, forward and backward timed at the batch and thread
  count a rank will have (counted FLOPs / seconds: what peak x MFU stands for on a GPU); with ``ranks`` > 1, in
  that many processes at once, as a job's ranks share the host's cores and memory bandwidth.
* :func:`memory_bandwidth`: a large tensor copy, bytes read and written per second (Adam's step is bound by it).
* :func:`gloo_link`: bus bandwidth and latency of a gloo all-reduce between local processes, fitted over three
  message sizes (what DDP and the ZeRO engines use between CPU ranks).

Each figure is the median of a few timed calls after a warm-up: the host as it is, neighbours included, as the
training steps the prediction is compared with see it.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import torch


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
    dist.destroy_process_group()


def _spawn(worker, nprocs: int, *args) -> list[float]:
    """Run ``worker(rank, nprocs, init, out, *args)`` in ``nprocs`` local processes over gloo; rank 0's numbers."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        mp.spawn(worker, args=(nprocs, f"tcp://127.0.0.1:{port}", out, *args), nprocs=nprocs)
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
    small = torch.ones(256)  # 1 KiB: a call's fixed cost, which engines that gather per layer pay many times
    dist.barrier()
    rows.append(f"{_best(lambda: dist.all_reduce(small), 21)}")
    if rank == 0:
        Path(out).write_text(" ".join(rows))
    dist.destroy_process_group()


def gloo_link(world: int = 2) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency per call in s) of gloo all-reduces between ``world`` local processes: the
    bandwidth from a least-squares line through (bytes moved per rank, seconds) at three sizes, the latency from a
    1 KiB all-reduce (the line's intercept is too uncertain for engines whose cost is many small calls)."""
    *values, latency = _spawn(_all_reduce_worker, world)
    pairs = [(2 * (world - 1) / world * values[i] * 4, values[i + 1]) for i in range(0, len(values), 2)]
    mx = sum(x for x, _ in pairs) / len(pairs)
    my = sum(y for _, y in pairs) / len(pairs)
    slope = sum((x - mx) * (y - my) for x, y in pairs) / sum((x - mx) ** 2 for x, _ in pairs)
    return 1.0 / slope, latency
