"""The one training loop, shared by every strategy and launcher.

It talks to the distributed engine only through :class:`~scale_ocr.strategies.Strategy`; there
is no branch on a strategy's name or class here.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from scale_ocr.checkpoint import CheckpointManager
from scale_ocr.config import TrainConfig
from scale_ocr.data.loader import Data
from scale_ocr.distributed import all_reduce_max, all_reduce_sum
from scale_ocr.errors import UserError
from scale_ocr.evaluation import evaluate
from scale_ocr.optim import LRSchedule
from scale_ocr.precision import autocast_factory
from scale_ocr.profiling import StepProfiler
from scale_ocr.strategies import Strategy


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA max allocated on GPU, peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def plan_steps(steps_per_epoch: int, epochs: int, max_steps: int | None) -> int:
    """Optimizer steps in the run: ``epochs`` worth, capped by ``max_steps``."""
    total = steps_per_epoch * epochs
    return min(total, max_steps) if max_steps else total


@dataclass
class RunState:
    """Counters the loop advances."""

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0  # optimizer steps done in the current epoch
    timed_steps: int = 0
    timed_seconds: float = 0.0
    epoch_loss: list[torch.Tensor] = field(default_factory=list)
    best: tuple[float, float] | None = None  # (exact_match, -val_loss)
    last_eval: dict[str, float] = field(default_factory=dict)


class Window:
    """Steps since the last log line. Losses and grad norms stay on the device until logged, so
    the loop never waits on the GPU between steps."""

    def __init__(self, start: float) -> None:
        self.start, self.losses, self.stats, self.lr = start, [], None, 0.0

    def add(self, loss: torch.Tensor, stats, lr: float) -> None:
        self.losses.append(loss)
        self.stats, self.lr = stats, lr


class Trainer:
    """Trains ``model`` under ``strategy``; rank 0 writes models and metrics to ``run_dir``.

    Args:
        strategy: an already set-up strategy (``setup`` returned ``model`` and ``optimizer``).
        model: the callable returned by ``strategy.setup``.
        schedule: sets the learning rate for each optimizer step.
        data: loaders, sampler and vocabulary.
        cfg: the train section (batch, accumulation, precision, logging cadence).
        logger: a JSONL/W&B logger on rank 0, a null logger elsewhere.
        run_dir: where models and metrics go.
        total_steps: optimizer steps in the run.
        checkpoints: saves resumable checkpoints when due; None disables them.
    """

    def __init__(self, strategy: Strategy, model: nn.Module, schedule: LRSchedule, data: Data, cfg: TrainConfig,
                 logger, run_dir: Path, total_steps: int, checkpoints: CheckpointManager | None = None) -> None:
        self.strategy, self.model, self.schedule, self.data, self.cfg = strategy, model, schedule, data, cfg
        self.logger, self.run_dir, self.total_steps = logger, run_dir, total_steps
        self.checkpoints, self.last_saved = checkpoints, -1
        self.resume_samples = 0  # samples of the current epoch a restored checkpoint already consumed
        self.device = strategy.dist.device
        self.autocast = autocast_factory(cfg.precision, self.device)
        self.global_batch = cfg.batch_size * cfg.grad_accum * strategy.world_size
        self.steps_per_epoch = len(data.train_loader) // cfg.grad_accum
        if self.steps_per_epoch == 0:
            raise UserError(
                f"one epoch holds fewer than --grad-accum {cfg.grad_accum} batches per rank; "
                "add samples or lower --batch-size/--grad-accum"
            )
        # Steps up to this one are allocator/engine warm-up and are not timed for samples/s.
        self.warmup_steps = min(5, max(0, total_steps // 4))
        self.timing_start: tuple[float, int] | None = None
        # The last --profile-steps steps are profiled, and left out of samples/s (the profiler slows them).
        self.timing_end = total_steps - cfg.profile_steps
        self.profiler = (StepProfiler(run_dir, self.timing_end + 1, total_steps, self.device, strategy.is_main)
                         if cfg.profile_steps else None)
        self.state = RunState()
        # A live bar on a terminal; plain log lines (one per --log-every) in files and CI logs.
        self.interactive = strategy.is_main and sys.stderr.isatty()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _start_timing(self) -> None:
        if self.warmup_steps <= self.state.step < self.timing_end and self.timing_start is None:
            self.timing_start = (self._now(), self.state.step)

    def _stop_timing(self) -> None:
        """Close the timed stretch (before evaluation, which is not training throughput)."""
        if self.timing_start is not None:
            t0, step0 = self.timing_start
            self.state.timed_seconds += self._now() - t0
            self.state.timed_steps += self.state.step - step0
            self.timing_start = None

    def fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        bar = tqdm(total=self.total_steps, desc="train", disable=not self.interactive, dynamic_ncols=True,
                   mininterval=1.0)
        bar.update(self.state.step)
        epochs = math.ceil(self.total_steps / self.steps_per_epoch)
        while self.state.epoch < epochs and self.state.step < self.total_steps:
            self.train_epoch(bar)
            self._stop_timing()
            self.end_epoch()
            self.state.epoch += 1
            self.state.epoch_step = 0
        bar.close()
        if self.checkpoints is not None and self.checkpoints.cfg.save_every and self.last_saved != self.state.step:
            self.save_checkpoint()
        return self.finish(time.perf_counter() - start)

    def trainer_state(self) -> dict[str, Any]:
        """Everything besides model and optimizer that a resumed run needs to continue exactly."""
        return {
            "step": self.state.step, "epoch": self.state.epoch, "epoch_step": self.state.epoch_step,
            "samples_in_epoch": self.state.epoch_step * self.global_batch, "global_batch": self.global_batch,
            "schedule": self.schedule.state_dict(), "best": list(self.state.best) if self.state.best else None,
        }

    def restore(self, meta: dict[str, Any]) -> None:
        """Continue from a checkpoint's trainer state (model and optimizer are already loaded)."""
        self.state.step, self.state.epoch = meta["step"], meta["epoch"]
        self.schedule.load_state_dict(meta["schedule"])
        self.state.best = tuple(meta["best"]) if meta.get("best") else None
        self.resume_samples = meta["samples_in_epoch"]

    def save_checkpoint(self) -> None:
        self._stop_timing()  # checkpoint I/O is not training throughput
        self.checkpoints.save(self.strategy, self.trainer_state())
        self.last_saved = self.state.step

    def train_epoch(self, bar: tqdm) -> None:
        sampler = self.data.train_sampler
        sampler.set_epoch(self.state.epoch)
        # A resumed run continues the epoch's global sample order where the checkpoint left it.
        sampler.skip_global(self.resume_samples)
        self.resume_samples = 0
        steps = len(self.data.train_loader) // self.cfg.grad_accum
        self.state.epoch_step = self.steps_per_epoch - steps
        self.model.train()
        batches = iter(self.data.train_loader)
        self.state.epoch_loss = []
        self._start_timing()
        window = Window(self._now())
        for _ in range(steps):
            if self.state.step >= self.total_steps:
                break
            if self.profiler is not None:
                if self.state.step == self.timing_end:
                    self._stop_timing()
                self.profiler.before_step(self.state.step + 1)
            loss = self.train_step(batches)
            stats = self.strategy.step()
            window.add(loss, stats, self.schedule.lr)  # the rate this step used
            self.schedule.step()
            self.state.step += 1
            self.state.epoch_step += 1
            self.state.epoch_loss.append(loss)
            if self.profiler is not None:
                self.profiler.after_step(self.state.step)
            if self.checkpoints is not None and self.checkpoints.due(self.state.step):
                self.save_checkpoint()
            self._start_timing()
            bar.update(1)
            if self.state.step % self.cfg.log_every == 0 or self.state.step == self.total_steps:
                self.log_window(window, bar)
                window = Window(self._now())

    def train_step(self, batches) -> torch.Tensor:
        """Forward and backward over ``grad_accum`` micro-batches; returns their mean loss (on device)."""
        total = torch.zeros((), device=self.device)
        for micro in range(self.cfg.grad_accum):
            batch = next(batches).to(self.device)
            sync = micro == self.cfg.grad_accum - 1
            with self.strategy.no_sync() if not sync else contextlib.nullcontext():
                with self.autocast():
                    out = self.model(batch.images, batch.targets, batch.target_lengths)
                loss = out["loss"].mean()  # DataParallel returns one loss per replica
                self.strategy.backward(loss)
            total += loss.detach().float()
        return total / self.cfg.grad_accum

    def log_window(self, window: Window, bar: tqdm) -> None:
        elapsed = self._now() - window.start
        n_steps = len(window.losses)
        # Collective on every rank at the same steps, so no rank waits on another.
        mem = peak_memory_bytes(self.device)
        loss_sum, n, mem_sum = all_reduce_sum([float(torch.stack(window.losses).sum()), n_steps, mem], self.device)
        stats = window.stats
        metrics = {
            "train/loss": loss_sum / max(n, 1),
            "train/lr": window.lr,
            "train/grad_norm": float(stats.grad_norm),
            "train/samples_per_sec": n_steps * self.global_batch / max(elapsed, 1e-9),
            "train/step_time": elapsed / max(n_steps, 1),
            "train/epoch": self.state.epoch,
            "memory/peak_bytes_max": all_reduce_max(mem, self.device),
            "memory/peak_bytes_mean": mem_sum / self.strategy.world_size,
        }
        if stats.loss_scale is not None:
            metrics["train/loss_scale"] = stats.loss_scale
        self.logger.log(metrics, self.state.step)
        bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", sps=f"{metrics['train/samples_per_sec']:.0f}")
        if self.strategy.is_main and not self.interactive:
            print(f"step {self.state.step}/{self.total_steps} loss={metrics['train/loss']:.4f} "
                  f"lr={metrics['train/lr']:.2e} grad_norm={metrics['train/grad_norm']:.3f} "
                  f"samples/s={metrics['train/samples_per_sec']:.1f}", flush=True)

    def end_epoch(self) -> None:
        self.data.train_sampler.skip_global(0)
        if not self.cfg.eval:
            state = self.strategy.full_state_dict()  # collective: every rank takes part
            if state is not None:
                _save(state, self.run_dir / "last_model.pt")
            return
        result = evaluate(self.model, self.data.val_loader, self.data.vocab, self.device, self.autocast)
        self.state.last_eval = result.metrics
        self.logger.log({f"val/{k}": v for k, v in result.metrics.items()} | {"epoch": self.state.epoch},
                        self.state.step)
        self.logger.log_examples(result.examples, self.state.step)
        state = self.strategy.full_state_dict()  # collective: every rank takes part
        score = (result.metrics["exact_match"], -result.metrics["val_loss"])
        improved = self.state.best is None or score > self.state.best
        if improved:
            self.state.best = score
        if state is not None:
            _save(state, self.run_dir / "last_model.pt")
            if improved:
                _save(state, self.run_dir / "best_model.pt")
        if self.strategy.is_main:
            m = result.metrics
            tqdm.write(f"epoch {self.state.epoch + 1}: val_loss={m['val_loss']:.4f} "
                       f"exact_match={m['exact_match']:.2%} cer={m['cer']:.4f}")

    def finish(self, wall: float) -> dict[str, Any]:
        peak = all_reduce_max(peak_memory_bytes(self.device), self.device)
        losses = self.state.epoch_loss
        local = float(torch.stack(losses).sum()) if losses else 0.0
        loss_sum, n = all_reduce_sum([local, len(losses)], self.device)
        sps = (self.state.timed_steps * self.global_batch / self.state.timed_seconds
               if self.state.timed_seconds > 0 else float("nan"))
        ev = self.state.last_eval
        return {
            "world_size": self.strategy.world_size,
            "global_batch": self.global_batch,
            "steps": self.state.step,
            "epochs": self.state.epoch,
            "train_loss": loss_sum / n if n else None,  # None: nothing trained (resumed at the last step)
            "val_loss": ev.get("val_loss"),
            "exact_match": ev.get("exact_match"),
            "ci_match": ev.get("ci_match"),
            "cer": ev.get("cer"),
            "best_exact_match": self.state.best[0] if self.state.best else None,
            "samples_per_sec": sps,
            "peak_memory_bytes": int(peak),
            "peak_reserved_bytes": (int(all_reduce_max(torch.cuda.max_memory_reserved(self.device), self.device))
                                    if self.device.type == "cuda" else None),
            "state_bytes": self._state_bytes(),
            "comm_share": self._comm_share(),
            "wall_seconds": wall,
        }

    def _comm_share(self) -> float | None:
        """Largest share over ranks of profiled time with a collective in flight (None unless profiled)."""
        if self.profiler is None:
            return None
        share = all_reduce_max(self.profiler.share if self.profiler.share is not None else -1.0, self.device)
        return share if share >= 0 else None

    def _state_bytes(self) -> dict[str, int] | None:
        """Model-state bytes by category, the largest over ranks (sharded engines split unevenly)."""
        report = self.strategy.memory_report()
        fields = ("params", "grads", "optimizer", "other", "host", "model_state")
        local = report.as_dict() if report is not None else dict.fromkeys(fields, -1)
        peak = {k: int(all_reduce_max(local[k], self.device)) for k in fields}  # same calls on every rank
        return peak if peak["model_state"] >= 0 else None


def _save(state: dict[str, Any], path: Path) -> None:
    """Atomic save: a crash mid-write leaves the previous file intact."""
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    torch.save(state, tmp)
    tmp.replace(path)
