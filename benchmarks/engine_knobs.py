"""Engine settings chosen by measurement: DDP's bucket size and static graph, DeepSpeed's overlap_comm and buckets.

    python -m benchmarks.engine_knobs --out benchmarks/results/engine-knobs-HOST-DATE
    python -m benchmarks.engine_knobs --report DIR     # rebuild report.md from results.jsonl

The trainer (``scale_ocr/train.py``, its defaults otherwise) trains the same pre-rendered words under each
variant of a strategy's settings: ``ddp`` with ``--bucket-mb`` 1 / 25 (torch's and scale-ocr's default) / 100 and
``--static-graph``; ``zero2`` and ``zero3`` with the shipped preset, the preset with ``overlap_comm`` switched
(zero2 off; zero3 on, its preset's "auto" being off on CPU ranks), and the preset with DeepSpeed's own bucket sizes
(5e8 elements) instead of the preset's 5e6. Each repeat runs every
variant once, the next repeat in the reverse order; per repeat each variant's samples/s (median 10-step window
after the warm-up, as in ``benchmarks.overhead``) is divided by its strategy's default of the same repeat, and the
report gives the median of those ratios. A default changes only when a variant beats it by more than the spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from benchmarks.overhead import data_args, timed_job, trainer_job, warmup_steps, window_rate
from benchmarks.report import command_line, load, write_outputs
from benchmarks.scaling import REPO, default_out, hardware, versions, work_dir

BIG_BUCKETS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
               "stage3_prefetch_bucket_size": 500_000_000}
# name: (strategy, trainer flags, or a change to the strategy's preset JSON); the first of each strategy is its default
VARIANTS: dict[str, tuple[str, list[str] | dict]] = {
    "ddp": ("ddp", []),
    "ddp-bucket1": ("ddp", ["--bucket-mb", "1"]),
    "ddp-bucket100": ("ddp", ["--bucket-mb", "100"]),
    "ddp-static": ("ddp", ["--static-graph"]),
    "zero2": ("zero2", []),
    "zero2-no-overlap": ("zero2", {"overlap_comm": False}),
    "zero2-big-buckets": ("zero2", BIG_BUCKETS),
    "zero3": ("zero3", []),
    "zero3-overlap": ("zero3", {"overlap_comm": True}),  # the preset's "auto": on with GPUs, off on CPU ranks
    "zero3-big-buckets": ("zero3", BIG_BUCKETS),
}


def variant_flags(name: str, work: Path) -> list[str]:
    """The trainer flags of a variant; a preset change is written to a JSON under ``work``."""
    strategy, change = VARIANTS[name]
    if isinstance(change, list):
        return change
    cfg = json.loads((REPO / "ds_configs" / f"{strategy}.json").read_text())
    zero = cfg["zero_optimization"]
    zero.update({k: v for k, v in change.items() if k in zero})  # a stage-3 key has no place in ZeRO-2
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg, indent=1) + "\n")
    return ["--ds-config", str(path)]


def run(a: argparse.Namespace) -> None:
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    hw, ver = hardware(), versions()
    threads = max(1, (hw["cores"] or 1) // a.world_size)
    out_dir: Path = a.out
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    results.unlink(missing_ok=True)
    work = work_dir(out_dir)
    work.mkdir(parents=True, exist_ok=True)
    task = create_task(ModelConfig(arch=a.arch))
    a.data, a.layout = "cache", "channels-last"
    data = data_args(a, task, work)[0]
    names = [n for n in VARIANTS if VARIANTS[n][0] in a.strategies]
    for repeat in range(a.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            strategy = VARIANTS[name][0]
            extra = tuple(variant_flags(name, work))
            cmd, metrics = trainer_job(a, strategy, a.world_size, data, work / "runs" / f"{name}-r{repeat}", extra=extra)
            status, error, wall, sps = timed_job(cmd, metrics, threads, a.timeout)
            windows = window_rate("trainer", metrics, warmup_steps(a.steps)) if status == "ok" else None
            line = {"variant": name, "strategy": strategy, "flags": list(extra), "repeat": repeat, "status": status,
                    "error": error, "samples_per_sec": sps, "window_samples_per_sec": windows,
                    "wall_seconds": round(wall, 1), "world_size": a.world_size, "threads_per_rank": threads,
                    "arch": a.arch, "batch_size": a.batch_size, "steps": a.steps,
                    "command": " ".join(cmd).replace(f"{REPO}/", ""), "versions": ver, "hardware": hw}
            with results.open("a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
            print(f"engine_knobs [{repeat + 1}/{a.repeats}] {name}: {status}"
                  + (f" {sps:.1f} samples/s, median window {windows or 0:.1f}" if sps else f" ({error})")
                  + f" [{wall:.0f} s]", flush=True)
    (out_dir / "command.txt").write_text(" ".join(["python -m benchmarks.engine_knobs", *sys.argv[1:]]) + "\n")


def summarize(lines: list[dict]) -> list[dict]:
    """Per variant: its samples/s over repeats and, per repeat, its ratio to its strategy's default."""
    rate = {(x["variant"], x["repeat"]): x.get("window_samples_per_sec") or x.get("samples_per_sec")
            for x in lines if x["status"] == "ok"}
    rows = []
    strategy_of = {x["variant"]: x["strategy"] for x in lines}
    for name in strategy_of:
        default = strategy_of[name]
        got = [v for (n, _), v in rate.items() if n == name and v]
        ratios = [rate[(name, r)] / rate[(default, r)] for (n, r) in rate
                  if n == name and rate.get((default, r)) and rate[(name, r)]]
        failed = [x["error"] for x in lines if x["variant"] == name and x["status"] != "ok"]
        rows.append({"variant": name, "strategy": default, "runs": len(got),
                     "samples_per_sec": statistics.median(got) if got else None,
                     "ratio_median": statistics.median(ratios) if ratios else None,
                     "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
                     "failed": failed})
    return rows


def write_report(out_dir: Path) -> Path:
    lines = load(out_dir, "benchmarks.engine_knobs")
    rows = summarize(lines)
    first = lines[0]
    hw, ver = first["hardware"], first["versions"]
    command = command_line(out_dir)
    md = [f"# Engine settings: {first['arch']}, batch {first['batch_size']} per rank, {first['world_size']} ranks x "
          f"{first['threads_per_rank']} threads, {first['steps']} steps, pre-rendered words", "",
          f"Command: `{command}`  ",
          f"Host: {hw['cpu']} ({hw['cores']} cores), {', '.join(hw['gpus']) or 'no GPU'}; git {ver.get('git')}, "
          f"torch {ver.get('torch')}, deepspeed {ver.get('deepspeed')}", "",
          "samples/s: median 10-step window after the warm-up; ratio: against the strategy's default in the same "
          "repeat (median, min - max over repeats).", "",
          "| variant | trainer flags | samples/s (median) | / default (median, min - max) | runs |",
          "|---|---|---|---|---|"]
    for r in rows:
        flags = next(x["flags"] for x in lines if x["variant"] == r["variant"])
        shown = " ".join(f if not f.endswith(".json") else Path(f).name for f in flags) or "(default)"
        if r["samples_per_sec"] is None:
            md.append(f"| {r['variant']} | `{shown}` | - | - | 0 |")
            continue
        md.append(f"| {r['variant']} | `{shown}` | {r['samples_per_sec']:.1f} | {r['ratio_median']:.3f} "
                  f"({r['ratio_min']:.3f} - {r['ratio_max']:.3f}) | {r['runs']} |")
    failed = [f"- {r['variant']}: {e}" for r in rows for e in r["failed"]]
    if failed:
        md += ["", "Runs that did not finish:", *failed]
    return write_outputs(out_dir, rows, md)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine_knobs", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="crnn_mobilenet_v3_small")
    p.add_argument("--strategies", default="ddp,zero2,zero3", help="comma-separated, from ddp,zero2,zero3")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("-b", "--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--wandb-mode", default="disabled", choices=["offline", "disabled"], help="the trainer's")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--report", type=Path, default=None, help="only rebuild DIR/report.md from DIR/results.jsonl")
    a = p.parse_args(argv)
    a.strategies = tuple(s for s in a.strategies.split(",") if s)
    return a


def main(argv: list[str] | None = None) -> int:
    from scale_ocr.errors import UserError

    a = parse(argv)
    if a.report:
        print(write_report(a.report))
        return 0
    known = {s for s, _ in VARIANTS.values()}
    if not a.strategies or set(a.strategies) - known:
        raise UserError(f"--strategies: choose from {', '.join(sorted(known))}")
    if a.steps < 20 or a.repeats < 1 or a.world_size < 2:
        raise UserError("--steps must be at least 20 (two 10-step windows after the warm-up), --repeats at least 1 "
                        "and --world-size at least 2 (the settings tune communication)")
    a.out = a.out or default_out("engine-knobs")
    run(a)
    print(f"engine_knobs: report {write_report(a.out)}")
    return 0


if __name__ == "__main__":
    from scale_ocr.errors import report_user_errors

    sys.exit(report_user_errors(main)())
