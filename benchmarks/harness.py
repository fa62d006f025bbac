"""What every benchmark shares: launching and timing jobs, the host's description, results folders, and the
shape of a benchmark's command line.

Each benchmark module (``scaling``, ``overhead``, ``ddp_vs_dp``, ``convergence``, ``max_model``, ``loader``,
``engine_knobs``, ``compute``) keeps only its own experiment and imports the rest from here; no benchmark
imports another. A results folder holds ``command.txt`` (the command that made it), ``results.jsonl`` (one line
per job, with versions and hardware), and what ``--report`` rebuilds from them: ``summary.json`` and ``report.md``.
Scratch space (run directories, word caches, W&B files) goes to ``benchmarks/.work/<folder>``, which git ignores.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "scale_ocr" / "train.py"
HAND = REPO / "benchmarks" / "hand_loop.py"
BIN = Path(sys.executable).parent

OOM_PATTERNS = ("out of memory", "OutOfMemoryError", "can't allocate memory", "Cannot allocate memory",
                "MemoryError", "std::bad_alloc")
WINDOW = 10  # the trainer's default --log-every: one log line (W&B, metrics.jsonl) in every window


# --- launching and running jobs -----------------------------------------------------------------------------------

def launcher_for(strategy: str) -> str:
    """The launcher a strategy's jobs start under: ``python`` (one process), ``deepspeed`` or ``torchrun``."""
    from scale_ocr.strategies import strategy_entry

    entry = strategy_entry(strategy)
    if entry.cls.max_world_size == 1:
        return "python"
    return "deepspeed" if "preset" in entry.preset else "torchrun"


def launch_command(launcher: str, world_size: int, script: Path, args: list[str]) -> list[str]:
    """``script args`` started by ``launcher`` (python, deepspeed or torchrun) with ``world_size`` local ranks."""
    from scale_ocr.distributed.process_group import free_port

    if launcher == "python":
        return [sys.executable, str(script), *args]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(world_size), "--master_port", str(free_port()),
                str(script), *args]
    return [str(BIN / "torchrun"), "--nproc_per_node", str(world_size), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(script), *args]


def launch(strategy: str, world_size: int, script: Path, args: list[str], launcher: str | None = None) -> list[str]:
    """``script args`` under ``launcher``, by default the strategy's own."""
    return launch_command(launcher or launcher_for(strategy), world_size, script, args)


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


def job_env() -> dict[str, str]:
    """This process's environment for a benchmark's job: the checkout on PYTHONPATH, and no rank variables
    inherited from a launcher, so the job's own launcher sets them."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def run_job(cmd: list[str], threads: int, timeout: int, memory_limit_gb: float | None,
            extra_env: dict[str, str] | None = None) -> tuple[str, str | None, float]:
    """Run one benchmark job (its own session, ``threads`` per rank, each process capped on CPU; ``extra_env`` on
    top of :func:`job_env`): ``(status, error, seconds)``, status ok / oom / failed / timeout."""
    env = dict(job_env(), OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", **(extra_env or {}))
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=_limit_memory(memory_limit_gb), start_new_session=True)
        status, error = classify(proc.returncode, proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired:
        status, error = "timeout", f"no result within {timeout} s"
    return status, error, time.time() - t0


def timed_job(cmd: list[str], metrics: Path, threads: int, timeout: int) -> tuple[str, str | None, float, float | None]:
    """Run one job: ``(status, error, wall seconds, training samples/s from its summary file)``."""
    status, error, wall = run_job(cmd, threads, timeout, None)
    sps = None
    if status == "ok":
        try:
            sps = float(json.loads(metrics.read_text())["samples_per_sec"])
        except (OSError, ValueError, KeyError) as exc:
            status, error = "failed", f"unreadable {metrics.name}: {exc}"
    return status, error, wall, sps


# --- the jobs: train.py and the hand-written loop -----------------------------------------------------------------

@dataclass
class Config:
    """One train.py job that logs every step (the scaling suite's configurations, max-model's probes)."""

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


def step_command(cfg: Config, steps: int, data_args: list[str], extra: list[str], run_dir: Path, group: str,
                 wandb_mode: str, profile_steps: int) -> list[str]:
    """Train.py's launch command for ``cfg``: ``steps`` optimizer steps, each logged, the last ``profile_steps``
    profiled; no evaluation, constant learning rate, no loader workers, no resume."""
    args = [cfg.model, "--strategy", cfg.strategy, "--precision", cfg.precision, "-b", str(cfg.batch_size),
            "--max-steps", str(steps), "--epochs", "1000", *data_args, *extra, "--no-eval",
            "--profile-steps", str(profile_steps),
            "--log-every", "1", "--sched", "constant", "--workers", "0", "--resume", "none",
            "--output-dir", str(run_dir),
            "--wandb-mode", wandb_mode, "--wandb-group", group, "--run-name", cfg.key.replace("/", "-")]
    return launch_command(cfg.launcher, cfg.world_size, TRAIN, args)


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
        "time_breakdown": summary.get("time_breakdown"),  # seconds per timed step by part (docs/time-breakdown.md)
        "memory_breakdown": summary.get("memory_breakdown"),  # the largest rank's peak, split (docs/memory.md)
        "peak_flops": summary.get("peak_flops"),  # MFU's denominator, with its source (docs/mfu.md)
        # A training sample's FLOPs as the run counted them, at its input size and precision (docs/mfu.md)
        "flops_per_sample": (summary.get("flops_per_sample") or {}).get("total"),
    }


def warmup_steps(steps: int) -> int:
    """The trainer's untimed warm-up (Trainer.warmup_steps), which the hand loop matches."""
    return min(5, max(0, steps // 4))


def channels_last(args: argparse.Namespace) -> bool:
    """Both sides feed CNNs NHWC images (the trainer's default) unless ``--layout nchw``."""
    return getattr(args, "layout", "channels-last") == "channels-last"


# Synthetic data the trainer draws for a benchmark is set in the faces every record drew (scale_ocr.data.fonts,
# `classic`), as the words harness renders are, so a record's command still makes its data after --fonts' default.
RECORD_FONTS = ("--fonts", "classic")


def task_data(task, work: Path, samples: int, log: Callable[[str], None] = print) -> list[str]:
    """train.py flags that feed a benchmark ``samples`` training samples cheaply. A recognizer reads a pre-rendered
    word cache held in memory, so data loading never limits the measured steps; a detector's synthetic pages are drawn
    by the loader (tens of milliseconds a page against seconds of DBNet compute on CPU; a cache of 512x512 pages would
    not fit in memory at scale)."""
    if not hasattr(task, "cache_tag"):  # pages, not words
        return ["--train-samples", str(samples), "--val-samples", "8", *RECORD_FONTS]
    from scale_ocr.data.cache import build_cache

    h, w = task.input_size
    cache = work / f"words-{samples}-{h}x{w}{task.cache_tag}.pt"  # the tag tells differently prepared images apart
    if not cache.is_file():
        log(f"bench: rendering {samples} words into {cache}")
        build_cache(cache, samples, task.input_size, task.vocab.chars, transform=task.transform(train=False))
    return ["--data-cache", str(cache)]


def data_args(args: argparse.Namespace, task, work: Path) -> tuple[list[str], list[str]]:
    """Train.py's and the hand loop's flags for the same words (``args.data``: cache or folder)."""
    words = args.batch_size * args.world_size * args.steps
    if args.data == "cache":
        cache = task_data(task, work, words)[1]
        return ["--data-cache", cache], ["--data-cache", cache]
    folder = str(write_folder(work / f"folder-{words}", words, task.vocab.chars))
    h, w = task.input_size
    return (["--train-path", folder, "--val-path", folder, "--no-augment", "--workers", str(args.workers)],
            ["--folder", folder, "--chars", task.vocab.chars, "--input-size", f"{h}x{w}",
             "--workers", str(args.workers)])


def trainer_job(args: argparse.Namespace, strategy: str, ws: int, data: list[str], run_dir: Path,
                batch: int | None = None, launcher: str | None = None,
                extra: tuple[str, ...] = ()) -> tuple[list[str], Path]:
    """Train.py's command (``batch`` per rank, default ``args.batch_size``; ``extra`` flags) and the summary \
it writes."""
    cli = [args.arch, "--strategy", strategy, "-b", str(batch or args.batch_size), "--max-steps", str(args.steps),
           "--epochs", "1000", *data, "--lr", str(args.lr), "--no-eval", "--no-save-model", "--resume", "none",
           "--output-dir", str(run_dir), "--wandb-mode", args.wandb_mode, "--run-name", run_dir.name,
           *([] if channels_last(args) else ["--no-channels-last"]), *extra]
    return launch(strategy, ws, TRAIN, cli, launcher), run_dir / "metrics.json"


def hand_job(args: argparse.Namespace, strategy: str, ws: int, data: list[str], run_dir: Path,
             batch: int | None = None, launcher: str | None = None) -> tuple[list[str], Path]:
    """:mod:`benchmarks.hand_loop`'s command for the same job as :func:`trainer_job`, and the summary it writes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "hand.json"
    cli = ["--engine", strategy, "--arch", args.arch, *data, "-b", str(batch or args.batch_size),
           "--steps", str(args.steps), "--warmup", str(warmup_steps(args.steps)), "--window", str(WINDOW),
           "--lr", str(args.lr), "--out", str(out), *(["--channels-last"] if channels_last(args) else [])]
    return launch(strategy, ws, HAND, cli, launcher), out


def window_rate(side: str, metrics: Path, warmup: int) -> float | None:
    """Median samples/s over a run's 10-step windows that start after its warm-up (None without them).

    Both sides time each window the same way (the trainer logs ``train/step_time`` at every ``--log-every``,
    the hand loop marks every ``--window`` steps), and each window holds the trainer's per-step work and one log
    line. On a shared host whose speed drops for seconds at a time, the median window of a run is a steadier
    measure of the loop's throughput than the run's total, which one slow stretch drags down.
    """
    try:
        if side == "trainer":
            global_batch = json.loads(metrics.read_text())["global_batch"]
            records = [json.loads(ln) for ln in (metrics.parent / "metrics.jsonl").read_text().splitlines()]
            rates = [global_batch / r["train/step_time"] for r in records
                     if "train/step_time" in r and r["step"] % WINDOW == 0 and r["step"] - WINDOW >= warmup]
        else:
            rates = json.loads(metrics.read_text()).get("window_samples_per_sec") or []
    except (OSError, ValueError, KeyError):
        return None
    return statistics.median(rates) if rates else None


# --- the host -----------------------------------------------------------------------------------------------------

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


# --- results folders ----------------------------------------------------------------------------------------------

def work_dir(out_dir: Path) -> Path:
    """Scratch space of a results directory, kept out of the repository (benchmarks/.work is ignored)."""
    return REPO / "benchmarks" / ".work" / out_dir.resolve().name


def default_out(name: str | None) -> Path:
    """``benchmarks/results/NAME-HOST-DATE``, a new folder's name (never renamed afterwards)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:40]
    return REPO / "benchmarks" / "results" / f"{name or 'custom'}-{host}-{dt.date.today():%Y%m%d}"


def refuse_written(out: Path | None) -> None:
    """For a benchmark that writes a folder once: a ``--out`` that already holds results is refused in one line."""
    if out is not None and (out / "results.jsonl").exists():
        from scale_ocr.errors import UserError

        raise UserError(f"{out} already holds results; give a new --out (results folders are never rewritten)")


def write_folder(path: Path, n: int, chars: str, seed: int = 0, lengths: tuple[int, int] = (3, 8),
                 style: str = "line") -> Path:
    """``n`` synthetic words (``lengths``: characters, fewest and most; ``style``: how they are cut, as
    ``--synthetic-words``) as PNG files in a docTR recognition folder (written once, then reused)."""
    from scale_ocr.data.synthetic import SyntheticWords

    if (path / "labels.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    (tmp / "images").mkdir(parents=True, exist_ok=True)
    words = SyntheticWords(chars, n, *lengths, seed, transform=lambda image: image, style=style)
    labels = {}
    for i in range(n):
        image, word = words[i]
        image.save(tmp / "images" / f"{i:06d}.png")
        labels[f"{i:06d}.png"] = word
    (tmp / "labels.json").write_text(json.dumps(labels), encoding="utf-8")
    tmp.replace(path)
    return path


def append_line(results: Path, line: dict[str, Any]) -> None:
    """One more line of ``results.jsonl``."""
    with results.open("a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def write_command(out_dir: Path, module: str) -> None:
    """``command.txt``: this process's command line as ``python -m benchmarks.MODULE ...``, quoted so that it runs
    again as it is (an argument with a space, an empty list such as ``--det-batches ""``)."""
    (out_dir / "command.txt").write_text(shlex.join(["python", "-m", f"benchmarks.{module}", *sys.argv[1:]]) + "\n")


def load(out_dir: Path, made_by: str = "benchmarks.scaling") -> list[dict[str, Any]]:
    """The lines of ``out_dir/results.jsonl``, which ``python -m MADE_BY`` writes."""
    path = out_dir / "results.jsonl"
    if not path.is_file():
        from scale_ocr.errors import UserError

        raise UserError(f"{path} does not exist; run `python -m {made_by}` first")
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def command_line(out_dir: Path) -> str:
    """The command that made ``out_dir`` (its ``command.txt``), or "?"."""
    path = out_dir / "command.txt"
    return path.read_text().strip() if path.is_file() else "?"


def write_outputs(out_dir: Path, summary: Any, md: list[str]) -> Path:
    """Write ``summary.json`` and ``report.md`` (``md``'s lines) into ``out_dir``; returns the report's path."""
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    report = out_dir / "report.md"
    report.write_text("\n".join(md) + "\n")
    return report


# --- a benchmark's command line -----------------------------------------------------------------------------------

def parser(module: str, doc: str, results: str = "results.jsonl") -> argparse.ArgumentParser:
    """``python -m benchmarks.MODULE``'s parser with the two flags every such benchmark has: ``--out`` and
    ``--report`` (rebuild a folder's report from its ``results`` file and stop)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}", description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help=f"results folder (default benchmarks/results/{module.replace('_', '-')}-HOST-DATE)")
    p.add_argument("--report", type=Path, default=None, help=f"only rebuild DIR/report.md from DIR/{results}")
    return p


def bench_main(module: str, args: argparse.Namespace, run: Callable[[argparse.Namespace], Any],
               write_report: Callable[[Path], Path], check: Callable[[argparse.Namespace], None] | None = None) -> int:
    """What every benchmark's ``main`` does with its parsed ``args``: with ``--report DIR``, rebuild DIR's report
    only; otherwise ``check`` the flags (a :class:`UserError` is one line), ``run`` into ``--out`` (default
    ``benchmarks/results/MODULE-HOST-DATE``) and write the report."""
    if args.report:
        print(write_report(args.report))
        return 0
    if check is not None:
        check(args)
    args.out = args.out or default_out(module.replace("_", "-"))
    run(args)
    print(f"{module}: report {write_report(args.out)}")
    return 0


def run_main(main: Callable[[], int]) -> None:
    """``if __name__ == "__main__"`` of a benchmark: a :class:`UserError` exits 2 with one line, no traceback."""
    from scale_ocr.errors import report_user_errors

    sys.exit(report_user_errors(main)())
