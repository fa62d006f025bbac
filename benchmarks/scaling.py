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
import datetime as dt
import json
import os
import platform
import re
import resource
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "scale_ocr" / "train.py"
BIN = Path(sys.executable).parent

DEFAULT_STRATEGIES = ("dp", "ddp", "fsdp", "fsdp_grad_op", "zero1", "zero2", "zero3", "zero3_offload", "fairscale")


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
                   strategies=("dp", "ddp", "fsdp", "zero2", "zero3", "zero3_offload", "fairscale"),
                   world_sizes=(1, 2, 4, 8), batch_size=32, steps=30, warmup=5),
}

OOM_PATTERNS = ("out of memory", "OutOfMemoryError", "can't allocate memory", "Cannot allocate memory",
                "MemoryError", "std::bad_alloc")


@dataclass
class Config:
    """One job of the suite."""

    model: str
    strategy: str
    world_size: int
    batch_size: int
    repeat: int
    threads_per_rank: int
    launcher: str
    precision: str

    @property
    def key(self) -> str:
        return f"{self.model}/{self.strategy}/ws{self.world_size}/r{self.repeat}"


@dataclass
class Result:
    """One line of results.jsonl."""

    config: dict[str, Any]
    status: str  # ok | oom | failed | timeout
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def plan(suite: Suite, cores: int, gpus: int) -> list[Config]:
    """Every job, in a stable order: per model, DataParallel first (the baseline), then by strategy."""
    from scale_ocr.strategies import strategy_entry

    top = max(suite.world_sizes)
    threads = max(1, cores // top)
    jobs = []
    for model in suite.models:
        precision = suite.precision_for(model)
        for strategy in suite.strategies:
            entry = strategy_entry(strategy)
            single_process = entry.cls.max_world_size == 1
            for ws in ((1,) if single_process else suite.world_sizes):
                if gpus and ws > gpus:
                    continue
                if single_process:
                    # One process drives every device (CPU: every core) and takes the largest world's global batch.
                    devices = gpus or top
                    cfg = Config(model, strategy, 1, suite.batch_size * devices, 0, cores, "python", precision)
                else:
                    launcher = "deepspeed" if "preset" in entry.preset else "torchrun"
                    cfg = Config(model, strategy, ws, suite.batch_size, 0, threads, launcher, precision)
                for r in range(suite.repeats):
                    jobs.append(Config(**{**asdict(cfg), "repeat": r}))
    return jobs


def launch_command(launcher: str, world_size: int, script: Path, args: list[str]) -> list[str]:
    """``script args`` started by ``launcher`` (python, deepspeed or torchrun) with ``world_size`` local ranks."""
    from scale_ocr.distributed import free_port

    if launcher == "python":
        return [sys.executable, str(script), *args]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(world_size), "--master_port", str(free_port()),
                str(script), *args]
    return [str(BIN / "torchrun"), "--nproc_per_node", str(world_size), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(script), *args]


def command(cfg: Config, suite: Suite, data_args: list[str], run_dir: Path, group: str, wandb_mode: str) -> list[str]:
    args = [cfg.model, "--strategy", cfg.strategy, "--precision", cfg.precision, "-b", str(cfg.batch_size),
            "--max-steps", str(suite.job_steps), "--epochs", "1000", *data_args, *shlex.split(dict(suite.model_args).get(cfg.model, "")), "--no-eval",
            "--profile-steps", str(suite.profile_steps),
            "--log-every", "1", "--sched", "constant", "--workers", "0", "--resume", "none", "--output-dir", str(run_dir),
            "--wandb-mode", wandb_mode, "--wandb-group", group, "--run-name", cfg.key.replace("/", "-")]
    return launch_command(cfg.launcher, cfg.world_size, TRAIN, args)


def classify(returncode: int, output: str) -> tuple[str, str | None]:
    """A job's status from its exit code and output: ok, oom (a result, not a crash) or failed."""
    if returncode == 0:
        return "ok", None
    from scale_ocr.errors import EXIT_OUT_OF_MEMORY

    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    ours = [ln for ln in lines if ln.startswith("scale-ocr: error:")]
    if returncode == EXIT_OUT_OF_MEMORY or any(p in output for p in OOM_PATTERNS) or returncode in (-9, 137):
        return "oom", (ours or [f"exit {returncode} (killed: out of memory)"])[0][:300]
    errors = ours or [ln for ln in lines if "Error" in ln or "error" in ln] or [f"exit {returncode}"]
    return "failed", errors[0][:300]


def _limit_memory(gb: float | None):
    """preexec_fn capping each process's data segment (every rank inherits it), like a device's capacity."""
    if not gb:
        return None

    def apply() -> None:
        limit = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    return apply


def run_job(cmd: list[str], threads: int, timeout: int, memory_limit_gb: float | None) -> tuple[str, str | None, float]:
    """Run one benchmark job (its own session, ``threads`` per rank, each process capped on CPU):
    ``(status, error, seconds)``, status ok / oom / failed / timeout."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=_limit_memory(memory_limit_gb), start_new_session=True)
        status, error = classify(proc.returncode, proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired:
        status, error = "timeout", f"no result within {timeout} s"
    return status, error, time.time() - t0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def measure(run_dir: Path, warmup: int, timed: int) -> dict[str, Any]:
    """Figures of a finished job from its metrics.jsonl (one line per step) and metrics.json."""
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/step_time" in r and warmup < r["step"] <= warmup + timed]
    summary = json.loads((run_dir / "metrics.json").read_text())
    times = [r["train/step_time"] for r in steps]
    global_batch = summary["global_batch"]
    sps = [global_batch / t for t in times]
    return {
        "timed_steps": len(times),
        "samples_per_sec": statistics.median(sps),
        "samples_per_sec_p25": percentile(sps, 0.25),
        "samples_per_sec_p75": percentile(sps, 0.75),
        "step_time_p50": percentile(times, 0.5),
        "step_time_p95": percentile(times, 0.95),
        "global_batch": global_batch,
        "peak_memory_bytes": summary["peak_memory_bytes"],  # CPU: peak RSS; GPU: max allocated (max over ranks)
        "peak_memory_bytes_mean": statistics.mean(r["memory/peak_bytes_mean"] for r in steps) if steps else None,
        "peak_reserved_bytes": summary.get("peak_reserved_bytes"),
        "state_bytes": summary.get("state_bytes"),
        "train_loss": summary.get("train_loss"),
        "comm_share": summary.get("comm_share"),  # profiled steps: share of time with a collective in flight
    }


# Dense bf16 / fp32 peak FLOP/s per device for MFU (datasheet figures, no sparsity).
PEAK_FLOPS = {"H200": (989e12, 67e12), "H100": (989e12, 67e12), "A100": (312e12, 19.5e12),
              "L40S": (362e12, 91.6e12), "A10": (125e12, 31.2e12)}


def flops_per_sample(model, inputs) -> float:
    """Training FLOPs of one sample (forward + backward) of a 2-sample dummy batch, by torch's FLOP counter."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = model(*inputs)
        out["loss"].backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 2


def hardware() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "memory_bytes": mem, "gpus": gpus,
            "platform": platform.platform()}


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("torch", "torchvision", "deepspeed", "fairscale", "wandb", "scale-ocr"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    try:
        out["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


def predicted(strategy: str, world_size: int, precision: str, model, size) -> dict[str, float]:
    """The memory model's figures for this job (the engine adapts to the model as at set-up)."""
    from scale_ocr.memory.estimate import estimate

    return estimate(size, world_size, precision, [strategy], model=model)["strategies"][strategy]


def run_suite(suite: Suite, out_dir: Path, preset: str | None, wandb_mode: str, resume: bool = False,
              log=print) -> Path:
    """Run every configuration of ``suite`` into ``out_dir`` and write the report; returns results.jsonl."""
    from scale_ocr.config import ModelConfig
    from scale_ocr.memory.estimate import model_size
    from scale_ocr.tasks import create_task

    out_dir.mkdir(parents=True, exist_ok=True)
    results_file = out_dir / "results.jsonl"
    done = set()
    if resume and results_file.is_file():
        done = {json.loads(ln)["config"]["key"] for ln in results_file.read_text().splitlines() if ln.strip()}
    elif results_file.exists():
        results_file.unlink()
    hw, ver = hardware(), versions()
    cores, gpus = hw["cores"] or 1, len(hw["gpus"])
    jobs = plan(suite, cores, gpus)
    words = max(j.batch_size * j.world_size for j in jobs) * suite.job_steps  # one epoch covers every job
    work = work_dir(out_dir)  # run directories, W&B files and the image cache: not part of the results
    group = out_dir.name
    tasks = {m: create_task(ModelConfig(arch=m)) for m in suite.models}
    models = {m: tasks[m].build_model() for m in suite.models}
    sizes = {m: model_size(models[m]) for m in suite.models}
    data_args = {m: tasks[m].benchmark_data(work, words, log) for m in suite.models}
    flops = {m: flops_per_sample(models[m], tasks[m].dummy_inputs(2)) for m in suite.models}
    peak = next((v for k, v in PEAK_FLOPS.items() if hw["gpus"] and k in hw["gpus"][0]), None)
    started = time.time()
    for i, cfg in enumerate(jobs, 1):
        if cfg.key in done:
            continue
        run_dir = work / "runs" / cfg.key.replace("/", "-")
        cmd = command(cfg, suite, data_args[cfg.model], run_dir, group, wandb_mode)
        status, error, wall = run_job(cmd, cfg.threads_per_rank, suite.timeout, suite.memory_limit_gb)
        metrics: dict[str, Any] = {"wall_seconds": wall}
        if status == "ok":
            try:
                metrics.update(measure(run_dir, suite.warmup, suite.steps))
            except (OSError, ValueError, KeyError, statistics.StatisticsError) as exc:
                status, error = "failed", f"unreadable metrics: {exc}"
        size = sizes[cfg.model]
        pred = predicted(cfg.strategy, cfg.world_size, cfg.precision, models[cfg.model], size)
        metrics["predicted"] = {k: pred[k] for k in ("params", "grads", "optimizer", "other", "model_state", "ideal")}
        measured = (metrics.get("state_bytes") or {}).get("model_state")
        metrics["measured_over_predicted"] = measured / pred["model_state"] if measured else None
        metrics["flops_per_sample"] = flops[cfg.model]
        if "samples_per_sec" in metrics:
            achieved = flops[cfg.model] * metrics["samples_per_sec"]
            metrics["achieved_tflops"] = achieved / 1e12
            per_device = (peak[0] if cfg.precision != "fp32" else peak[1]) if peak else None
            metrics["mfu"] = achieved / (per_device * (gpus if cfg.launcher == "python" else cfg.world_size)) \
                if per_device else None
        line = Result({**asdict(cfg), "key": cfg.key, "params": size.params,
                       "steps": suite.steps, "warmup": suite.warmup, "preset": preset,
                       "command": " ".join(cmd[cmd.index(str(TRAIN)):]) if str(TRAIN) in cmd else " ".join(cmd)},
                      status, error, {**metrics, "versions": ver, "hardware": hw, "run_dir": str(run_dir)})
        with results_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(line)) + "\n")
        sps = metrics.get("samples_per_sec")
        ratio = metrics.get("measured_over_predicted")
        log(f"bench [{i}/{len(jobs)}] {cfg.key}: {status}"
            + (f" {sps:.1f} samples/s" if sps else "")
            + (f", model state {measured / 2**20:.1f} MiB = {ratio:.2f} x predicted" if measured and ratio else "")
            + (f" ({error})" if error else "") + f" [{wall:.0f} s]")
    log(f"bench: {len(jobs)} configurations in {time.time() - started:.0f} s -> {results_file}")
    return results_file


def work_dir(out_dir: Path) -> Path:
    """Scratch space of a results directory, kept out of the repository (benchmarks/.work is ignored)."""
    return REPO / "benchmarks" / ".work" / out_dir.resolve().name


def default_out(preset: str | None) -> Path:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:40]
    return REPO / "benchmarks" / "results" / f"{preset or 'custom'}-{host}-{dt.date.today():%Y%m%d}"


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
    from benchmarks.report import build_report, log_to_wandb

    print(f"bench: report {build_report(out)}")
    if args.wandb_mode != "disabled":
        log_to_wandb(out, args.wandb_mode)
    return 0


if __name__ == "__main__":
    from scale_ocr.errors import report_user_errors

    sys.exit(report_user_errors(main)())
