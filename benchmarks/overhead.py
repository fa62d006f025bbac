"""What scale_ocr's trainer costs over a hand-written loop driving the same engine.

    python -m benchmarks.overhead --out benchmarks/results/overhead-HOST-DATE
    python -m benchmarks.overhead --data folder --strategies ddp -b 8 --out ...   # a docTR folder, decoded per step
    python -m benchmarks.overhead --report DIR     # rebuild report.md from results.jsonl

For each strategy, the same model, batch, precision and pre-rendered words are trained (a) by
``scale_ocr/train.py`` with its defaults and (b) by :mod:`benchmarks.hand_loop`, the textbook loop of that
engine (forward, loss, backward, step), each through the strategy's launcher with the same threads per rank.
The runs alternate (a b, then b a, ...) so drift in the machine's speed falls on both sides; each pair gives a
ratio a / b of training samples/s (both time the steps after the same warm-up), and the report gives each
strategy's median ratio and its spread over the pairs.

``--data cache`` (default) trains on words rendered once into memory, so only the training step is compared.
``--data folder`` writes the same words as PNG files into a docTR recognition folder (images/, labels.json),
which both sides decode and resize at every step with the same batch and ``--workers``: the trainer with
``--no-augment`` (its augmentations are not docTR's, and comparing recipes is not the point), the hand loop
the way docTR's reference script reads its RecognitionDataset (PIL decode, aspect-preserving resize, zero pad,
normalisation per batch).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.harness import (
    REPO,
    WINDOW,
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
    warmup_steps,
    window_rate,
    work_dir,
    write_command,
    write_outputs,
)

STRATEGIES = ("single", "ddp", "zero2", "fsdp", "zero3", "fairscale")
TARGET = 0.98  # trainer / hand-written loop, issue 12


def run(args: argparse.Namespace) -> Path:
    """Every pair of every strategy into ``args.out/results.jsonl``, alternating which side runs first."""
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    hw, ver = hardware(), versions()
    cores = hw["cores"] or 1
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    results = out_dir / "results.jsonl"
    results.unlink(missing_ok=True)
    work = work_dir(out_dir)
    trainer_data, hand_data = data_args(args, create_task(ModelConfig(arch=args.arch)), work)
    for pair in range(args.pairs):
        for strategy in args.strategies:
            ws = 1 if strategy == "single" else args.world_size
            threads = cores if ws == 1 else max(1, cores // ws)
            sides = [("trainer", trainer_job, trainer_data), ("hand", hand_job, hand_data)]
            for side, make, data in sides if pair % 2 == 0 else sides[::-1]:
                cmd, metrics = make(args, strategy, ws, data, work / "runs" / f"{strategy}-{side}-p{pair}")
                status, error, wall, sps = timed_job(cmd, metrics, threads, args.timeout)
                windows = window_rate(side, metrics, warmup_steps(args.steps)) if status == "ok" else None
                append_line(results, {
                    "strategy": strategy, "side": side, "pair": pair, "status": status, "error": error,
                    "samples_per_sec": sps, "window_samples_per_sec": windows, "wall_seconds": wall, "world_size": ws,
                    "threads_per_rank": threads, "arch": args.arch, "batch_size": args.batch_size,
                    "steps": args.steps, "warmup": warmup_steps(args.steps), "precision": "fp32", "data": args.data,
                    "workers": args.workers, "layout": args.layout,
                    "command": " ".join(cmd).replace(f"{REPO}/", ""), "versions": ver, "hardware": hw})
                print(f"overhead [{pair + 1}/{args.pairs}] {strategy} {side}: {status}"
                      + (f" {sps:.1f} samples/s" if sps else f" ({error})")
                      + (f", median window {windows:.1f}" if windows else "") + f" [{wall:.0f} s]", flush=True)
    write_command(out_dir, "overhead")
    return results


def summarize(lines: list[dict]) -> list[dict]:
    """Per strategy: the ratio trainer / hand of each complete pair, their median and spread."""
    rows = []
    for strategy in dict.fromkeys(ln["strategy"] for ln in lines):
        mine = [ln for ln in lines if ln["strategy"] == strategy]
        whole, trainer, hand = _pair_ratios(mine, "samples_per_sec")
        windows, _, _ = _pair_ratios(mine, "window_samples_per_sec")
        rows.append({
            "strategy": strategy, "pairs": len(whole), "ratios": whole,
            "median": statistics.median(whole) if whole else None,
            "min": min(whole) if whole else None, "max": max(whole) if whole else None,
            "window_ratios": windows, "window_median": statistics.median(windows) if windows else None,
            "window_min": min(windows) if windows else None, "window_max": max(windows) if windows else None,
            "trainer_sps": statistics.median(trainer) if trainer else None,
            "hand_sps": statistics.median(hand) if hand else None,
            "failed": [f"{ln['side']} p{ln['pair']}: {ln['status']} {ln['error']}"
                       for ln in mine if ln["status"] != "ok"],
        })
    return rows


def _pair_ratios(lines: list[dict], key: str) -> tuple[list[float], list[float], list[float]]:
    """trainer / hand of ``key`` for each pair with both sides measured, and each side's values."""
    by_pair: dict[int, dict[str, float | None]] = {}
    for ln in lines:
        by_pair.setdefault(ln["pair"], {})[ln["side"]] = ln.get(key) if ln["status"] == "ok" else None
    ratios = [p["trainer"] / p["hand"] for p in by_pair.values() if p.get("trainer") and p.get("hand")]
    return (ratios, [p["trainer"] for p in by_pair.values() if p.get("trainer")],
            [p["hand"] for p in by_pair.values() if p.get("hand")])


def write_report(out_dir: Path) -> Path:
    lines = load(out_dir, "benchmarks.overhead")
    rows = summarize(lines)
    first = lines[0]
    command = command_line(out_dir)
    hw, ver = first["hardware"], first["versions"]
    data = ("a docTR folder decoded at every step, " f"{first['workers']} loader workers"
            if first.get("data") == "folder" else "pre-rendered words in memory")
    md = [f"# Trainer overhead: {first['arch']}, batch {first['batch_size']} per rank, {first['precision']}, "
          f"{first['steps']} steps ({first['warmup']} untimed), {data}, "
          f"{first.get('layout', 'nchw')} images on both sides", "",
          f"Command: `{command}`  ",
          f"Host: {hw['cpu']} ({hw['cores']} cores), {', '.join(hw['gpus']) or 'no GPU'}; git {ver.get('git')}, "
          f"torch {ver.get('torch')}, deepspeed {ver.get('deepspeed')}, fairscale {ver.get('fairscale')}", "",
          "(a) `scale_ocr/train.py` with its defaults (`--no-eval --no-save-model`, W&B offline) against (b) "
          "`benchmarks/hand_loop.py`, the engine's textbook loop, on the same words; runs alternate a/b. "
          f"Two measures of each run: its samples/s over all timed steps, and the median of its {WINDOW}-step windows "
          f"after the warm-up (each window holds the trainer's per-step work and one log line; the median is not moved "
          f"by a few seconds in which the shared host runs slow). Target: median over pairs of a / b >= {TARGET}.", "",
          "| strategy | world size | threads/rank | trainer samples/s | hand loop samples/s | trainer / hand, "
          f"whole runs (median, min - max) | trainer / hand, {WINDOW}-step windows (median, min - max) | pairs "
          "| meets target |",
          "|---|---|---|---|---|---|---|---|---|"]

    def span(r: dict, prefix: str) -> str:
        if r[f"{prefix}median"] is None:
            return "-"
        return f"{r[f'{prefix}median']:.3f} ({r[f'{prefix}min']:.3f} - {r[f'{prefix}max']:.3f})"

    for r in rows:
        ln = next(x for x in lines if x["strategy"] == r["strategy"])
        if r["median"] is None:
            md.append(f"| {r['strategy']} | {ln['world_size']} | {ln['threads_per_rank']} | - | - | - | - | 0 | no |")
            continue
        judged = r["window_median"] if r["window_median"] is not None else r["median"]
        md.append(f"| {r['strategy']} | {ln['world_size']} | {ln['threads_per_rank']} | {r['trainer_sps']:.1f} | "
                  f"{r['hand_sps']:.1f} | {span(r, '')} | {span(r, 'window_')} | {r['pairs']} | "
                  f"{'yes' if judged >= TARGET else 'no'} |")
    failed = [f"- {r['strategy']} {f}" for r in rows for f in r["failed"]]
    if failed:
        md += ["", "Runs that did not finish:", *failed]
    md += ["", "Every run (samples/s: whole run / median window):", "",
           "| strategy | pair | trainer | hand loop | ratio, whole | ratio, windows |", "|---|---|---|---|---|---|"]
    for r in rows:
        for pair in sorted({x["pair"] for x in lines if x["strategy"] == r["strategy"]}):
            got = {x["side"]: x for x in lines if x["strategy"] == r["strategy"] and x["pair"] == pair}
            t, h = got.get("trainer", {}), got.get("hand", {})
            cells = [f"{x.get('samples_per_sec') or 0:.1f} / {x.get('window_samples_per_sec') or 0:.1f}"
                     for x in (t, h)]
            ratios = [f"{t[k] / h[k]:.3f}" if t.get(k) and h.get(k) else "-"
                      for k in ("samples_per_sec", "window_samples_per_sec")]
            md.append(f"| {r['strategy']} | {pair} | {cells[0]} | {cells[1]} | {ratios[0]} | {ratios[1]} |")
    return write_outputs(out_dir, rows, md)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("overhead", __doc__)
    p.add_argument("--arch", default="crnn_mobilenet_v3_small")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, from " + ",".join(STRATEGIES))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("-b", "--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run, the first min(5, steps/4) untimed")
    p.add_argument("--pairs", type=int, default=3, help="alternating trainer/hand-loop pairs per strategy")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--data", choices=["cache", "folder"], default="cache",
                   help="pre-rendered words in memory, or a docTR folder of PNG files decoded at every step")
    p.add_argument("--workers", type=int, default=0, help="loader workers per rank, both sides (--data folder)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--layout", choices=["channels-last", "nchw"], default="channels-last",
                   help="image layout on both sides: the trainer's default (channels-last for CNNs, the hand loop "
                        "converting its inputs the same way), or NCHW (the trainer with --no-channels-last)")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "disabled"], help="the trainer's")
    args = p.parse_args(argv)
    args.strategies = tuple(s for s in args.strategies.split(",") if s)
    return args


def check(args: argparse.Namespace) -> None:
    from scale_ocr.errors import UserError

    unknown = sorted(set(args.strategies) - set(STRATEGIES))
    if unknown:
        raise UserError(f"--strategies: {', '.join(unknown)} has no hand-written loop; "
                        f"choose from {', '.join(STRATEGIES)}")
    if args.steps < 8 or args.pairs < 1 or args.world_size < 1:
        raise UserError("--steps must be at least 8 (a few untimed), --pairs and --world-size at least 1")


def main(argv: list[str] | None = None) -> int:
    return bench_main("overhead", parse(argv), run, write_report, check)


if __name__ == "__main__":
    run_main(main)
