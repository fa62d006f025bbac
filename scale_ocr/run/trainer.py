"""The one training loop, shared by every strategy and launcher.

It talks to the distributed engine only through :class:`~scale_ocr.strategies.Strategy`; there
is no branch on a strategy's name or class here.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from scale_ocr.checkpoint.model_files import NonFiniteWeights, whole_bytes, write_whole_model
from scale_ocr.disk import DiskFault, defer, pending, size_text, take_pending
from scale_ocr.distributed.process_group import all_reduce_max, all_reduce_sum
from scale_ocr.errors import RunStopped, UserError, memory_for, say
from scale_ocr.memory.meter import ActivationProbe
from scale_ocr.precision import autocast_factory, gemm_factory
from scale_ocr.run.batch_ramp import BatchRamp
from scale_ocr.run.breakdown import StepClock
from scale_ocr.run.control import EXIT_PREEMPTED, StepControl, StopSignal, WeightCheck
from scale_ocr.run.loop_state import RunState, Window
from scale_ocr.run.noise_scale import NoiseMeter
from scale_ocr.run.plan import RunParts, RunPlan
from scale_ocr.run.profiling import StepProfiler
from scale_ocr.run.summary import peak_memory_bytes, run_summary
from scale_ocr.tasks.base import EvalResult

EXIT_DIVERGED = 4  # --max-bad-steps consecutive non-finite steps


class Trainer:
    """Trains ``parts.model`` under ``parts.strategy`` as ``plan`` says; rank 0 writes models and metrics to
    ``plan.run_dir``.

    Args:
        plan: what the run derived once (global batch, steps, rate plan, run directory, FLOPs).
        parts: the set-up strategy and model, the schedule, data, task, logger, checkpoints, control and watchdog.
    """

    def __init__(self, plan: RunPlan, parts: RunParts) -> None:
        self.plan, self.cfg = plan, plan.train
        self.strategy, self.model, self.schedule, self.data = parts.strategy, parts.model, parts.schedule, parts.data
        self.task, self.logger, self.checkpoints = parts.task, parts.logger, parts.checkpoints
        self.watchdog = parts.watchdog
        self.ramp = parts.ramp or BatchRamp(self.cfg, self.strategy.world_size, plan.lr)
        if self.ramp.auto and not self.strategy.changes_accumulation:
            self.strategy.set_accumulation(self.ramp.accum)  # its refusal, before any step
        self.last_saved = -1
        self.first_step = 0  # the step this job began at (fit() sets it: a resumed job's is its checkpoint's)
        self.recorded_norm: float | None = None  # the weight norm a resumed checkpoint's trainer.json records
        self.control = parts.control or StepControl(StopSignal(), None, self.strategy.is_main)
        self.segment_start, self.epoch_batches = 0, plan.epoch_batches  # the order's first micro-batch; the epoch's
        self.device = self.strategy.dist.device
        self.autocast = autocast_factory(self.cfg.precision, self.device)
        self.gemm = gemm_factory(self.cfg.precision, self.device)  # the backward's products, as the forward's
        # Steps up to this one are allocator/engine warm-up and are not timed for samples/s.
        self.warmup_steps = min(5, max(0, self.plan.total_steps // 4))
        # The last --profile-steps steps are profiled, and left out of samples/s (the profiler slows them).
        self.timing_end = self.plan.total_steps - self.cfg.profile_steps
        self.profiler = (StepProfiler(self.plan.run_dir, self.timing_end + 1, self.plan.total_steps, self.device,
                                      self.strategy.is_main) if self.cfg.profile_steps else None)
        self.clock = StepClock(self.device)  # data, compute, optimizer and other time of each step
        self.activations = ActivationProbe()  # bytes saved for backward by the first micro-batch
        self.noise = NoiseMeter(self.strategy, 0 if self.data.step_samples else self.cfg.noise_every,  # fixed sizes
                                self.cfg.noise_smoothing, self.cfg.batch_size, plan.global_batch, self.device)
        self.state = RunState()
        self.weights = WeightCheck(self.strategy.weight_norm, self.cfg.max_weight_growth)  # measured again in fit()
        # Where the weights fit() starts from came from, and what to do should they be unfit (train.py sets it).
        self.origin = ("the initial weights", "pass --init-from weights that are finite and of ordinary size")
        # A live bar on a terminal; plain log lines (one per --log-every) in files and CI logs.
        self.interactive = self.strategy.is_main and sys.stderr.isatty()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @property
    def total_steps(self) -> int:
        """The run's optimizer steps: the plan's, or where the batch grew, the steps taken and those its remaining
        samples take at the batch it has now."""
        if self.ramp.global_batch == self.plan.global_batch:
            return self.plan.total_steps
        left = max(0, self.plan.total_samples - self.state.samples)
        return self.state.step + -(-left // self.ramp.global_batch)

    def _done(self) -> bool:
        """Whether the run trained the samples asked for (``--epochs``/``--max-steps`` worth; --batch-pixels: steps)."""
        if self.data.step_samples is not None:
            return self.cfg.max_steps is not None and self.state.step >= self.cfg.max_steps
        return self.state.samples >= self.plan.total_samples

    def _start_timing(self) -> None:
        if self.warmup_steps <= self.state.step < self.timing_end:
            self.state.start_timing(self._now())

    def _stop_timing(self) -> None:
        """Close the timed stretch (before evaluation, which is not training throughput)."""
        if self.state.timing_start is not None:  # no wait for the device otherwise
            self.state.stop_timing(self._now())

    def fit(self) -> dict[str, Any]:
        start = time.perf_counter()
        self.weights = WeightCheck(self.strategy.weight_norm, self.cfg.max_weight_growth)  # as resumed, if it was
        unfit = self.weights.unfit_start(self.recorded_norm)  # every rank: the same weights, the same answer
        if unfit:
            raise UserError(f"{self.origin[0]} {unfit} before any step: a model that cannot train; {self.origin[1]}")
        bar = tqdm(total=self.total_steps, desc="train", disable=not self.interactive, dynamic_ncols=True,
                   mininterval=1.0)
        bar.update(self.state.step)
        self.first_step = self.state.step  # where this job began (a resumed one: the checkpoint's step)
        if self.ramp.auto and self.strategy.is_main:
            say(self.ramp.plan_line(self.plan.total_samples))
        while self.state.epoch < self.plan.epochs and not self._done():
            self.train_epoch(bar)
            self.ended_at = self.data_position()  # where the last step left the data: the run's draws
            self._stop_timing()
            self.end_epoch()
            self.state.epoch += 1
            self.state.epoch_step = 0
        bar.close()
        return run_summary(self, time.perf_counter() - start)

    def trainer_state(self) -> dict[str, Any]:
        """Everything besides model and optimizer that a resumed run needs to continue exactly."""
        return {
            "step": self.state.step, "epoch": self.state.epoch, "epoch_step": self.state.epoch_step,
            "samples_in_epoch": self.state.epoch_micro * self.ramp.per_accum, "global_batch": self.ramp.global_batch,
            "samples": self.state.samples, "batch_ramp": self.ramp.state_dict(), "data_position": self.data_position(),
            "steps_per_epoch": self.plan.steps_per_epoch,
            "schedule": self.schedule.state_dict(), "best": list(self.state.best) if self.state.best else None,
            "metrics_records": self.logger.records(),  # lines of metrics.jsonl this state accounts for
            # Saved only after a good step: this records that its weights were finite and within the bound.
            "weights": self.weights.record(),
            "loss": float(self.state.epoch_loss[-1]) if self.state.epoch_loss else None,
            "data": self.data.identity(),  # compared on resume (scale_ocr.run.same_data)
            "noise_scale": self.noise.scale.state_dict(),  # its averages continue on resume
        }

    def data_position(self) -> dict[str, Any]:
        """Where the data stands, in samples and free of world size: the order's rest (shards) or its count."""
        return self.data.position.state(self.state.epoch, max(0, self.state.epoch_micro - self.segment_start))

    def restore(self, meta: dict[str, Any]) -> str:
        """Continue from a checkpoint's trainer state (model and optimizer are already loaded).

        Progress is kept in samples (epoch and samples into it), so a run resumed with another world
        size, batch size or accumulation re-expresses its step count in this run's optimizer steps and
        still trains to ``--epochs``/``--max-steps``. Returns a line describing where it continues.
        """
        epoch, samples = meta["epoch"], meta["samples_in_epoch"]
        plan = self.plan
        trained = meta.get("samples")
        if self.ramp.resumed and isinstance(trained, int) and not isinstance(trained, bool) and trained >= 0:
            step, same = meta["step"], True  # a ramp's steps are counted as they were taken, its length in samples
        else:
            same = meta.get("global_batch") == plan.global_batch and meta.get(
                "steps_per_epoch", plan.steps_per_epoch) == plan.steps_per_epoch
            step = meta["step"] if same else epoch * plan.steps_per_epoch + samples // plan.global_batch
            trained = step * plan.global_batch
        self.state.step, self.state.epoch, self.state.samples = step, epoch, trained
        if self.ramp.accum != self.ramp.start_accum:
            self.ramp.apply(self.strategy, self.noise, self.schedule)
        self.schedule.load_state_dict({**meta["schedule"], "step_count": step, "samples": trained})
        self.state.best = tuple(meta["best"]) if meta.get("best") else None
        self.recorded_norm = (meta.get("weights") or {}).get("norm") if isinstance(meta.get("weights"), dict) else None
        self.data.position.restore(epoch, samples, meta.get("data_position"))  # old checkpoints: samples only
        noise_note = ""
        if isinstance(meta.get("noise_scale"), dict) and meta["noise_scale"].get("count") and self.noise.measures:
            if not self.noise.scale.load_state_dict(meta["noise_scale"]):
                noise_note = self.noise.scale.restart_note(meta["noise_scale"])
        where = f"at step {meta['step']}"
        if not same:
            where += (f" (epoch {epoch + 1}, {samples} samples into it; step {step} at this run's global batch of "
                      f"{self.plan.global_batch} instead of {meta.get('global_batch')})")
        if self.ramp.resume_note:
            where += f", {self.ramp.resume_note}"
        if noise_note:
            where += f", {noise_note}"
        if self._done():
            raise UserError(f"nothing to train: the checkpoint {where} already reaches this run's last step "
                            f"({self.plan.total_steps}: --epochs {self.cfg.epochs}, --max-steps {self.cfg.max_steps}); "
                            "raise --epochs or --max-steps to train on, or pass --resume none to start afresh")
        return f"{where}; {self.schedule.resume_note}"  # the peak rate it continues at: --lr-on-resume

    def save_checkpoint(self) -> None:
        self._stop_timing()  # checkpoint I/O is not training throughput
        self.checkpoints.save(self.strategy, self.trainer_state())
        self.last_saved = self.state.step
        self.control.saved()

    def train_epoch(self, bar: tqdm) -> None:
        batches = self._begin_epoch()
        self._start_timing()
        window = Window(self._now(), self.state.flops)
        while self._epoch_has_step() and not self._done():
            if self.profiler is not None:
                if self.state.step == self.timing_end:
                    self._stop_timing()
                self.profiler.before_step(self.state.step + 1)
            self.clock.begin(timed=self.state.timing_start is not None)
            loss, waited = self.train_step(batches)
            window.data_seconds += waited
            if self.state.timing_start is not None:
                self.state.timed_data_seconds += waited
            stats = self.strategy.step()
            self.clock.lap("optimizer")
            agreed = self.control.agree(bool(torch.isfinite(loss)), stats.norm_ok, weights=self.weights)
            measured = self.noise.due(self.state.step + 1)  # a collective, on every rank at the same steps
            read = measured and self.noise.record(stats.grad_norm,
                                                  not (agreed.nonfinite or agreed.bad_weights or stats.skipped))
            first = self.state.epoch_micro - self.segment_start  # micro-batches of the loader's order taken before
            lr, batch = self.schedule.lr, self.data.taken(first, self.ramp.accum, self.ramp.global_batch)  # this step's
            self._advance(batch)
            if agreed.nonfinite or agreed.bad_weights:
                self._bad_step(stats, agreed.nonfinite)
            else:
                self.state.bad_steps = 0
                window.add(loss, stats, lr, batch)
                self.state.epoch_loss.append(loss)
            if self.watchdog is not None:
                self.watchdog.progress(self.state.step, self.total_steps)
            bar.total = self.total_steps
            bar.update(1)
            # The batch the next steps take (a larger one may end the epoch): a collective at the measured steps.
            change = self.ramp.after_reading(self.noise, read, self.state, self.device) if measured else None
            if change is not None:
                self.ramp.apply(self.strategy, self.noise, self.schedule)
            if self.state.step % self.cfg.log_every == 0 or self._last_step():
                self.log_window(window, bar)  # before a save, so the checkpoint accounts for this record
                window = Window(self._now(), self.state.flops)
            if change is not None and self.strategy.is_main:
                say(self.ramp.describe(change, self.schedule.line))  # after the line of the step it follows
            self.clock.end_step()  # saves and validation below are not step time
            if self.profiler is not None:
                self.profiler.after_step(self.state.step)
            if agreed.stop:  # preempted: save at once (a validation could outlast the grace period), then end
                self._checkpoint(window)
                self._preempted()
            if (self.cfg.eval and self.cfg.eval_every and self.state.step % self.cfg.eval_every == 0
                    and self._epoch_has_step() and not self._done()):  # end_epoch validates the epoch's last step
                self._stop_timing()  # validation is not step time
                window.start += self._timed(self.validate)
            # After the step's validation, so a checkpoint holds its record and best (a resumed run does not
            # validate that step again: its curve would lose the point).
            if agreed.save or (self.checkpoints is not None and self.checkpoints.due(self.state.step)):
                self._checkpoint(window)
            self._start_timing()

    def _begin_epoch(self):
        """The epoch's batches: its sample order, or for a resumed run its rest, where the checkpoint left it."""
        self.data.position.set_epoch(self.state.epoch)
        left = len(self.data.train_loader)  # micro-batches of this epoch each rank takes from here
        self.state.epoch_micro = self.segment_start = max(0, self.plan.epoch_batches - left)
        self.epoch_batches = self.state.epoch_micro + left  # --batch-pixels: each epoch has its own count
        self.state.epoch_step = max(0, self.plan.steps_per_epoch - left // self.ramp.accum)
        self.model.train()
        self.state.epoch_loss = []
        return iter(self.data.train_loader)

    def _advance(self, batch: int) -> None:
        """Count the step just taken: ``batch`` samples, the ramp's accumulation of micro-batches on each rank."""
        self.schedule.step(batch)
        self.state.step += 1
        self.state.epoch_step += 1
        self.state.epoch_micro += self.ramp.accum
        self.state.samples += batch

    def _timed(self, fn) -> float:
        t0 = self._now()
        fn()
        return self._now() - t0

    def _last_step(self) -> bool:
        """Whether the step just taken is the run's last."""
        return self._done() or (self.state.epoch + 1 >= self.plan.epochs and not self._epoch_has_step())

    def _epoch_has_step(self) -> bool:
        """Whether the epoch holds another whole optimizer step for each rank (a rest smaller than one is left)."""
        return self.epoch_batches - self.state.epoch_micro >= self.ramp.accum

    def _checkpoint(self, window: Window) -> None:
        """A checkpoint of this step, unless in a non-finite streak (the last good checkpoint stays the newest)."""
        if self.checkpoints is not None and self.state.bad_steps == 0:
            window.start += self._timed(self.save_checkpoint)  # checkpoint I/O is not step time

    def _bad_step(self, stats, nonfinite: bool) -> None:
        """A NaN/inf loss or gradient (the engine skipped the update on every rank), or updated weights that are
        NaN/inf or past their bound (nothing is written until a step is good again): count it, stop on a streak."""
        self.state.bad_steps += 1
        self.state.skipped_steps += 1
        self.logger.log({"train/nonfinite_steps": self.state.skipped_steps}, self.state.step)
        what = (f"non-finite loss or gradient (grad_norm={float(stats.grad_norm)}); update skipped on every rank"
                if nonfinite else f"the updated weights {self.weights.describe()}; no checkpoint until a good step")
        if self.strategy.is_main:
            say(f"scale-ocr: warning: step {self.state.step}: {what} ({self.state.bad_steps} in a row, "
                f"--max-bad-steps {self.cfg.max_bad_steps})", err=True)
        if self.state.bad_steps >= self.cfg.max_bad_steps:
            raise self._diverged()

    def _diverged(self) -> RunStopped:
        """The end of a run whose last steps were bad (:meth:`_bad_step`), exit :data:`EXIT_DIVERGED`."""
        return RunStopped(f"training diverged: {self.state.bad_steps} consecutive steps up to step "
                          f"{self.state.step} had a NaN/inf loss or gradient, or weights NaN/inf or past "
                          f"--max-weight-growth; {self._kept_then('lower --lr or --clip-grad')}", EXIT_DIVERGED)

    def _kept_then(self, fix: str) -> str:
        """What a run that ends on a bad state keeps, and ``fix`` with the way to go on that exists: resume from the
        last good checkpoint, or start again when none was kept."""
        name = self.checkpoints.latest_name() if self.checkpoints is not None else None
        if name:
            return (f"the last good checkpoint, {name}{WeightCheck.of_checkpoint(self.plan.run_dir / name)}, is kept "
                    f"and no model was written from this state; {fix} and run again: `--resume auto` (the default) "
                    "continues from it")
        if self.first_step:  # resumed from a checkpoint elsewhere (--resume PATH), none written here since
            return (f"no checkpoint was saved after step {self.first_step}, where this job resumed, and no model was "
                    f"written from this state; {fix}, and resume again, from an earlier checkpoint if that one keeps "
                    "failing, or pass --resume none to start afresh")
        return (f"no checkpoint was saved and no model was written from this state; {fix} and run again (there is "
                "nothing to resume: it starts afresh)")

    def _preempted(self) -> None:
        name = self.control.stop.received or "a preemption signal on another rank"
        where = self.checkpoints.latest_name() if self.checkpoints is not None else None
        raise RunStopped(f"{name} received: stopped after step {self.state.step} of {self.total_steps}"
                         + (f", checkpoint {where} written" if where else "")
                         + "; run the same command again (`--resume auto` is the default) to continue",
                         EXIT_PREEMPTED, prefix="stopped")

    def train_step(self, batches) -> tuple[torch.Tensor, float]:
        """Forward and backward over ``grad_accum`` micro-batches; returns their mean loss (on device) and the
        seconds spent waiting for the loader's batches."""
        total, waited = torch.zeros((), device=self.device), 0.0
        if self.noise.due(self.state.step + 1):
            self.noise.begin()
        accum = self.ramp.accum
        for micro in range(accum):
            t0 = time.perf_counter()
            batch = next(batches).to(self.device)
            waited += time.perf_counter() - t0
            self.state.flops += self.plan.utilization.billed(len(batch), self.task.input_width(batch))
            self.clock.lap("data")
            sync = micro == accum - 1
            with self.strategy.no_sync() if not sync else contextlib.nullcontext():
                with self.autocast(), self.activations.watch(self.model):
                    out = self.model(*batch.inputs)
                self.clock.forward_done()  # on a GPU, the straggler share compares each rank's forward work
                loss = out["loss"]
                with self.gemm():
                    self.strategy.backward(loss)
            self.noise.end_micro()
            self.clock.lap("compute", then="optimizer" if sync else "data")
            total += loss.detach().float()
        self.noise.end_backward()
        return total / accum, waited

    def log_window(self, window: Window, bar: tqdm) -> None:
        elapsed = self._now() - window.start
        n_steps = len(window.losses)
        # Collective on every rank at the same steps, so no rank waits on another.
        mem = peak_memory_bytes(self.device)
        local = float(torch.stack(window.losses).sum()) if window.losses else 0.0
        share = window.data_seconds / max(elapsed, 1e-9)
        loss_sum, n, mem_sum, share_sum, flops = all_reduce_sum(
            [local, n_steps, mem, share, self.state.flops - window.flops_before], self.device)
        stats = window.stats
        if stats is None:  # every step of the window was non-finite and skipped (reported as such)
            return
        metrics = {
            "train/loss": loss_sum / max(n, 1),
            "train/lr": window.lr,
            "train/grad_norm": float(stats.grad_norm),
            "train/samples_per_sec": window.samples / max(elapsed, 1e-9),
            "train/step_time": elapsed / max(n_steps, 1),
            "train/data_share": share_sum / self.strategy.world_size,  # of step time, waiting for the loader
            "train/epoch": self.state.epoch,
            "memory/peak_bytes_max": all_reduce_max(mem, self.device),
            "memory/peak_bytes_mean": mem_sum / self.strategy.world_size,
            **self.plan.utilization.metrics(flops / max(elapsed, 1e-9)),
            **self.noise.metrics(),  # B_simple and its parts, as smoothed up to this step
            **({"train/global_batch": window.batch} if self.ramp.auto else {}),  # the batch the ramp reached
        }
        if stats.loss_scale is not None:
            metrics["train/loss_scale"] = stats.loss_scale
        self.logger.log(metrics, self.state.step)
        bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", sps=f"{metrics['train/samples_per_sec']:.0f}")
        if self.strategy.is_main and not self.interactive:
            say(f"step {self.state.step}/{self.total_steps} loss={metrics['train/loss']:.4f} "
                f"lr={metrics['train/lr']:.2e} grad_norm={metrics['train/grad_norm']:.3f} "
                f"samples/s={metrics['train/samples_per_sec']:.1f} "
                f"{self.plan.utilization.describe(flops / max(elapsed, 1e-9))} {self.noise.describe()}".rstrip())
        if self.watchdog is not None:
            self.watchdog.printed()

    def validate(self) -> EvalResult:
        """Evaluate on the validation set on every rank and log ``val/*`` at this step."""
        self.strategy.sync_buffers()  # every rank evaluates the model rank 0 holds
        result = self.task.evaluate(self.model, self.data.val_loader, self.device, self.autocast)
        self.state.last_eval = result.metrics
        self.logger.log({f"val/{k}": v for k, v in result.metrics.items()} | {"epoch": self.state.epoch,
                                                                              "samples": self.state.samples},
                        self.state.step)
        self.logger.log_examples(result.examples, self.state.step)
        return result

    def end_epoch(self) -> None:
        """Validate (with --eval), then a checkpoint of this step (after the last step, and before the whole-model
        files), then the whole-model files.

        The checkpoint comes first: each rank writes it from what it holds, with no gathering, so it fits wherever
        training fits, and if the model files cannot be written after it, nothing trained is lost.
        """
        last = self._done() or self.state.epoch + 1 >= self.plan.epochs
        # A run that runs out of steps inside a streak shorter than --max-bad-steps did not train what was asked when
        # no step of this job was good, or when its weights are unfit to write: it ends as the streak would have.
        if last and self.state.bad_steps and (self.state.bad_steps >= self.state.step - self.first_step
                                              or not self.weights.ok):
            raise self._diverged()
        improved, unusable = False, None
        if self.cfg.eval:
            result = self.validate()
            score = self.task.score(result.metrics)
            # A NaN validation loss (outputs not finite, though the weights passed their check) is never "best", and
            # nothing is written from those weights: no checkpoint, no model file; the run's last epoch ends exit 4.
            unusable = None if math.isfinite(score[1]) else result.metrics["val_loss"]
            improved = unusable is None and (self.state.best is None or score > self.state.best)
            if improved:
                self.state.best = score
            if unusable is not None:
                self._unusable(unusable, last)
        # A checkpoint of this step: after the last (so `--resume auto` on a finished run knows there is nothing left
        # to train), and before the model files (so one that fails loses nothing).
        if ((last or self.cfg.save_model) and self.checkpoints is not None and self.checkpoints.at_end
                and self.last_saved != self.state.step and self.state.bad_steps == 0 and unusable is None
                and self.weights.fine("the checkpoint" if not last else "the final checkpoint", self.strategy.is_main)):
            self.save_checkpoint()
        if self.cfg.save_model and unusable is None:  # every rank has the same (reduced) validation loss
            self._write_models(improved)
        self._end_on_disk_fault(all_reduce_max(float(pending() is not None), self.device) > 0)  # one per epoch
        if self.cfg.eval and self.strategy.is_main:
            tqdm.write(f"epoch {self.state.epoch + 1}: val_loss={result.metrics['val_loss']:.4f} "
                       f"{self.task.format_metrics(result.metrics)}")

    def _unusable(self, val_loss: float, last: bool) -> None:
        """A validation loss that is NaN/inf: said; at the run's last epoch, the end (exit 4), before anything is
        written from these weights; earlier, a warning, and the epoch writes nothing (the loop trains on)."""
        what = (f"the validation loss at step {self.state.step} is {val_loss}: the model's outputs on the validation "
                "set are not finite, though its weights passed the weight check")
        fix = "check the validation data, lower --lr or --clip-grad"
        if last and self.last_saved == self.state.step:  # its checkpoint was due before this validation
            raise RunStopped(f"{what}; {self.checkpoints.latest_name()}, written before this validation, holds these "
                             f"weights, and no model was written from them; {fix}, and resume from an earlier "
                             "checkpoints/step_N (--resume) or pass --resume none", EXIT_DIVERGED)
        if last:
            raise RunStopped(f"{what}; {self._kept_then(fix)}", EXIT_DIVERGED)
        say(f"scale-ocr: warning: {what}; no checkpoint or model file is written from them this epoch", err=True,
            every_rank=False)

    def _write_models(self, improved: bool) -> None:
        """``last_model.pt`` (and ``best_model.pt`` when ``improved``), piece by piece on rank 0 as every rank
        gathers them; a full disk is held for the agreement that follows (:meth:`end_epoch`)."""
        names = ["last_model.pt"] + ["best_model.pt"] * improved
        if self.weights.fine(names[0], self.strategy.is_main):  # agreed by every rank: all skip it together
            pieces = self.strategy.model_pieces()
            total, largest = whole_bytes(pieces)
            kept = "the previous file, if any, and every checkpoint written are kept"
            with memory_for(f"{' and '.join(names)} ({size_text(total)} in fp32, a tensor at a time: at most "
                            f"{size_text(largest)})", self._model_files_then()):
                try:
                    write_whole_model(pieces, [self.plan.run_dir / n for n in names], self.strategy.is_main, kept=kept)
                except NonFiniteWeights as bad:
                    say(f"scale-ocr: warning: not writing {names[0]}: {bad.name} holds NaN/inf; the previous file, if "
                        "any, is kept", err=True)
                except DiskFault as fault:
                    defer(fault)

    def _model_files_then(self) -> str:
        """What is kept, and what to do, when the model files do not fit in memory."""
        where = self.checkpoints.latest_name() if self.checkpoints is not None else None
        if where and self.last_saved == self.state.step:
            return (f"nothing is lost: {where} holds this step's state (`scale-ocr export {self.plan.run_dir} "
                    "model.safetensors` writes the model from it, a tensor at a time); free memory on this host, or "
                    "pass --no-save-model and export from the checkpoint")
        return ((f"{where}, the newest checkpoint, is kept" if where else "no checkpoint was written")
                + "; free memory on this host, or pass --no-save-model and export from a checkpoint")

    @staticmethod
    def _end_on_disk_fault(agreed: bool) -> None:
        """When the ranks agreed that a rank-0 write met a full disk, end this rank with the fault rank 0 held
        (every rank raises it; rank 0 prints it)."""
        if agreed:
            raise take_pending() or DiskFault("rank 0 could not write to the run directory (its line says why)")
