"""Two-rank DDP against the DataParallel baseline, and DDP's scaling efficiency against the hand-written loop's.

    python -m benchmarks.ddp_vs_dp --out benchmarks/results/ddp-vs-dp-HOST-DATE
    python -m benchmarks.ddp_vs_dp --report DIR     # rebuild report.md from results.jsonl

On one host with ``C`` cores, crnn_mobilenet_v3_small reads a docTR recognition folder (PNG files decoded and
resized at every step, the loader's workers on both sides) and is trained by

* ``dp``: ``train.py --strategy dp``, one process with ``C`` threads and the global batch (2 x ``-b``);
* ``ddp1`` / ``ddp2``: ``train.py --strategy ddp`` under torchrun, 1 and 2 ranks of ``C / 2`` threads, ``-b`` each;
* ``hand1`` / ``hand2``: :mod:`benchmarks.hand_loop`'s DDP loop, the same ranks, threads, batch and folder.

The trainer runs with ``--no-augment`` (the hand loop has none, and the work per sample must be the same on
both sides); everything else is its defaults. Each repeat runs the five jobs in turn, the next repeat in the
reverse order, so drift in the machine's speed falls on every job. Per repeat: DDP / DP =
``ddp2 / dp`` and scaling efficiency = ``X2 / (2 x X1)`` (samples/s), medians over the repeats in the report.
Issue 12's targets: DDP / DP >= 1.1, and the trainer's efficiency no lower than the hand loop's.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    REPO,
    append_line,
    bench_main,
    command_line,
    data_args,
    hand_job,
    hardware,
    load,
    parser,
    run_main,
    timed_job,
    trainer_job,
    versions,
    work_dir,
    write_command,
    write_outputs,
)

# name: (side, strategy or engine, ranks, launcher, batch per rank in units of -b)
JOBS = {
    "dp": ("trainer", "dp", 1, "python", 2),
    "ddp1": ("trainer", "ddp", 1, "torchrun", 1),
    "ddp2": ("trainer", "ddp", 2, "torchrun", 1),
    "hand1": ("hand", "ddp", 1, "torchrun", 1),
    "hand2": ("hand", "ddp", 2, "torchrun", 1),
}
SPEEDUP = 1.1  # ddp2 / dp


def run(args: argparse.Namespace) -> None:
    """Every repeat of the five jobs into ``args.out/results.jsonl``, each repeat in the other order."""
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    hw, ver = hardware(), versions()
    cores = hw["cores"] or 1
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    results.unlink(missing_ok=True)
    work = work_dir(args.out)
    args.world_size, args.data = 2, "folder"  # the words data_args writes: enough for 2 ranks x -b x --steps
    trainer_data, hand_data = data_args(args, create_task(ModelConfig(arch=args.arch)), work)
    names = list(JOBS)
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            side, strategy, ranks, launcher, units = JOBS[name]
            threads = cores if ranks == 1 and strategy == "dp" else max(1, cores // 2)
            make, data = (trainer_job, trainer_data) if side == "trainer" else (hand_job, hand_data)
            cmd, metrics = make(args, strategy, ranks, data, work / "runs" / f"{name}-r{repeat}",
                                args.batch_size * units, launcher)
            status, error, wall, sps = timed_job(cmd, metrics, threads, args.timeout)
            append_line(results, {
                "job": name, "repeat": repeat, "side": side, "strategy": strategy, "ranks": ranks,
                "threads_per_rank": threads, "batch_per_rank": args.batch_size * units, "status": status,
                "error": error, "samples_per_sec": sps, "wall_seconds": round(wall, 1), "arch": args.arch,
                "steps": args.steps, "workers": args.workers, "command": " ".join(cmd).replace(f"{REPO}/", ""),
                "versions": ver, "hardware": hw})
            print(f"ddp_vs_dp [{repeat + 1}/{args.repeats}] {name}: {status}"
                  + (f" {sps:.1f} samples/s" if sps else f" ({error})") + f" [{wall:.0f} s]", flush=True)
    write_command(args.out, "ddp_vs_dp")


def ratios(lines: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per complete repeat: DDP / DP and the two scaling efficiencies."""
    by: dict[int, dict[str, float]] = {}
    for ln in lines:
        if ln["status"] == "ok" and ln["samples_per_sec"]:
            by.setdefault(ln["repeat"], {})[ln["job"]] = ln["samples_per_sec"]
    out: dict[str, list[float]] = {"ddp_over_dp": [], "trainer_efficiency": [], "hand_efficiency": []}
    for got in by.values():
        if {"ddp2", "dp"} <= got.keys():
            out["ddp_over_dp"].append(got["ddp2"] / got["dp"])
        if {"ddp1", "ddp2"} <= got.keys():
            out["trainer_efficiency"].append(got["ddp2"] / (2 * got["ddp1"]))
        if {"hand1", "hand2"} <= got.keys():
            out["hand_efficiency"].append(got["hand2"] / (2 * got["hand1"]))
    return out


def verdicts(r: dict[str, list[float]]) -> list[str]:
    med = {k: statistics.median(v) if v else None for k, v in r.items()}
    lines = []
    if med["ddp_over_dp"] is not None:
        lines.append(f"- 2-rank DDP / DataParallel: {med['ddp_over_dp']:.3f} "
                     f"({'PASS' if med['ddp_over_dp'] >= SPEEDUP else 'FAIL'}, target >= {SPEEDUP})")
    if med["trainer_efficiency"] is not None and med["hand_efficiency"] is not None:
        ok = med["trainer_efficiency"] >= med["hand_efficiency"]
        lines.append(f"- scaling efficiency: trainer {med['trainer_efficiency']:.3f}, hand-written DDP loop "
                     f"{med['hand_efficiency']:.3f} ({'PASS' if ok else 'FAIL'}, the trainer's no lower)")
    return lines


def write_report(out_dir: Path) -> Path:
    lines = load(out_dir, "benchmarks.ddp_vs_dp")
    first = lines[0]
    hw, ver = first["hardware"], first["versions"]
    command = command_line(out_dir)
    md = [f"# 2-rank DDP vs DataParallel, and scaling efficiency: {first['arch']}, a docTR folder decoded per step",
          "", f"Command: `{command}`  ",
          f"Host: {hw['cpu']} ({hw['cores']} cores), {', '.join(hw['gpus']) or 'no GPU'}; git {ver.get('git')}, "
          f"torch {ver.get('torch')}", "",
          f"{first['steps']} optimizer steps per job (the first {min(5, first['steps'] // 4)} untimed), "
          f"{first['workers']} loader workers per rank, fp32; trainer with `--no-augment`, else its defaults. "
          "Efficiency = 2-rank samples/s / (2 x 1-rank samples/s), same threads per rank.", "",
          "| job | what | ranks x threads | batch/rank | samples/s (median) | min - max | runs |",
          "|---|---|---|---|---|---|---|"]
    what = {"dp": "train.py --strategy dp", "ddp1": "train.py --strategy ddp", "ddp2": "train.py --strategy ddp",
            "hand1": "hand_loop.py --engine ddp", "hand2": "hand_loop.py --engine ddp"}
    for name in JOBS:
        mine = [ln for ln in lines if ln["job"] == name]
        sps = [ln["samples_per_sec"] for ln in mine if ln["status"] == "ok" and ln["samples_per_sec"]]
        if not mine:
            continue
        ln = mine[0]
        cells = (f"{statistics.median(sps):.1f} | {min(sps):.1f} - {max(sps):.1f}" if sps else "- | -")
        md.append(f"| {name} | `{what[name]}` | {ln['ranks']} x {ln['threads_per_rank']} | {ln['batch_per_rank']} | "
                  f"{cells} | {len(sps)}/{len(mine)} |")
    r = ratios(lines)
    md += ["",
           "| per repeat | " + " | ".join(str(i) for i in range(max(map(len, r.values()), default=0))) + " | median |",
           "|---|" + "---|" * (max(map(len, r.values()), default=0) + 1)]
    for key, vals in r.items():
        md.append(f"| {key.replace('_', ' ')} | " + " | ".join(f"{v:.3f}" for v in vals)
                  + f" | {statistics.median(vals):.3f} |" if vals else f"| {key.replace('_', ' ')} | - |")
    failed = [f"- {ln['job']} r{ln['repeat']}: {ln['status']} {ln['error']}" for ln in lines if ln["status"] != "ok"]
    md += ["", *verdicts(r)] + (["", "Runs that did not finish:", *failed] if failed else [])
    return write_outputs(out_dir, r, md)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("ddp_vs_dp", __doc__)
    p.add_argument("--arch", default="crnn_mobilenet_v3_small")
    p.add_argument("-b", "--batch-size", type=int, default=32, help="per rank (DataParallel: twice this)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per job, the first min(5, steps/4) untimed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("-j", "--workers", type=int, default=0, help="loader workers per rank, every job")
    p.add_argument("--timeout", type=int, default=900, help="seconds per job")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "disabled"], help="the trainer's")
    args = p.parse_args(argv)
    if args.steps < 8 or args.repeats < 1:
        p.error("--steps must be at least 8 (a few untimed) and --repeats at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    return bench_main("ddp_vs_dp", parse(argv), run, write_report)


if __name__ == "__main__":
    run_main(main)
