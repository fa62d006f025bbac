"""What a run derives from its config, its launch and the data it built, each value computed once.

:func:`build_plan` is the one place that computes them; the loop, the run's record and its summary read the frozen
:class:`RunPlan`, never the config again. :class:`RunParts` holds the collaborators the loop calls.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scale_ocr.config import OptimConfig, RunConfig, TrainConfig
from scale_ocr.errors import UserError
from scale_ocr.optim import LRPlan, default_warmup, plan_lr
from scale_ocr.run.mfu import Utilization

if TYPE_CHECKING:
    from torch import nn

    from scale_ocr.checkpoint.manager import CheckpointManager
    from scale_ocr.data.loader import Data
    from scale_ocr.distributed.process_group import DistInfo
    from scale_ocr.optim import LRSchedule
    from scale_ocr.run.batch_ramp import BatchRamp
    from scale_ocr.run.control import StepControl
    from scale_ocr.run.watchdog import Watchdog
    from scale_ocr.strategies import Strategy
    from scale_ocr.tasks import Task
    from scale_ocr.tracking import FanOut, NullLogger


def global_batch(train: TrainConfig, world_size: int, micro_batch: int | None = None) -> int:
    """Samples in one optimizer step: ranks x micro-batch (``-b``, or ``micro_batch``: ``--batch-pixels``' mean) x
    accumulation."""
    return (micro_batch or train.batch_size) * train.grad_accum * world_size


def run_lr(cfg: RunConfig, world_size: int, micro_batch: int | None = None) -> LRPlan:
    """The run's peak rate: the resolved rate carried to this run's global batch by its rule; a scaled rate a float
    cannot hold is refused naming the rule that made it."""
    lr = plan_lr(cfg.optim, global_batch(cfg.train, world_size, micro_batch))
    if not math.isfinite(lr.peak_lr):
        raise UserError(f"--lr {lr.base_lr:g} scaled by --lr-scaling {lr.rule} to this run's global batch "
                        f"{lr.global_batch} (x {lr.factor:g}: global batch / --lr-reference-batch "
                        f"{lr.reference_batch}{' under a square root' * (lr.rule == 'sqrt')}) overflows to "
                        f"{lr.peak_lr}; give a rate that fits once scaled (--lr is the rate at the reference "
                        "batch), or --lr-scaling none to use --lr as given")
    return lr


def scaled_optim(optim: OptimConfig, lr: LRPlan) -> OptimConfig:
    """The optim section the engines build from: ``lr``'s peak rate (this run's global batch), applied as given;
    config.json keeps the rate before scaling (``lr_plan``)."""
    return dataclasses.replace(optim, lr=lr.peak_lr, lr_scaling="none", lr_reference_batch=None)


def plan_steps(steps_per_epoch: int, epochs: int, max_steps: int | None) -> int:
    """Optimizer steps in the run: ``epochs`` worth, capped by ``max_steps``."""
    total = steps_per_epoch * epochs
    return min(total, max_steps) if max_steps else total


@dataclass(frozen=True)
class RunPlan:
    """The values a run derives once.

    Attributes:
        train: the train section (batch, accumulation, precision, cadence).
        run_dir: ``--output-dir``: where models, checkpoints and metrics go.
        lr: the peak rate at this run's global batch, with the rule that carried it there.
        steps_per_epoch: optimizer steps in one pass over this rank's loader.
        total_steps: optimizer steps in the run (at its starting global batch, which ``--batch-ramp`` may grow).
        epoch_batches: micro-batches in one pass over this rank's loader.
        warmup: the schedule's warm-up steps.
        utilization: the model's counted FLOPs per sample against the devices' peak (MFU).
    """

    train: TrainConfig
    run_dir: Path
    lr: LRPlan
    steps_per_epoch: int
    total_steps: int
    warmup: int
    utilization: Utilization
    epoch_batches: int

    @property
    def global_batch(self) -> int:
        """The run's starting global batch."""
        return self.lr.global_batch

    @property
    def total_samples(self) -> int:
        """Samples in the run: its length whatever batch it trains at."""
        return self.total_steps * self.global_batch

    @property
    def epochs(self) -> int:
        """Passes over the data the run begins."""
        return math.ceil(self.total_steps / self.steps_per_epoch)


def build_plan(cfg: RunConfig, run_dir: Path, lr: LRPlan, train_batches: int, task: Task,
               dist: DistInfo) -> RunPlan:
    """The plan of a run in ``run_dir`` at peak rate ``lr`` whose loader yields ``train_batches`` micro-batches per
    rank and epoch; counts the model's FLOPs (rank 0) and measures the device peak, once."""
    steps_per_epoch = train_batches // cfg.train.grad_accum
    if steps_per_epoch == 0:
        raise UserError(f"one epoch holds fewer than --grad-accum {cfg.train.grad_accum} batches per rank; "
                        "add samples or lower --batch-size/--grad-accum")
    total = plan_steps(steps_per_epoch, cfg.train.epochs, cfg.train.max_steps)
    return RunPlan(cfg.train, run_dir, lr, steps_per_epoch, total,
                   default_warmup(cfg.optim, total, lr.factor),
                   Utilization.for_run(task, cfg.train.precision, dist), train_batches)


@dataclass(frozen=True)
class RunParts:
    """What the loop calls.

    Attributes:
        strategy: an already set-up strategy (``setup`` returned ``model`` and the optimizer ``schedule`` drives).
        model: the callable ``strategy.setup`` returned.
        schedule: sets the learning rate for each optimizer step.
        data: loaders and sampler.
        task: evaluates the model and names its metrics.
        logger: a JSONL/W&B logger on rank 0, a null logger elsewhere.
        checkpoints: saves resumable checkpoints when due; None disables them.
        control: per-step agreement across ranks (preemption, non-finite steps, timed saves).
        watchdog: told about each finished step and printed line (heartbeats, hang detection); None: no watchdog.
        ramp: the global batch each step takes (``--batch-ramp``, restored before the run's record is written);
            None: the config's, throughout.
    """

    strategy: Strategy
    model: nn.Module
    schedule: LRSchedule
    data: Data
    task: Task
    logger: FanOut | NullLogger
    checkpoints: CheckpointManager | None = None
    control: StepControl | None = None
    watchdog: Watchdog | None = None
    ramp: BatchRamp | None = None
