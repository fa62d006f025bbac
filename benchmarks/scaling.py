"""Scaling benchmark: throughput and memory of every strategy against DataParallel.

    python -m benchmarks.scaling --preset quick            # or: scale-ocr bench --preset quick
    python -m benchmarks.report benchmarks/results/DIR     # rebuild report.md and plots from results.jsonl

Each configuration (model x strategy x world size x repeat) is its own training job started through
its launcher (``python`` for DataParallel, ``deepspeed`` for the ZeRO presets, ``torchrun`` for the
rest) on a pre-rendered image cache, so data loading never limits it. A job that crashes, runs out of
memory or times out becomes a result line with that status; the suite goes on.

Hardware sharing on a CPU-only host: DataParallel is one process using every core; an N-rank job gets
``cores // max(world sizes)`` threads per rank, at every world size, so world size 1 and N use the
same per-rank resources (scaling efficiency is then meaningful) and the largest world size uses the
same cores as the DataParallel baseline. DataParallel processes the largest world size's global batch.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    TRAIN,
    Config,
    append_line,
    default_out,
    hardware,
    launcher_for,
    measure,
    run_job,
    run_main,
    step_command,
    task_data,
    versions,
    work_dir,
    write_command,
)
from benchmarks.report import build_report, log_to_wandb

DEFAULT_STRATEGIES = ("dp", "ddp", "fsdp", "fsdp_grad_op", "hsdp", "zero1", "zero2", "zero3", "zero3_hpz",
                      "zero3_offload", "fairscale")
#: Shard within groups (--shard-size); on one host a job runs them as 2 groups of world size / 2 ranks, what 2 nodes
#: would be, so from world size 4 on (zero3_hpz refuses groups of one rank, hsdp would only replicate).
HYBRID = ("hsdp", "zero3_hpz")


def shard_size(strategy: str, world_size: int) -> int | None:
    """``--shard-size`` of a hybrid strategy's job (2 groups), None for the others."""
    return world_size // 2 if strategy in HYBRID else None


@dataclass(frozen=True)
class Suite:
    """What to run. Presets fill it; flags override single fields."""

    models: tuple[str, ...]
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    world_sizes: tuple[int, ...] = (1, 2)
    batch_size: int = 8
    steps: int = 6
    warmup: int = 2
    precision: str = "bf16"
    repeats: int = 1
    timeout: int = 600
    memory_limit_gb: float | None = None
    profile_steps: int = 2  # after the timed steps: torch.profiler measures the communication share
    model_args: tuple[tuple[str, str], ...] = ()  # (model, extra train.py flags), e.g. a smaller page size on CPU
    model_precision: tuple[tuple[str, str], ...] = ()  # (model, precision) where it differs from ``precision``

    def precision_for(self, model: str) -> str:
        return dict(self.model_precision).get(model, self.precision)

    @property
    def job_steps(self) -> int:
        """Optimizer steps each job runs: warm-up, timed, then profiled."""
        return self.warmup + self.steps + self.profile_steps


PRESETS: dict[str, Suite] = {
    # CPU, minutes: a small CNN and a 21M-parameter ViT (big enough for sharding to show).
    # DBNet in fp32 and on 256x256 pages: CPUs without bf16 units run its convolutions about 10x slower in
    # bf16 than in fp32 (measured here: 34 s against 3 s a step, 8 pages a rank), pages are costly anyway.
    "quick": Suite(models=("crnn_mobilenet_v3_small", "vitstr_small", "db_mobilenet_v3_large"), world_sizes=(1, 2),
                   batch_size=8, steps=6, warmup=2, timeout=300,
                   model_args=(("db_mobilenet_v3_large", "--input-size 256x256"),),
                   model_precision=(("db_mobilenet_v3_large", "fp32"),)),
    # One GPU node.
    "full": Suite(models=("crnn_mobilenet_v3_small", "crnn_vgg16_bn", "vitstr_small", "vitstr_base",
                          "db_mobilenet_v3_large"),
                  world_sizes=(1, 2, 4, 8), batch_size=64, steps=50, warmup=10, repeats=3),
    # Models where sharding decides whether it fits at all.
    "large": Suite(models=("vitstr_base", "vitstr_large"),
                   strategies=("dp", "ddp", "fsdp", "hsdp", "zero2", "zero3", "zero3_hpz", "zero3_offload",
                               "fairscale"),
                   world_sizes=(1, 2, 4, 8), batch_size=32, steps=30, warmup=5),
}

@dataclass
class Result:
    """One line of results.jsonl."""

    config: dict[str, Any]
    status: str  # ok | oom | failed | timeout
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def plan(suite: Suite, cores: int, gpus: int) -> list[Config]:
    """Every job, in a stable order: per model, DataParallel first (the baseline), then by strategy."""
    top = max(suite.world_sizes)
    threads = max(1, cores // top)
    jobs = []
    for model in suite.models:
        precision = suite.precision_for(model)
        for strategy in suite.strategies:
            launcher = launcher_for(strategy)
            single_process = launcher == "python"
            for ws in ((1,) if single_process else suite.world_sizes):
                if (gpus and ws > gpus) or (strategy in HYBRID and ws < 4):
                    continue
                if single_process:
                    # One process drives every device (CPU: every core) and takes the largest world's global batch.
                    devices = gpus or top
                    cfg = Config(model, strategy, 1, suite.batch_size * devices, 0, cores, launcher, precision)
                else:
                    cfg = Config(model, strategy, ws, suite.batch_size, 0, threads, launcher, precision)
                for r in range(suite.repeats):
                    jobs.append(Config(**{**asdict(cfg), "repeat": r}))
    return jobs


def command(cfg: Config, suite: Suite, data_args: list[str], run_dir: Path, group: str, wandb_mode: str) -> list[str]:
    """Train.py's launch command for one configuration of ``suite``."""
    extra = shlex.split(dict(suite.model_args).get(cfg.model, ""))
    if (shard := shard_size(cfg.strategy, cfg.world_size)) is not None:
        extra += ["--shard-size", str(shard)]
    return step_command(cfg, suite.job_steps, data_args, extra, run_dir, group, wandb_mode, suite.profile_steps)


def predicted(strategy: str, world_size: int, precision: str, model, size) -> dict[str, float]:
    """The memory model's figures for this job (the engine adapts to the model as at set-up)."""
    from scale_ocr.planning.estimate import estimate

    return estimate(size, world_size, precision, [strategy], model=model,
                    ranks_per_node=shard_size(strategy, world_size))["strategies"][strategy]


@dataclass
class Models:
    """What the suite knows of each model before any job: its task, a built copy, size and data flags (its FLOPs are
    each run's own count, at the input size and precision the job's flags gave it)."""

    tasks: dict[str, Any]
    built: dict[str, Any]
    sizes: dict[str, Any]
    data_args: dict[str, list[str]]

    @classmethod
    def prepare(cls, suite: Suite, work: Path, words: int, log) -> Models:
        from scale_ocr.config import ModelConfig
        from scale_ocr.planning.estimate import model_size
        from scale_ocr.tasks import create_task

        tasks = {m: create_task(ModelConfig(arch=m)) for m in suite.models}
        built = {m: tasks[m].build_model() for m in suite.models}
        return cls(tasks, built, sizes={m: model_size(built[m]) for m in suite.models},
                   data_args={m: task_data(tasks[m], work, words, log) for m in suite.models})


def job_metrics(cfg: Config, suite: Suite, models: Models, run_dir: Path, status: str, error: str | None,
                wall: float, hw: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """A finished job's figures: its steps' throughput and memory, the memory model's prediction, FLOPs and MFU."""
    metrics: dict[str, Any] = {"wall_seconds": wall}
    if status == "ok":
        try:
            metrics.update(measure(run_dir, suite.warmup, suite.steps))
        except (OSError, ValueError, KeyError, statistics.StatisticsError) as exc:
            status, error = "failed", f"unreadable metrics: {exc}"
    pred = predicted(cfg.strategy, cfg.world_size, cfg.precision, models.built[cfg.model], models.sizes[cfg.model])
    metrics["predicted"] = {k: pred[k] for k in ("params", "grads", "optimizer", "other", "model_state", "ideal")}
    measured = (metrics.get("state_bytes") or {}).get("model_state")
    metrics["measured_over_predicted"] = measured / pred["model_state"] if measured else None
    flops = metrics.get("flops_per_sample")  # the run's own count (measure): db at 256x256 is a quarter of 512x512's
    if flops and "samples_per_sec" in metrics:
        # The benchmark's rate (median of the timed steps) over the peak the run measured or looked up.
        achieved = flops * metrics["samples_per_sec"]
        metrics["achieved_tflops"] = achieved / 1e12
        peak = metrics.get("peak_flops") or {}
        devices = len(hw["gpus"]) if cfg.launcher == "python" and hw["gpus"] else peak.get("devices") or 0  # dp
        total = (peak.get("per_device") or 0.0) * devices
        metrics["mfu"] = achieved / total if total else None
    return status, error, metrics


def _progress(i: int, total: int, cfg: Config, status: str, error: str | None, metrics: dict[str, Any]) -> str:
    sps = metrics.get("samples_per_sec")
    ratio = metrics.get("measured_over_predicted")
    measured = (metrics.get("state_bytes") or {}).get("model_state")
    return (f"bench [{i}/{total}] {cfg.key}: {status}"
            + (f" {sps:.1f} samples/s" if sps else "")
            + (f", model state {measured / 2**20:.1f} MiB = {ratio:.2f} x predicted" if measured and ratio else "")
            + (f" ({error})" if error else "") + f" [{metrics['wall_seconds']:.0f} s]")


def _done_keys(results_file: Path, resume: bool) -> set[str]:
    """Configurations already measured (``--resume``); without it, an earlier results file is removed."""
    if resume and results_file.is_file():
        return {json.loads(ln)["config"]["key"] for ln in results_file.read_text().splitlines() if ln.strip()}
    results_file.unlink(missing_ok=True)
    return set()


def run_suite(suite: Suite, out_dir: Path, preset: str | None, wandb_mode: str, resume: bool = False,
              log=print) -> Path:
    """Run every configuration of ``suite`` into ``out_dir`` and write the report; returns results.jsonl."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results_file = out_dir / "results.jsonl"
    done = _done_keys(results_file, resume)
    hw, ver = hardware(), versions()
    jobs = plan(suite, hw["cores"] or 1, len(hw["gpus"]))
    words = max(j.batch_size * j.world_size for j in jobs) * suite.job_steps  # one epoch covers every job
    work = work_dir(out_dir)  # run directories, W&B files and the image cache: not part of the results
    models = Models.prepare(suite, work, words, log)
    started = time.time()
    for i, cfg in enumerate(jobs, 1):
        if cfg.key in done:
            continue
        run_dir = work / "runs" / cfg.key.replace("/", "-")
        cmd = command(cfg, suite, models.data_args[cfg.model], run_dir, out_dir.name, wandb_mode)
        status, error, wall = run_job(cmd, cfg.threads_per_rank, suite.timeout, suite.memory_limit_gb)
        status, error, metrics = job_metrics(cfg, suite, models, run_dir, status, error, wall, hw)
        line = Result({**asdict(cfg), "key": cfg.key, "params": models.sizes[cfg.model].params,
                       "steps": suite.steps, "warmup": suite.warmup, "preset": preset,
                       "command": " ".join(cmd[cmd.index(str(TRAIN)):]) if str(TRAIN) in cmd else " ".join(cmd)},
                      status, error, {**metrics, "versions": ver, "hardware": hw, "run_dir": str(run_dir)})
        append_line(results_file, asdict(line))
        log(_progress(i, len(jobs), cfg, status, error, metrics))
    log(f"bench: {len(jobs)} configurations in {time.time() - started:.0f} s -> {results_file}")
    return results_file


def parse(argv: list[str] | None) -> tuple[Suite, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--models", help="comma-separated model names")
    p.add_argument("--strategies", help=f"comma-separated (default: {','.join(DEFAULT_STRATEGIES)})")
    p.add_argument("--world-sizes", help="comma-separated, e.g. 1,2,4")
    p.add_argument("--batch-size", type=int, help="per-rank micro-batch")
    p.add_argument("--steps", type=int, help="timed steps per job")
    p.add_argument("--warmup", type=int, help="untimed steps before them")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--repeats", type=int)
    p.add_argument("--profile-steps", type=int, help="profiled steps after the timed ones (0: no comm share)")
    p.add_argument("--timeout", type=int, help="seconds per job before it is recorded as a timeout")
    p.add_argument("--memory-limit-gb", type=float,
                   help="CPU: cap each rank's memory, like a device's capacity (jobs beyond it record oom)")
    p.add_argument("--out", type=Path, help="results directory (default benchmarks/results/PRESET-HOST-DATE)")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    p.add_argument("--resume", action="store_true", help="skip configurations already in results.jsonl")
    args = p.parse_args(argv)
    if not args.preset and not args.models:
        p.error("give --preset or --models")
    base = PRESETS[args.preset] if args.preset else Suite(models=())
    over: dict[str, Any] = {}
    if args.models:
        over["models"] = tuple(args.models.split(","))
    if args.strategies:
        over["strategies"] = tuple(args.strategies.split(","))
    if args.world_sizes:
        over["world_sizes"] = tuple(int(w) for w in args.world_sizes.split(","))
    for name in ("batch_size", "steps", "warmup", "precision", "repeats", "timeout", "memory_limit_gb",
                 "profile_steps"):
        if getattr(args, name) is not None:
            over[name] = getattr(args, name)
    if args.precision is not None:  # an explicit --precision is every model's
        over["model_precision"] = ()
    return Suite(**{**asdict(base), **over}), args


def main(argv: list[str] | None = None) -> int:
    from scale_ocr.errors import UserError
    from scale_ocr.models import list_models
    from scale_ocr.strategies import strategy_entry

    suite, args = parse(argv)
    for m in suite.models:
        if m not in list_models():
            raise UserError(f"unknown model {m!r}; choose from: {', '.join(list_models())}")
    for s in suite.strategies:
        strategy_entry(s)
    if suite.steps < 1 or suite.warmup < 0 or suite.repeats < 1 or min(suite.world_sizes) < 1:
        raise UserError("--steps and --repeats must be at least 1, --warmup and world sizes non-negative/positive")
    out = args.out or default_out(args.preset)
    run_suite(suite, out, args.preset, args.wandb_mode, args.resume)
    write_command(out, "scaling")
    print(f"bench: report {build_report(out)}")
    if args.wandb_mode != "disabled":
        log_to_wandb(out, args.wandb_mode)
    return 0


if __name__ == "__main__":
    run_main(main)
