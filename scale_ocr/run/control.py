"""Decisions every rank must take together: stop for preemption, skip a non-finite step, save now.

A signal may reach one rank a step before another, a loss may turn NaN on one rank only, and only rank 0's clock
says when a timed checkpoint is due; acting alone would leave the ranks in different collectives (a hang). So after
each optimizer step the ranks OR their flags in one tiny all-reduce on a gloo group over CPU tensors. SIGTERM and
SIGUSR1 set the stop flag: the step ends, every rank checkpoints together and the job exits :data:`EXIT_PREEMPTED`.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as tdist

from scale_ocr.disk import DiskFault, pending, read_user_json, take_pending
from scale_ocr.errors import UserError, say

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
    disk: bool = False  # a rank-0 write met a full disk (scale_ocr.disk.defer): every rank ends
    bad_weights: bool = False  # the updated weights are NaN/inf or grew past their bound (see WeightCheck)


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

    def agree(self, loss_finite: bool, norm_finite: bool, disk_fault: bool = False,
              weights: WeightCheck | None = None) -> Agreement:
        """OR every rank's flags; ``weights`` measures the updated weights first and learns what the ranks agreed."""
        weights_ok = weights.after_step() if weights is not None else True  # a collective on sharded engines
        timed = (self.save_minutes is not None and self.is_main
                 and time.monotonic() - self.last_save >= 60 * self.save_minutes)
        disk_fault = disk_fault or pending() is not None  # a rank-0 write held a disk fault (safe_files.defer)
        flags = torch.tensor([self.stop.received is not None, not (loss_finite and norm_finite), timed, disk_fault,
                              not weights_ok], dtype=torch.int32)
        if self.active:
            tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=self.group)
        stop, nonfinite, save, disk, bad_weights = (bool(v) for v in flags.tolist())
        if disk:  # every rank ends now with the fault rank 0 held (rank 0 prints it)
            raise take_pending() or DiskFault("rank 0 could not write to the run directory (its line says why)")
        if weights is not None:
            weights.ok = not bad_weights
        return Agreement(stop, nonfinite, save, disk, bad_weights)


class WeightCheck:
    """The weights after each step: finite, and their global norm at most ``growth`` times its value at the start.

    A loss and a gradient can both be finite on the step that throws the weights to 1e28 (``--lr 1e30``): only
    the next step's loss shows it, and by then a checkpoint of those weights may be written. The norm is one read
    of what a checkpoint saves of the model, buffers included (the strategy's
    :meth:`~scale_ocr.strategies.Strategy.weight_norm`): BatchNorm's running variance can reach 1e11 while the
    weights stay within their bound, and a checkpoint holding it validates NaN.

    Args:
        measure: the strategy's ``weight_norm`` (a collective; None: the engine cannot tell).
        growth: how many times its starting value the norm may reach (the start floored at 1).
    """

    def __init__(self, measure: Callable[[], torch.Tensor | None], growth: float) -> None:
        self.measure, self.growth = measure, growth
        self.start = self.norm = self._read()
        finite_start = self.start is not None and math.isfinite(self.start)
        self.bound = growth * max(self.start, 1.0) if finite_start else math.inf
        self.ok = True  # as every rank agreed after the last step

    def _read(self) -> float | None:
        norm = self.measure()
        return None if norm is None else float(norm)

    def unfit_start(self, recorded: float | None = None) -> str | None:
        """What is wrong with the weights training starts from (None: nothing): NaN/inf, a norm fp32 cannot hold,
        or, resumed, a norm past ``growth`` times the one its checkpoint ``recorded``, as one kept by a check of the
        weights alone (before buffers counted) may be: its BatchNorm statistics had blown up."""
        if self.start is None:
            return None
        if not math.isfinite(self.start):
            return self.describe()
        if isinstance(recorded, (int, float)) and math.isfinite(recorded) and self.start > self.growth * max(recorded,
                                                                                                            1.0):
            return (f"have a norm of {self.start:.3g} with their buffers (BatchNorm statistics), past --max-weight-"
                    f"growth x the {recorded:.3g} its trainer.json records for the weights alone")
        return None

    def after_step(self) -> bool:
        """Measure the updated weights; True when they are acceptable (the ranks then agree on it)."""
        self.norm = self._read()
        return self.norm is None or (math.isfinite(self.norm) and self.norm <= self.bound)

    def describe(self) -> str:
        """What is wrong with the weights, for a message."""
        if self.norm is not None and math.isfinite(self.norm):
            return (f"have a norm of {self.norm:.3g}, past {self.bound:.3g} (--max-weight-growth x "
                    f"{max(self.start, 1.0):.3g})")
        if self.norm is not None and math.isnan(self.norm):
            return "hold NaN"
        return "have an infinite norm (a weight is inf, or beyond ~1e19, whose square fp32 cannot hold)"

    def fine(self, what: str, is_main: bool) -> bool:
        """False, with a warning on rank 0, when the weights every rank agreed on are not fit to write as ``what``."""
        if not self.ok and is_main:
            say(f"scale-ocr: warning: not writing {what}: the weights {self.describe()}; the previous one, if any, "
                "is kept", err=True)
        return self.ok

    @staticmethod
    def of_checkpoint(folder: Path) -> str:
        """What a checkpoint's trainer.json says of its weights and loss, for the divergence message."""
        try:
            meta = read_user_json(folder / "trainer.json", what="the checkpoint's trainer.json", nan_ok=True)
            w, loss = meta["weights"], meta["loss"]
            fine = w["finite"] and w["within_bound"]
            return f" (weights finite, norm {w['norm']:.3g}; loss {loss:.4g})" if fine else ""
        except (UserError, ValueError, KeyError, TypeError):  # written by an older version, or not measured
            return ""

    def record(self) -> dict[str, float | bool | None]:
        """For trainer.json, so a checkpoint's weights can be checked: finite, their norm, the bound (None:
        unmeasured)."""
        finite = None if self.norm is None else math.isfinite(self.norm)
        return {"finite": finite, "norm": self.norm if finite else None,
                "bound": self.bound if math.isfinite(self.bound) else None, "within_bound": self.ok}
