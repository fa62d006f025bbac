"""Train an OCR model: ``python``, ``torchrun`` or ``deepspeed`` this file, or run ``scale-ocr train``.

Parse the config, start the process group, build model, data and strategy, train, and always
tear the process group down.
"""

from __future__ import annotations

import gc
import math
import sys
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # this process is the job, not a program that imports train
    # The imports below build about a million objects that live until the process ends. Left to the collector,
    # they are walked while they are built, at every full collection of the run and again at exit: 2-3 s of CPU
    # in every rank of every launch. Collection is paused while they are built and they are frozen after (below).
    gc.disable()
if __package__ in (None, ""):
    # Run as a script: put the repository root, not scale_ocr/, first on the path, so the package
    # imports by name and its modules cannot shadow top-level ones.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from scale_ocr.errors import require_installed

require_installed()  # before torch: a Python without it ends in one line

import torch

from scale_ocr.checkpoint.manager import CheckpointManager
from scale_ocr.checkpoint.weights_io import load_initial_weights
from scale_ocr.cli.args import parse_config
from scale_ocr.config import RunConfig
from scale_ocr.distributed.process_env import prepare_process
from scale_ocr.distributed.process_group import (
    DistInfo,
    destroy_distributed,
    ends_the_rest_on_failure,
    init_distributed,
    peek_launch,
    rank_zero_at_rendezvous,
)
from scale_ocr.errors import found_by_every_rank, on_interrupt, report_user_errors, say, shown
from scale_ocr.memory.budget import cap_device_memory
from scale_ocr.memory.host import return_freed_memory
from scale_ocr.optim import LRPlan, LRSchedule, build_optimizer_spec, lr_factor
from scale_ocr.planning.auto import resolve_auto
from scale_ocr.precision import precision_notice
from scale_ocr.run.batch_ramp import BatchRamp
from scale_ocr.run.control import StepControl, StopSignal
from scale_ocr.run.noise_scale import check_every
from scale_ocr.run.plan import RunParts, build_plan, run_lr, scaled_optim
from scale_ocr.run.run_dir import claim
from scale_ocr.run.run_info import describe_run, run_summary_line, write_run_config
from scale_ocr.run.same_data import recorded_data, same_data
from scale_ocr.run.trainer import Trainer
from scale_ocr.run.watchdog import Watchdog
from scale_ocr.strategies import Strategy, check_launch, create_strategy
from scale_ocr.tasks import Task, create_task
from scale_ocr.tracking import build_logger
from scale_ocr.tracking.wandb_logger import wandb_env

if __name__ == "__main__":
    gc.freeze()  # the modules' objects: the collector skips them from now on (the run's own are collected as usual)
    gc.enable()


def run(cfg: RunConfig, dist: DistInfo, stop: StopSignal, watchdog: Watchdog | None = None,
        argv: list[str] | None = None) -> dict:
    """Claim the run directory, build every component from its config section and train; returns the summary.
    ``argv``, the flags the job was given, goes into config.json (``scale-ocr summary`` re-launches the job)."""
    cap_device_memory(dist.device, cfg.train.gpu_memory_cap_gb)  # before anything is allocated
    if dist.device.type == "cpu":
        return_freed_memory()  # under a memory cap, a rank's memory follows its live tensors (memory/host.py)
    run_dir = Path(cfg.output.output_dir)
    lr = run_lr(cfg, dist.world_size)  # the engines get the rate at this run's global batch
    strategy = create_strategy(cfg.strategy, dist, cfg.train, scaled_optim(cfg.optim, lr), run_dir)  # checks the launch
    task = create_task(cfg.model)
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir, dist, task.identity())
    lock, resume_from = claim(run_dir, checkpoints, dist)  # first, so a second job on this directory stops at once
    try:
        control = StepControl(stop, cfg.checkpoint.save_minutes or None, dist.is_main)
        summary = train(cfg, lr, strategy, task, checkpoints, resume_from, control, watchdog, argv)
    finally:
        strategy.teardown()
        lock.release()
    if dist.is_main:
        say(run_summary_line(summary, run_dir, task))
    return summary


def train(cfg: RunConfig, lr: LRPlan, strategy: Strategy, task: Task, checkpoints: CheckpointManager,
          resume_from: Path | None, control: StepControl, watchdog: Watchdog | None, argv: list[str] | None) -> dict:
    """Build the model, the data, the plan and the loop, and train."""
    dist = strategy.dist
    ramp = BatchRamp(cfg.train, dist.world_size, lr)  # its limits are checked before anything is built
    check_every(cfg.train.noise_every, cfg.train.batch_size, lr.global_batch)  # and a noise scale it cannot measure
    load = None if resume_from is not None or not cfg.model.init_from else initial_weights(cfg.model)
    model = strategy.build_model(task.model_factory(load), cfg.train.seed)  # same initial weights on every rank
    torch.manual_seed(cfg.train.seed + 1 + dist.rank)  # per-rank augmentation randomness
    data = task.build_data(cfg.data, cfg.train.batch_size, cfg.train.seed, dist)
    if data.micro_batch is not None:
        lr, ramp = at_mean_batch(cfg, data.micro_batch, dist)
    wrapped, optimizer = strategy.setup(model, build_optimizer_spec(strategy.optim))  # the rate at this batch
    if cfg.strategy.compile:
        strategy.compile(wrapped)
    plan = build_plan(cfg, checkpoints.dir.parent, lr, len(data.train_loader), task, dist)
    schedule = LRSchedule(optimizer, lr.peak_lr, lr_factor(cfg.optim.sched, plan.total_steps, plan.warmup),
                          cfg.optim.lr_on_resume, lr)
    if dist.is_main:
        for line in (precision_notice(cfg.train.precision, dist.device), plan.utilization.line(),
                     f"scale-ocr: {lr.describe()}, warm-up {plan.warmup} of {plan.total_steps} steps "
                     f"({cfg.optim.sched})"):
            if line:
                say(line)
    meta = checkpoints.load(resume_from, strategy, cfg.train.seed) if resume_from else None
    if meta is not None:  # before config.json is rewritten: an older checkpoint's digest is read from it
        same_data(recorded_data(meta, resume_from), data.identity())
        if ramp.load_state_dict(meta.get("batch_ramp")):  # the rate at the batch it reached, for the record below
            schedule.set_plan(ramp.rate())
    own = meta is not None and resume_from.resolve().is_relative_to(plan.run_dir.resolve())  # trim metrics.jsonl
    lr_record = lr.record(plan.warmup)
    if meta is not None:  # the rate a resumed run trains at (--lr-on-resume), as its resume line will say
        lr_record["peak_lr"], lr_record["resume"] = schedule.resumed_peak(meta["schedule"])
    described = {**describe_run(cfg, plan, strategy, model, data, task), "lr_plan": lr_record, "argv": argv}
    if dist.is_main:
        write_run_config(plan.run_dir, described)
    logger = build_logger(cfg.logging, dist.is_main, plan.run_dir, described, resume=meta is not None,
                          keep_records=meta.get("metrics_records") if own else None)
    try:
        parts = RunParts(strategy, wrapped, schedule, data, task, logger, checkpoints, control, watchdog, ramp)
        trainer = Trainer(plan, parts)
        if meta is not None or load is not None:  # what fit() names should the weights it starts from be unfit
            trainer.origin = ((f"the weights of checkpoint {shown(resume_from, 400)}", "resume from an earlier "
                               "checkpoints/step_N, or pass --resume none to start afresh") if meta is not None
                              else (f"the weights from --init-from {shown(Path(cfg.model.init_from), 400)}",
                                    "pass weights that are finite and of ordinary size, or leave --init-from out"))
        if meta is not None:
            where = trainer.restore(meta)
            if dist.is_main:
                say(f"scale-ocr: resumed from {shown(resume_from, 400)} {where}")
        summary = {"strategy": cfg.strategy.strategy, "arch": cfg.model.arch, "task": task.name,
                   "train_precision": cfg.train.precision,
                   "launcher": dist.launcher, "backend": dist.backend, "device": str(dist.device),
                   "skipped_samples": sum(data.skipped.values()), **trainer.fit()}
        logger.summary(summary)
    finally:
        logger.close()
    return summary


def at_mean_batch(cfg: RunConfig, mean: float, dist: DistInfo) -> tuple[LRPlan, BatchRamp]:
    """``--batch-pixels``: the rate's rule and the run's length at ``mean`` crops a micro-batch, rounded up (an
    epoch's crops then never end the run before its last round), said in one line. The schedule sets the rate on
    the engine's optimizer at each step."""
    micro = math.ceil(mean)
    lr = run_lr(cfg, dist.world_size, micro)
    if dist.is_main:
        say(f"scale-ocr: --batch-pixels {cfg.data.batch_pixels}: {mean:.1f} crops a micro-batch on average, a global "
            f"batch of about {lr.global_batch} crops and at most "
            f"{cfg.data.batch_pixels * dist.world_size * cfg.train.grad_accum} pixels; the rate's rule and the run's "
            "length count it as that many crops")
    return lr, BatchRamp(cfg.train, dist.world_size, lr, micro)


def initial_weights(model_cfg) -> Callable[[torch.nn.Module], str]:
    """``--init-from``: fills a whole built model from the file and returns the line that says so."""
    def load(model: torch.nn.Module) -> str:
        count = load_initial_weights(model, model_cfg.init_from, model_cfg.arch)
        return f"initial weights: {count} tensors from {model_cfg.init_from}"

    return load


def job_flags(argv: list[str] | None) -> list[str]:
    """The flags this job was given (``argv``, else this process's command line), without the launcher's
    per-process ``--local_rank``."""
    flags = list(sys.argv[1:] if argv is None else argv)
    return [a for a in flags if not a.startswith(("--local_rank", "--local-rank"))]


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    prepare_process()  # DeepSpeed's prebuilt ops and oneDNN's kernel cache, before the first kernel
    on_interrupt("checkpoints already written are kept: `--resume auto` (the default) continues from the newest")
    launch = peek_launch()  # first: it tells each srun/mpirun task its rank, so only rank 0 prints a flag's error
    # ... and no launcher ends rank 0 before it printed, nor a mistake of another rank alone goes unsaid
    with found_by_every_rank(ends_the_rest_on_failure(launch[1]), rank_zero_at_rendezvous(launch[1])):
        cfg = resolve_auto(parse_config(argv), *launch)
        check_launch(cfg.strategy, *launch)  # before the rendezvous, which a bad launch could hang
        wandb_env(cfg.logging.wandb_mode)  # W&B's variables, before the run directory is claimed
        dist = init_distributed(cfg.strategy.backend, cfg.strategy.dist_timeout, cfg.strategy.threads)
    watchdog = Watchdog(dist.rank, dist.world_size, cfg.strategy.dist_timeout, dist.is_main,
                        dist.round_id).start()
    stop = StopSignal().install()  # SIGTERM/SIGUSR1: finish the step, checkpoint together, exit 75
    try:
        run(cfg, dist, stop, watchdog, job_flags(argv))
    except BaseException:
        destroy_distributed(clean=False)
        raise
    finally:
        watchdog.close()
        stop.restore()
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())


