"""What the training loop counts: the run's counters (:class:`RunState`) and the steps since the last log line
(:class:`Window`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RunState:
    """Counters the loop advances."""

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0  # optimizer steps done in the current epoch
    epoch_micro: int = 0  # micro-batches each rank took of the current epoch
    samples: int = 0  # trained in the run (all ranks; a resumed run's include its checkpoint's)
    timed_steps: int = 0
    timed_samples: int = 0
    timed_seconds: float = 0.0
    timed_data_seconds: float = 0.0  # of timed_seconds, spent waiting for the loader's next batch
    flops: float = 0.0  # this rank's training FLOPs in this process, each micro-batch billed at its shape (MFU)
    timed_flops: float = 0.0  # of flops, in the timed steps
    epoch_loss: list[torch.Tensor] = field(default_factory=list)
    bad_steps: int = 0  # consecutive steps with a NaN/inf loss or gradient, skipped on every rank
    skipped_steps: int = 0  # all such steps in this run
    best: tuple[float, float] | None = None  # Task.score: (headline metric, -val_loss)
    last_eval: dict[str, float] = field(default_factory=dict)
    timing_start: tuple[float, int, int, float] | None = None  # (time, step, samples, flops) the timed stretch began at

    def start_timing(self, now: float) -> None:
        if self.timing_start is None:
            self.timing_start = (now, self.step, self.samples, self.flops)

    def stop_timing(self, now: float) -> None:
        """Close the open timed stretch, if any: its seconds, steps, samples and FLOPs count toward samples/s and
        MFU."""
        if self.timing_start is not None:
            t0, step0, samples0, flops0 = self.timing_start
            self.timed_seconds += now - t0
            self.timed_steps += self.step - step0
            self.timed_samples += self.samples - samples0
            self.timed_flops += self.flops - flops0
            self.timing_start = None


class Window:
    """Steps since the last log line. Losses and grad norms stay on the device until logged, so
    the loop never waits on the GPU between steps."""

    def __init__(self, start: float, flops: float) -> None:
        self.start, self.losses, self.stats, self.lr = start, [], None, 0.0
        self.flops_before = flops  # the rank's RunState.flops when the window opened
        self.data_seconds = 0.0  # waiting for the loader
        self.samples = self.batch = 0  # trained in the window's good steps; the last one's global batch

    def add(self, loss: torch.Tensor, stats, lr: float, batch: int) -> None:
        self.losses.append(loss)
        self.stats, self.lr, self.batch = stats, lr, batch
        self.samples += batch
