"""Where a step's time goes: data wait, compute, exposed communication, optimizer, other.

The loop marks the end of each phase of a step on a :class:`StepClock` (``lap``), so the phases tile the step and
add up to it. On GPU a lap is a CUDA event on the current stream (the device's timeline, read back once complete,
never waited for); on CPU it is ``time.perf_counter()``. The exposed communication that ``--profile-steps`` measures
(:func:`scale_ocr.run.profiling.exposed_comm`) is moved out of the phases it hid in. The parts: docs/time-breakdown.md.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import torch
from torch.autograd.profiler import record_function

from scale_ocr.distributed.process_group import all_reduce_max, all_reduce_maxes, all_reduce_sum

PHASES = ("data", "compute", "optimizer", "other")
NEXT = dict(zip(PHASES, PHASES[1:], strict=False))
#: The loop's phase ranges as torch.profiler sees them (only while it profiles): exposed communication is split by them.
RANGE_PREFIX = "scale_ocr.phase:"


class StepClock:
    """Per-phase seconds of the timed steps (``totals``) and of every step since the last ``window()`` read.

    Args:
        device: the run's device: CUDA events on a GPU, the host clock otherwise.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.timed_steps = 0
        self._step = dict.fromkeys(PHASES, 0.0)
        self._mark: Any = None
        self._timed = False
        # Each timed step's compute work, for straggler_share: on CPU the training thread's CPU time over every
        # micro-batch's forward and backward (a wait in a collective blocks the thread and takes none of it); on a GPU
        # the forwards' device time (a backward costs its forward's multiple on every rank).
        self.work: collections.defaultdict[int, float] = collections.defaultdict(float)
        self._cpu_mark = 0.0  # the training thread's CPU time when the open compute phase began
        self._range: record_function | None = None
        # On GPU: (phase, start event, end event, timed) waiting to complete.
        self._pending: collections.deque = collections.deque()

    def _stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin(self, timed: bool) -> None:
        """A step starts; ``timed``: samples/s counts it."""
        self._timed = timed
        self._mark = self._stamp()
        self._open("data")

    def lap(self, phase: str, then: str | None = None) -> None:
        """The time since the last mark was spent in ``phase``; ``then`` follows (by default the next of
        data, compute, optimizer, other: a micro-batch's compute is followed by the next one's data)."""
        if self._mark is None:
            return
        now = self._stamp()
        if self.cuda:
            self._pending.append((phase, self._mark, now, self._timed))
        else:
            self._add(phase, now - self._mark, self._timed)
            if phase == "compute" and self._timed:
                self.work[self.timed_steps] += time.thread_time() - self._cpu_mark
        self._mark = now
        following = then or NEXT.get(phase, "other")
        self._open(following)
        if following == "compute" and not self.cuda:
            self._cpu_mark = time.thread_time()

    def forward_done(self) -> None:
        """A micro-batch's forward is over: on a GPU, the device time since its compute began is the step's work
        (a timed step's, for :func:`straggler_share`); the compute phase goes on."""
        if self.cuda and self._mark is not None and self._timed:
            self._pending.append((("work", self.timed_steps), self._mark, self._stamp(), True))

    def end_step(self) -> None:
        """The step is over: the rest since the optimizer step was "other"."""
        self.lap("other", then="")
        self._mark = None
        if self._timed:
            self.timed_steps += 1
        self._settle(wait=False)

    def _add(self, phase: str | tuple[str, int], seconds: float, timed: bool) -> None:
        if isinstance(phase, tuple):  # ("work", timed step)
            self.work[phase[1]] += seconds
        elif timed:
            self.totals[phase] += seconds

    def _settle(self, wait: bool) -> None:
        """Fold in the GPU laps whose events have completed (all of them, synchronizing, with ``wait``)."""
        while self._pending:
            phase, start, end, timed = self._pending[0]
            if not wait and not end.query():
                return
            end.synchronize()
            self._add(phase, start.elapsed_time(end) / 1000.0, timed)
            self._pending.popleft()

    def _open(self, phase: str) -> None:
        """While torch.profiler runs, each phase is a named range in its trace (so communication can be split)."""
        self._close()
        if phase and torch.autograd._profiler_enabled():
            self._range = record_function(RANGE_PREFIX + phase)
            self._range.__enter__()

    def _close(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def timed_totals(self) -> tuple[dict[str, float], int]:
        """Seconds per phase over the timed steps, and their count."""
        self._settle(wait=True)
        return dict(self.totals), self.timed_steps


def split_exposed(totals: dict[str, float], exposed_share: dict[str, float] | None) -> dict[str, float | None]:
    """Move each phase's exposed-communication share out of it into ``exposed_comm`` (None when not profiled)."""
    if exposed_share is None:
        return {**totals, "exposed_comm": None}
    parts = {}
    comm = 0.0
    for phase in PHASES:
        moved = totals[phase] * min(1.0, max(0.0, exposed_share.get(phase, 0.0)))
        parts[phase] = totals[phase] - moved
        comm += moved
    return {**parts, "exposed_comm": comm}


def time_breakdown(clock: StepClock, comm: dict[str, Any] | None, step_seconds: float | None,
                   device: torch.device, world_size: int) -> dict[str, Any] | None:
    """The run's breakdown for metrics.json: mean seconds per timed step over the ranks, by part.

    A collective: every rank calls it. ``comm`` is this rank's profile (:func:`exposed_comm`'s result, or None);
    ``step_seconds`` the measured mean step time that samples/s reports (rank 0's).
    """
    totals, steps = clock.timed_totals()
    have_comm = comm is not None  # the same on every rank: they profile the same steps
    parts = split_exposed(totals, comm["phase_share"] if have_comm else None)
    keys = (*PHASES, "exposed_comm")
    local = [(parts[k] or 0.0) / max(steps, 1) for k in keys]
    shares = [comm["exposed_share"], comm["in_flight_share"]] if have_comm else [0.0, 0.0]
    summed = all_reduce_sum([*local, *shares, float(steps)], device)
    worst = all_reduce_max(shares[0], device)
    if summed[-1] == 0:
        return None  # no timed step (a run of a few steps is all warm-up)
    mean = {k: v / world_size for k, v in zip(keys, summed, strict=False)}
    if not have_comm:
        mean["exposed_comm"] = None
    return {
        "timed_steps": steps,
        "step_seconds": step_seconds,
        **mean,
        "sum_seconds": sum(v for v in mean.values() if v is not None),
        "exposed_comm_share": summed[len(keys)] / world_size if have_comm else None,
        "exposed_comm_share_max": worst if have_comm else None,  # the rank that waited most
        "comm_in_flight_share": summed[len(keys) + 1] / world_size if have_comm else None,
        "profiled_steps": comm["steps"] if have_comm else 0,
        # waiting for the slowest rank's compute (its share of the step time; 0 on one rank)
        "straggler_share": straggler_share(clock, mean["compute"] / max(sum(mean[k] for k in PHASES), 1e-12), device,
                                           world_size),
    }


def straggler_share(clock: StepClock, compute_share: float, device: torch.device, world_size: int) -> float | None:
    """The share of a timed step each rank waits for the slowest, on average: the compute imbalance (each rank's work,
    :attr:`StepClock.work`, against the slowest rank's, step by step) times the share of step time compute takes. A
    collective: every rank calls it (None: one rank, or no timed step)."""
    clock._settle(wait=True)
    steps = clock.timed_steps  # the same on every rank: they time the same steps
    if not steps or world_size == 1:
        return None
    mine = [clock.work.get(i, 0.0) for i in range(steps)]
    slowest, summed = sum(all_reduce_maxes(mine, device)), all_reduce_sum([sum(mine)], device)[0]
    return (1 - summed / world_size / slowest) * compute_share if slowest > 0 else 0.0


def compact(breakdown: dict[str, Any] | None) -> str | None:
    """``compute 71% comm 9% data 3% opt 12% other 5%``: the final line's form (None without a breakdown)."""
    if not breakdown or not breakdown.get("sum_seconds"):
        return None
    total = breakdown["sum_seconds"]
    names = (("compute", "compute"), ("exposed_comm", "comm"), ("data", "data"), ("optimizer", "opt"),
             ("other", "other"))
    line = " ".join(f"{short} {breakdown[key] / total:.0%}" if breakdown.get(key) is not None else f"{short} n/a"
                    for key, short in names)
    wait = breakdown.get("straggler_share")
    return f"{line}; straggler {wait:.1%}" if wait is not None else line


def memory_breakdown(local: dict[str, int | None], rank: int, device: torch.device) -> dict[str, Any]:
    """The peak-memory breakdown (:func:`scale_ocr.memory.meter.peak_breakdown`) of the rank whose peak is largest
    (the lowest such rank), so its parts add up; ``rank`` says which. A collective: every rank calls it."""
    keys = sorted(local)  # the same keys on every rank: they share a device type
    peak = float(local.get("peak_allocated", local.get("peak_rss")) or 0)
    worst = all_reduce_max(peak, device)
    winner = int(-all_reduce_max(-float(rank if peak >= worst else 2**31), device))
    mine = rank == winner
    values = all_reduce_sum([float(-1 if local[k] is None else local[k]) if mine else 0.0 for k in keys], device)
    return {"rank": winner, **{k: None if v == -1 else int(v) for k, v in zip(keys, values, strict=True)}}
