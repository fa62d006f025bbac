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
from pathlib import Path

from benchmarks.harness import (
    REPO,
    append_line,
    bench_main,
    command_line,
    data_args,
    hardware,
    load,
    parser,
    run_main,
    timed_job,
    trainer_job,
    versions,
    warmup_steps,
    window_rate,
    work_dir,
    write_command,
    write_outputs,
)

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


def run(args: argparse.Namespace) -> None:
    """Every repeat of every variant into ``args.out/results.jsonl``, each repeat in the other order."""
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    hw, ver = hardware(), versions()
    threads = max(1, (hw["cores"] or 1) // args.world_size)
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    results.unlink(missing_ok=True)
    work = work_dir(args.out)
    work.mkdir(parents=True, exist_ok=True)
    args.data, args.layout = "cache", "channels-last"
    data = data_args(args, create_task(ModelConfig(arch=args.arch)), work)[0]
    names = [n for n in VARIANTS if VARIANTS[n][0] in args.strategies]
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            strategy = VARIANTS[name][0]
            extra = tuple(variant_flags(name, work))
            cmd, metrics = trainer_job(args, strategy, args.world_size, data, work / "runs" / f"{name}-r{repeat}",
                                       extra=extra)
            status, error, wall, sps = timed_job(cmd, metrics, threads, args.timeout)
            windows = window_rate("trainer", metrics, warmup_steps(args.steps)) if status == "ok" else None
            append_line(results, {
                "variant": name, "strategy": strategy, "flags": list(extra), "repeat": repeat, "status": status,
                "error": error, "samples_per_sec": sps, "window_samples_per_sec": windows,
                "wall_seconds": round(wall, 1), "world_size": args.world_size, "threads_per_rank": threads,
                "arch": args.arch, "batch_size": args.batch_size, "steps": args.steps,
                "command": " ".join(cmd).replace(f"{REPO}/", ""), "versions": ver, "hardware": hw})
            print(f"engine_knobs [{repeat + 1}/{args.repeats}] {name}: {status}"
                  + (f" {sps:.1f} samples/s, median window {windows or 0:.1f}" if sps else f" ({error})")
                  + f" [{wall:.0f} s]", flush=True)
    write_command(args.out, "engine_knobs")


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
    p = parser("engine_knobs", __doc__)
    p.add_argument("--arch", default="crnn_mobilenet_v3_small")
    p.add_argument("--strategies", default="ddp,zero2,zero3", help="comma-separated, from ddp,zero2,zero3")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("-b", "--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--wandb-mode", default="disabled", choices=["offline", "disabled"], help="the trainer's")
    args = p.parse_args(argv)
    args.strategies = tuple(s for s in args.strategies.split(",") if s)
    return args


def check(args: argparse.Namespace) -> None:
    from scale_ocr.errors import UserError

    known = {s for s, _ in VARIANTS.values()}
    if not args.strategies or set(args.strategies) - known:
        raise UserError(f"--strategies: choose from {', '.join(sorted(known))}")
    if args.steps < 20 or args.repeats < 1 or args.world_size < 2:
        raise UserError("--steps must be at least 20 (two 10-step windows after the warm-up), --repeats at least 1 "
                        "and --world-size at least 2 (the settings tune communication)")


def main(argv: list[str] | None = None) -> int:
    return bench_main("engine_knobs", parse(argv), run, write_report, check)


if __name__ == "__main__":
    run_main(main)
