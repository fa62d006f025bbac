"""``--profile-steps N``: profile the last N optimizer steps with torch.profiler.

Writes rank 0's Chrome trace (``trace_rank0.json``, open it in Perfetto or chrome://tracing) and
measures the **communication share**: the fraction of the profiled wall time during which a
collective was in flight on this rank (gloo's ``gloo:*`` work, NCCL kernels on GPU), as the union of
their intervals. Overlapped communication counts too, so it is an upper bound on what communication
costs; engines that overlap well show a high share with little slowdown.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

COMM_MARKERS = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class StepProfiler:
    """Profiles steps ``first_step`` .. ``last_step`` (1-based optimizer steps, inclusive).

    Args:
        run_dir: where rank 0 writes its trace.
        first_step, last_step: the profiled stretch; nothing is profiled when ``first_step > last_step``.
        device: the rank's device (adds CUDA activity on GPU).
        write_trace: this rank writes its Chrome trace.
    """

    def __init__(self, run_dir: Path, first_step: int, last_step: int, device: torch.device, write_trace: bool) -> None:
        self.run_dir, self.first, self.last, self.device = run_dir, first_step, last_step, device
        self.write_trace = write_trace
        self.prof = None
        self.share: float | None = None
        self._t0 = 0.0

    def before_step(self, step: int) -> None:
        """Call before optimizer step ``step`` (1-based) begins."""
        if step == self.first and self.first <= self.last:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.prof = profile(activities=activities)
            self.prof.__enter__()
            self._t0 = time.perf_counter()

    def after_step(self, step: int) -> None:
        """Call once optimizer step ``step`` is done."""
        if self.prof is None or step != self.last:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall_us = (time.perf_counter() - self._t0) * 1e6
        self.prof.__exit__(None, None, None)
        spans = [(e.time_range.start, e.time_range.end) for e in self.prof.events()
                 if e.name.startswith(COMM_MARKERS) or any(m in e.name for m in COMM_MARKERS[2:])]
        self.share = min(1.0, _union_us(spans) / wall_us) if wall_us > 0 else None
        if self.write_trace:
            self.prof.export_chrome_trace(str(self.run_dir / "trace_rank0.json"))
        self.prof = None
