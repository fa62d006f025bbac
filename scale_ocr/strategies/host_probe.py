"""Measurements of this host for the time model (:mod:`scale_ocr.strategies.time_model`), a few seconds each.

* :func:`compute_rate`: the model's own training FLOP/s here, one forward and backward timed at the batch and
  thread count a rank will have (counted FLOPs / seconds: what peak x MFU stands for on a GPU).
* :func:`memory_bandwidth`: a large tensor copy, bytes read and written per second (Adam's step is bound by it).
* :func:`gloo_link`: bus bandwidth and latency of a gloo all-reduce between two local processes, fitted over
  three message sizes (what DDP and the ZeRO engines use between CPU ranks).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import torch


def _best(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (after one warm-up): the host's rate, not its neighbours'."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def compute_rate(task, batch: int, precision: str, threads: int, flops_per_sample: float, repeats: int = 2) -> float:
    """Training FLOP/s of ``task``'s model on this CPU: a forward and backward of ``batch`` samples under the
    run's autocast, on ``threads`` threads, timed (the best of ``repeats``)."""
    from scale_ocr.precision import autocast_factory

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        model = task.build_model().train()
        inputs = task.dummy_inputs(batch)
        autocast = autocast_factory(precision, torch.device("cpu"))

        def step() -> None:
            with autocast():
                out = model(*inputs)
            out["loss"].float().mean().backward()  # every task's model returns its loss (as flops.py counts it)
            model.zero_grad(set_to_none=True)

        seconds = _best(step, repeats)
    finally:
        torch.set_num_threads(before)
    return flops_per_sample * batch / seconds


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
        seconds = _best(lambda t=t: dist.all_reduce(t), 3)
        rows.append(f"{numel} {seconds}")
    if rank == 0:
        Path(out).write_text("\n".join(rows))
    dist.destroy_process_group()


def gloo_link(world: int = 2) -> tuple[float, float]:
    """(bus bandwidth in bytes/s, latency per call in s) of gloo all-reduces between ``world`` local processes:
    a least-squares line through (bytes moved per rank, seconds) at three sizes."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        mp.spawn(_all_reduce_worker, args=(world, f"tcp://127.0.0.1:{port}", out), nprocs=world)
        pairs = [(2 * (world - 1) / world * int(n) * 4, float(t))
                 for n, t in (line.split() for line in Path(out).read_text().splitlines())]
    mx = sum(x for x, _ in pairs) / len(pairs)
    my = sum(y for _, y in pairs) / len(pairs)
    slope = sum((x - mx) * (y - my) for x, y in pairs) / sum((x - mx) ** 2 for x, _ in pairs)
    latency = max(my - slope * mx, 0.0)
    return 1.0 / slope, latency
