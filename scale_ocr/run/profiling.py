"""``--profile-steps N``: profile the last N optimizer steps with torch.profiler.

Writes rank 0's Chrome trace (``trace_rank0.json``) and measures each rank's communication two ways
(:func:`exposed_comm`): **in flight**, the union of the intervals a collective ran (an upper bound on its cost),
and **exposed**, the part of it with no compute running, which a faster link or better overlap would save. On GPUs
communication is NCCL's kernels; on CPUs it is gloo's worker threads and the calling thread's ``c10d::*`` ranges,
so synchronous collectives are exposed whole. How to read both: docs/time-breakdown.md.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from scale_ocr.run.breakdown import PHASES, RANGE_PREFIX

COMM_MARKERS = ("gloo:", "nccl:", "ncclDevKernel", "ncclKernel")
HOST_COMM = ("gloo:", "c10d::", "nccl:", "record_param_comms")  # host ranges: a collective, or its start
Spans = list[tuple[float, float]]


def _merge(intervals: Spans) -> Spans:
    """Sorted, disjoint union of ``intervals``."""
    out: Spans = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def _length(spans: Spans) -> float:
    return sum(b - a for a, b in spans)


def _subtract(keep: Spans, remove: Spans) -> Spans:
    """``keep`` minus ``remove``, both merged."""
    out: Spans = []
    j = 0
    for a, b in keep:
        while j < len(remove) and remove[j][1] <= a:
            j += 1
        k, start = j, a
        while k < len(remove) and remove[k][0] < b:
            if remove[k][0] > start:
                out.append((start, remove[k][0]))
            start = max(start, remove[k][1])
            k += 1
        if start < b:
            out.append((start, b))
    return out


def _overlap(spans: Spans, windows: Spans) -> float:
    """Length of ``spans`` inside ``windows`` (both merged)."""
    return _length(_subtract(spans, _subtract(spans, windows)))


def _inside(spans: Spans, a: float, b: float) -> bool:
    """Whether [a, b] lies within one of ``spans`` (sorted by start)."""
    i = bisect.bisect_right(spans, (a, float("inf"))) - 1
    return i >= 0 and spans[i][1] >= b


def _host_spans(events: list[Any]) -> tuple[Spans, Spans]:
    """Communication and compute on the host (CPU ranks): see the module docstring."""
    comm_by_thread: dict[int, Spans] = defaultdict(list)
    for e in events:
        if e.name.startswith(HOST_COMM):
            comm_by_thread[e.thread].append((e.time_range.start, e.time_range.end))
    for thread, spans in comm_by_thread.items():
        comm_by_thread[thread] = _merge(spans)  # disjoint, so containment is one lookup (ranges nest)
    workers = set(comm_by_thread) - _calling_threads(events)  # gloo's threads: their operators serve a collective
    compute = [(e.time_range.start, e.time_range.end) for e in events
               if e.name.startswith("aten::") and e.thread not in workers
               and not _inside(comm_by_thread.get(e.thread, []), e.time_range.start, e.time_range.end)]
    comm = [s for spans in comm_by_thread.values() for s in spans]
    return _merge(comm), _merge(compute)


def _calling_threads(events: list[Any]) -> set[int]:
    """Threads that ran the loop's phases (the training thread; its operators are compute)."""
    return {e.thread for e in events if e.name.startswith(RANGE_PREFIX)}


def _device_spans(events: list[Any]) -> tuple[Spans, Spans]:
    """Communication (NCCL kernels) and compute (every other kernel and copy) on the GPU's timeline."""
    comm, compute = [], []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.name.startswith(RANGE_PREFIX):
            continue
        span = (e.time_range.start, e.time_range.end)
        (comm if "nccl" in e.name.lower() else compute).append(span)
    return _merge(comm), _merge(compute)


def _phase_spans(events: list[Any], device: bool) -> dict[str, Spans]:
    """The loop's phase ranges; on GPU the device-side copies of the ranges when the profiler recorded them."""
    spans: dict[str, Spans] = {p: [] for p in PHASES}
    on_device = [e for e in events if e.name.startswith(RANGE_PREFIX)
                 and (e.device_type == torch.autograd.DeviceType.CUDA) == device]
    chosen = on_device or [e for e in events if e.name.startswith(RANGE_PREFIX)]
    for e in chosen:
        phase = e.name[len(RANGE_PREFIX):]
        if phase in spans:
            spans[phase].append((e.time_range.start, e.time_range.end))
    return {p: _merge(s) for p, s in spans.items()}


def exposed_comm(events: list[Any], on_gpu: bool, steps: int) -> dict[str, Any] | None:
    """Exposed and in-flight communication of profiled steps, from torch.profiler's events.

    Returns ``phase_share`` (per loop phase: the share of its time with communication exposed),
    ``exposed_share`` and ``in_flight_share`` (of the profiled steps' time), and ``steps``; None when the
    profile holds no loop phases.
    """
    comm, compute = _device_spans(events) if on_gpu else _host_spans(events)
    phases = _phase_spans(events, on_gpu)
    total = sum(_length(s) for s in phases.values())
    if total <= 0:
        return None
    exposed = _subtract(comm, compute)
    in_steps = _merge([s for spans in phases.values() for s in spans])
    return {
        "phase_share": {p: _overlap(exposed, s) / _length(s) if s else 0.0 for p, s in phases.items()},
        "exposed_share": _overlap(exposed, in_steps) / total,
        "in_flight_share": _overlap(comm, in_steps) / total,
        "steps": steps,
    }


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
        self.share: float | None = None  # in flight, of the profiled wall time (metrics.json's comm_share)
        self.comm: dict[str, Any] | None = None  # exposed_comm()'s result
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
        events = list(self.prof.events())
        spans = [(e.time_range.start, e.time_range.end) for e in events
                 if e.name.startswith(COMM_MARKERS) or any(m in e.name for m in COMM_MARKERS[2:])]
        self.share = min(1.0, _length(_merge(spans)) / wall_us) if wall_us > 0 else None
        self.comm = exposed_comm(events, self.device.type == "cuda", self.last - self.first + 1)
        if self.write_trace:
            self.prof.export_chrome_trace(str(self.run_dir / "trace_rank0.json"))
        self.prof = None
