"""Decisions every rank must take together: stop for preemption, skip a non-finite step, save now.

A signal may reach one rank a step before another, a loss may turn NaN on one rank only, and only
rank 0's clock decides when a timed checkpoint is due. Acting on any of these alone would leave the
ranks in different collectives (a hang), so after each optimizer step the ranks OR their flags in one
tiny all-reduce. It runs on a gloo group over CPU tensors (the default group when it already is gloo),
so on GPUs it costs one host round-trip and no device synchronisation of its own.

Preemption: SIGTERM (what torchrun, SLURM and Kubernetes send before killing) and SIGUSR1 (SLURM's
``--signal=USR1@SECONDS`` warning before a time limit) set a flag; the loop finishes its step, every
rank writes a checkpoint together and the job exits with :data:`EXIT_PREEMPTED`.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from scale_ocr.run.safe_files import DiskFault, pending, take_pending

# EX_TEMPFAIL from sysexits.h: "try again later". Schedulers and torchrun treat it as a failure, so a
# job under `--max-restarts` or a requeueing SLURM script starts again and `--resume auto` continues.
EXIT_PREEMPTED = 75
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1")


class StopSignal:
    """Records SIGTERM/SIGUSR1 instead of dying at once, so the step in flight can finish."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> StopSignal:
        for name in PREEMPT_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        # A second signal while already stopping keeps the first name; the save is under way.
        self.received = self.received or signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass(frozen=True)
class Agreement:
    """What all ranks decided after one step."""

    stop: bool = False  # a preemption signal reached some rank
    nonfinite: bool = False  # some rank's loss or the global gradient norm was NaN/inf
    save: bool = False  # rank 0's checkpoint timer fired
    disk: bool = False  # a rank-0 write met a full disk (scale_ocr.run.safe_files.defer): every rank ends


class StepControl:
    """Per-step agreement over a CPU group.

    Args:
        stop: the installed signal recorder.
        save_minutes: rank 0 asks for a checkpoint when this many minutes passed since the last one
            (None: no timed checkpoints).
        is_main: this is rank 0, whose clock decides timed saves.
    """

    def __init__(self, stop: StopSignal, save_minutes: float | None, is_main: bool) -> None:
        self.stop, self.save_minutes, self.is_main = stop, save_minutes, is_main
        self.last_save = time.monotonic()
        self.group = None
        self.active = tdist.is_initialized() and tdist.get_world_size() > 1
        if self.active and tdist.get_backend() != "gloo":
            self.group = tdist.new_group(backend="gloo")  # collective: every rank creates it

    def saved(self) -> None:
        """A checkpoint was just written; the timer restarts."""
        self.last_save = time.monotonic()

    def agree(self, loss_finite: bool, norm_finite: bool, disk_fault: bool = False) -> Agreement:
        timed = (self.save_minutes is not None and self.is_main
                 and time.monotonic() - self.last_save >= 60 * self.save_minutes)
        disk_fault = disk_fault or pending() is not None  # a rank-0 write held a disk fault (safe_files.defer)
        flags = torch.tensor([self.stop.received is not None, not (loss_finite and norm_finite), timed, disk_fault],
                             dtype=torch.int32)
        if self.active:
            tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=self.group)
        stop, nonfinite, save, disk = (bool(v) for v in flags.tolist())
        if disk:  # every rank ends now with the fault rank 0 held (rank 0 prints it)
            raise take_pending() or DiskFault("rank 0 could not write to the run directory (its line says why)")
        return Agreement(stop, nonfinite, save, disk)
