"""The gradient noise scale under every strategy: do the engines' estimates agree, and what does measuring cost.

    python -m benchmarks.noise_scale --out benchmarks/results/noise-scale-HOST-DATE
    python -m benchmarks.noise_scale --parts agree --agree-steps 20 --out /tmp/ns     # a quick look
    python -m benchmarks.noise_scale --report DIR     # rebuild report.md, summary.json and the plot

Part 1, agreement (issue 54, acceptance 1): the same model, seed and pre-rendered synthetic words are trained by
``scale_ocr/train.py`` with its defaults for the same optimizer steps under ddp, fsdp, zero2 and zero3 on
``--world-size`` ranks, and under single with ``--grad-accum`` equal to that world size, so every run compares a
micro-batch of ``-b`` with the same global batch. Each run's B_simple curve (``noise/b_simple`` in metrics.jsonl)
and final value (metrics.json's ``noise_scale``) are read; the four distributed estimates must agree within 20%
(max / min <= 1.2).

Part 2, cost: per strategy, runs with the measurement off (``--noise-every 0``) and on at each ``--cadences``
(default 10, the trainer's default, and 1, every step, which costs about ten times as much and so resolves a cost
ten times smaller) alternate within each pair, the order reversed every other pair, so drift in the host's speed
falls on every side. Each run is timed by the median of its 10-step windows after the warm-up (as
:mod:`benchmarks.overhead`); each pair gives on / off per cadence, and the report gives each strategy's median
ratio and its spread over the pairs. Target: <= 1.03 at the default cadence.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    REPO,
    TRAIN,
    WINDOW,
    append_line,
    bench_main,
    command_line,
    hardware,
    launch,
    load,
    parser,
    run_job,
    run_main,
    task_data,
    versions,
    warmup_steps,
    window_rate,
    work_dir,
    write_command,
    write_outputs,
)

STRATEGIES = ("ddp", "fsdp", "zero2", "zero3", "single")
DISTRIBUTED = ("ddp", "fsdp", "zero2", "zero3")
SPREAD = 1.2  # max / min of the distributed strategies' final B_simple (issue 54, acceptance 1)
COST = 1.03  # step time with the default cadence / without the measurement
DEFAULT_EVERY = 10  # the trainer's --noise-every
DEFAULT_SMOOTHING = 0.9  # and its --noise-smoothing
DIVERGED = 0.05  # the runs' training has parted once their gradient norms at a logged step differ by more
PLOT_META = {"Software": None}  # no version stamp in the PNG: the same results give the same bytes


# --- running ------------------------------------------------------------------------------------------------------

def job(args: argparse.Namespace, strategy: str, steps: int, every: int, cache: str, run_dir: Path,
        smoothing: float) -> tuple[list[str], int, int]:
    """Train.py's command for one run, and its ranks and threads per rank: ``--world-size`` ranks, or one process
    accumulating as many micro-batches (single), so both compare ``-b`` with the same global batch."""
    ws = 1 if strategy == "single" else args.world_size
    accum = args.world_size if strategy == "single" else 1
    cores = args.hw["cores"] or 1
    threads = cores if ws == 1 else max(1, cores // ws)
    cli = [args.arch, "--strategy", strategy, "-b", str(args.batch_size), "--grad-accum", str(accum),
           "--max-steps", str(steps), "--epochs", "1000", "--data-cache", cache, "--seed", str(args.seed),
           "--noise-every", str(every), "--noise-smoothing", str(smoothing), "--log-every", str(WINDOW),
           "--no-eval", "--no-save-model",
           "--save-every", "0", "--save-minutes", "0", "--resume", "none", "--output-dir", str(run_dir),
           "--wandb-mode", args.wandb_mode, "--run-name", run_dir.name]
    return launch(strategy, ws, TRAIN, cli), ws, threads


def read_run(run_dir: Path) -> dict[str, Any]:
    """A finished run's B_simple curve, its final noise scale, global batch and loss."""
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    summary = json.loads((run_dir / "metrics.json").read_text())
    keys = ("noise/b_simple", "noise/grad_sq", "noise/trace", "train/grad_norm", "train/loss")
    curve = [{"step": r["step"], **{k.split("/")[1]: r[k] for k in keys if k in r}}
             for r in records if any(k.startswith("noise/") for k in r)]
    return {"curve": curve, "noise_scale": summary.get("noise_scale"), "global_batch": summary.get("global_batch"),
            "train_loss": summary.get("train_loss"), "samples_per_sec": summary.get("samples_per_sec")}


def run_one(args: argparse.Namespace, part: str, strategy: str, steps: int, every: int, cache: str, run_dir: Path,
            extra: dict[str, Any]) -> dict[str, Any]:
    """Run one job and append its line to results.jsonl."""
    smoothing = args.agree_smoothing if part == "agree" else DEFAULT_SMOOTHING
    cmd, ws, threads = job(args, strategy, steps, every, cache, run_dir, smoothing)
    status, error, wall = run_job(cmd, threads, args.timeout, None)
    got: dict[str, Any] = {}
    if status == "ok":
        try:
            got = read_run(run_dir)
        except (OSError, ValueError, KeyError) as exc:
            status, error = "failed", f"unreadable metrics: {exc}"
    window = window_rate("trainer", run_dir / "metrics.json", warmup_steps(steps)) if status == "ok" else None
    line = {"part": part, "strategy": strategy, **extra, "noise_every": every, "noise_smoothing": smoothing,
            "status": status, "error": error,
            "window_samples_per_sec": window, "wall_seconds": wall, "world_size": ws,
            "grad_accum": 1 if ws > 1 else args.world_size, "threads_per_rank": threads, "arch": args.arch,
            "batch_size": args.batch_size, "steps": steps, "warmup": warmup_steps(steps), "seed": args.seed, **got,
            "command": " ".join(cmd).replace(f"{REPO}/", ""), "versions": args.versions, "hardware": args.hw}
    append_line(args.out / "results.jsonl", line)
    return line


def _say(line: dict[str, Any], where: str) -> None:
    final = (line.get("noise_scale") or {}).get("b_simple")
    print(f"noise_scale {where} {line['strategy']} every {line['noise_every']}: {line['status']}"
          + (f" ({line['error']})" if line["error"] else "")
          + (f", B_simple {final:.1f}" if final else "")
          + (f", median window {line['window_samples_per_sec']:.1f} samples/s" if line["window_samples_per_sec"]
             else "") + f" [{line['wall_seconds']:.0f} s]", flush=True)


def run(args: argparse.Namespace) -> None:
    """Part 1's run per strategy, then part 2's pairs, into ``args.out/results.jsonl``."""
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    args.out.mkdir(parents=True, exist_ok=True)
    write_command(args.out, "noise_scale")
    args.hw, args.versions = hardware(), versions()
    work = work_dir(args.out)
    task = create_task(ModelConfig(arch=args.arch))
    steps = max(args.agree_steps if "agree" in args.parts else 0, args.cost_steps if "cost" in args.parts else 0)
    cache = task_data(task, work, steps * args.batch_size * args.world_size)[1]
    if "agree" in args.parts:
        for strategy in args.strategies:
            line = run_one(args, "agree", strategy, args.agree_steps, args.agree_every, cache,
                           work / "runs" / f"agree-{strategy}", {})
            _say(line, "agree")
    if "cost" in args.parts:
        for pair in range(args.pairs):
            for strategy in args.strategies:
                order = [0, *args.cadences]
                for every in order if pair % 2 == 0 else order[::-1]:
                    line = run_one(args, "cost", strategy, args.cost_steps, every, cache,
                                   work / "runs" / f"cost-{strategy}-e{every}-p{pair}", {"pair": pair})
                    _say(line, f"cost [{pair + 1}/{args.pairs}]")


# --- the report ---------------------------------------------------------------------------------------------------

def agreement(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Part 1: per strategy its final B_simple; the spread max / min over the distributed strategies."""
    runs = {ln["strategy"]: ln for ln in lines if ln["part"] == "agree"}  # the last line of each strategy
    finals = {s: (ln.get("noise_scale") or {}).get("b_simple") if ln["status"] == "ok" else None
              for s, ln in runs.items()}
    dist = [finals[s] for s in DISTRIBUTED if s in finals]
    measured = [v for v in dist if v]
    spread = max(measured) / min(measured) if len(measured) == len(dist) and len(dist) >= 2 else None
    # the spread at each logged step all the distributed runs measured
    steps = sorted(set.intersection(*[{p["step"] for p in runs[s]["curve"] if p.get("b_simple")}
                                      for s in DISTRIBUTED if s in runs and runs[s].get("curve")] or [set()]))
    by_step = {s: {p["step"]: p.get("b_simple") for p in runs[s].get("curve") or []} for s in runs}
    spreads = [{"step": st, "spread": max(v) / min(v)} for st in steps
               if len(v := [by_step[s][st] for s in DISTRIBUTED if s in runs]) >= 2]
    norms = {s: {p["step"]: p.get("grad_norm") for p in runs[s].get("curve") or []} for s in DISTRIBUTED if s in runs}
    apart = [st for st in steps if len(v := [norms[s].get(st) for s in norms]) >= 2 and all(v)
             and max(v) / min(v) > 1 + DIVERGED]
    return {"finals": finals, "spread": spread, "diverged_at": apart[0] if apart else None, "target": SPREAD,
            "pass": spread is not None and spread <= SPREAD,
            "spread_by_step": spreads,
            "runs": {s: {k: ln.get(k) for k in ("status", "error", "noise_scale", "global_batch", "train_loss",
                                                "world_size", "grad_accum", "wall_seconds", "samples_per_sec")}
                     for s, ln in runs.items()}}


def cost(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Part 2: per strategy and cadence, on / off of each pair's median windows, their median and spread."""
    mine = [ln for ln in lines if ln["part"] == "cost"]
    rows = []
    for strategy in dict.fromkeys(ln["strategy"] for ln in mine):
        by_pair: dict[int, dict[int, float | None]] = {}
        for ln in mine:
            if ln["strategy"] == strategy:
                ok = ln["status"] == "ok"
                by_pair.setdefault(ln["pair"], {})[ln["noise_every"]] = ln["window_samples_per_sec"] if ok else None
        cadences = sorted({e for p in by_pair.values() for e in p if e}, reverse=True)
        for every in cadences:
            # step-time ratio on / off = samples/s off / on
            ratios = [p[0] / p[every] for p in by_pair.values() if p.get(0) and p.get(every)]
            med = statistics.median(ratios) if ratios else None
            rows.append({"strategy": strategy, "noise_every": every, "pairs": len(ratios), "ratios": ratios,
                         "median": med, "min": min(ratios) if ratios else None,
                         "max": max(ratios) if ratios else None,
                         "per_reading": (med - 1) * every if med is not None else None,
                         "off_sps": statistics.median([p[0] for p in by_pair.values() if p.get(0)] or [0]),
                         "failed": [f"pair {ln['pair']} every {ln['noise_every']}: {ln['status']} {ln['error']}"
                                    for ln in mine if ln["strategy"] == strategy and ln["status"] != "ok"
                                    and ln["noise_every"] in (0, every)]})
    return rows


def plot(lines: list[dict[str, Any]], out_dir: Path) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {ln["strategy"]: ln for ln in lines if ln["part"] == "agree" and ln.get("curve")}
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for strategy, ln in runs.items():
        points = [p for p in ln["curve"] if p.get("b_simple")]
        label = f"{strategy} ({ln['world_size']} rank{'s' if ln['world_size'] > 1 else ''} x {ln['grad_accum']})"
        ax.plot([p["step"] for p in points], [p["b_simple"] for p in points], marker=".", label=label,
                ls="--" if strategy not in DISTRIBUTED else "-")
    first = next(iter(runs.values()))
    ax.set(title=f"B_simple, {first['arch']}, micro-batch {first['batch_size']}, global {first['global_batch']}",
           xlabel="optimizer step", ylabel="B_simple (smoothed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "b_simple.png", dpi=110, metadata=PLOT_META)
    plt.close(fig)
    return "b_simple.png"


def _agree_md(agree: dict[str, Any], lines: list[dict[str, Any]]) -> list[str]:
    agreed = [ln for ln in lines if ln["part"] == "agree"]
    if not agreed:
        return []
    first = agreed[0]
    md = ["## Part 1: do the engines agree?", "",
          f"{first['arch']}, seed {first['seed']}, the same pre-rendered synthetic words, {first['steps']} optimizer "
          f"steps, `--noise-every {first['noise_every']} --noise-smoothing {first.get('noise_smoothing', 0.9)}` "
          f"(the trainer's defaults: {DEFAULT_EVERY}, {DEFAULT_SMOOTHING}), micro-batch {first['batch_size']}; the "
          "trainer's defaults otherwise (`--no-eval --no-save-model`, no checkpoints).", "",
          "| strategy | ranks x accumulation | b_small / b_big | final B_simple | \\|G\\|² | tr(Σ) | readings "
          "| final loss | status |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for s, r in agree["runs"].items():
        ns = r["noise_scale"] or {}
        b = agree["finals"].get(s)
        md.append(f"| {s} | {r['world_size']} x {r['grad_accum']} | {ns.get('b_small', '-')} / {ns.get('b_big', '-')} "
                  f"| {f'{b:.1f}' if b else '-'} | {_g(ns.get('grad_sq'))} | {_g(ns.get('trace'))} "
                  f"| {ns.get('readings', '-')} | {_g(r['train_loss'])} | {r['status']}"
                  + (f": {r['error']}" if r["error"] else "") + " |")
    spread = agree["spread"]
    md += ["", f"**Spread of the final B_simple over {', '.join(s for s in DISTRIBUTED if s in agree['runs'])}: "
           + (f"{spread:.3f} (max / min; target <= {SPREAD}): {'PASS' if agree['pass'] else 'FAIL'}**"
              if spread else "not measured (a run has no B_simple): FAIL**")]
    if agree["spread_by_step"]:
        late = [p for p in agree["spread_by_step"] if p["step"] > first["steps"] // 2]
        md += ["", "Spread at each logged step (max / min over the distributed runs): "
               + ", ".join(f"{p['step']}: {p['spread']:.2f}" for p in agree["spread_by_step"])
               + (f"; largest over the second half {max(p['spread'] for p in late):.2f}." if late else ".")]
    if agree.get("diverged_at"):
        md += ["", f"The distributed runs' global gradient norms first differ by more than {DIVERGED:.0%} at logged "
               f"step {agree['diverged_at']}: the engines' float arithmetic differs in its last bits (reduction order, "
               "optimizer kernels), early training amplifies it, and from there each B_simple estimates a different "
               "trajectory."]
    return md + ["", "![B_simple against step](b_simple.png)", ""]


def _g(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else "-"


def _cost_md(rows: list[dict[str, Any]], lines: list[dict[str, Any]]) -> list[str]:
    costed = [ln for ln in lines if ln["part"] == "cost"]
    if not costed:
        return []
    first = costed[0]
    md = ["## Part 2: what does the measurement cost?", "",
          f"Runs of {first['steps']} steps ({first['warmup']} untimed), each timed by the median of its {WINDOW}-step "
          f"windows after the warm-up; per pair, runs without the measurement (`--noise-every 0`) and with it "
          "alternate, the order reversed every other pair. Ratio = step time on / off. Per reading = (ratio - 1) x "
          "cadence: the cost of one measured step, as a share of a step. "
          f"Target: median ratio <= {COST} at the default cadence ({DEFAULT_EVERY}).", "",
          "| strategy | threads/rank | `--noise-every` | samples/s off | step time on / off: median (min - max) "
          "| per reading | pairs | meets target |", "|---|---|---:|---:|---|---:|---:|---|"]
    for r in rows:
        ln = next(x for x in costed if x["strategy"] == r["strategy"])
        if r["median"] is None:
            md.append(f"| {r['strategy']} | {ln['threads_per_rank']} | {r['noise_every']} | - | - | - | 0 | - |")
            continue
        verdict = ("yes" if r["median"] <= COST else "no") if r["noise_every"] == DEFAULT_EVERY else "-"
        md.append(f"| {r['strategy']} | {ln['threads_per_rank']} | {r['noise_every']} | {r['off_sps']:.1f} | "
                  f"{r['median']:.3f} ({r['min']:.3f} - {r['max']:.3f}) | {100 * r['per_reading']:+.1f}% | "
                  f"{r['pairs']} | {verdict} |")
    implied = [r for r in rows if r["noise_every"] not in (DEFAULT_EVERY,) and r["median"] is not None]
    if implied:
        md += ["", f"The default cadence's cost implied by the denser cadences (per reading / {DEFAULT_EVERY}): "
               + ", ".join(f"{r['strategy']} {100 * r['per_reading'] / DEFAULT_EVERY:+.2f}% "
                           f"(from every {r['noise_every']})" for r in implied) + "."]
    failed = [f"- {r['strategy']} {f}" for r in rows for f in r["failed"]]
    if failed:
        md += ["", "Runs that did not finish:", *dict.fromkeys(failed)]
    wall = sum(ln["wall_seconds"] for ln in lines)
    md += ["", f"CPU budget: {len(lines)} runs, {wall / 60:.1f} minutes of wall time in all (runs one at a time)."]
    return md


def write_report(out_dir: Path) -> Path:
    lines = load(out_dir, "benchmarks.noise_scale")
    first = lines[0]
    hw, ver = first["hardware"], first["versions"]
    agree, rows = agreement(lines), cost(lines)
    plot(lines, out_dir)
    md = [f"# The gradient noise scale under every strategy: {first['arch']}, micro-batch {first['batch_size']}", "",
          f"Command: `{command_line(out_dir)}`  ",
          f"Host: {hw['cpu']} ({hw['cores']} cores), {', '.join(hw['gpus']) or 'no GPU'}; git {ver.get('git')}, "
          f"torch {ver.get('torch')}, deepspeed {ver.get('deepspeed')}", "",
          "B_simple = tr(Σ)/|G|² from one rank's micro-batch gradient against the step's global gradient "
          "(docs/scaling-pays.md).", "",
          *_agree_md(agree, lines), *_cost_md(rows, lines)]
    return write_outputs(out_dir, {"agreement": agree, "cost": rows}, md)


# --- the command line ---------------------------------------------------------------------------------------------

def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("noise_scale", __doc__)
    p.add_argument("--arch", default="crnn_mobilenet_v3_small")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, from " + ",".join(STRATEGIES))
    p.add_argument("--parts", default="agree,cost", help="agree (part 1), cost (part 2), or both")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the distributed runs; single accumulates "
                                                             "as many micro-batches")
    p.add_argument("-b", "--batch-size", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--agree-steps", type=int, default=200, help="optimizer steps of part 1's runs")
    p.add_argument("--agree-every", type=int, default=DEFAULT_EVERY, help="part 1's --noise-every")
    p.add_argument("--agree-smoothing", type=float, default=DEFAULT_SMOOTHING, help="part 1's --noise-smoothing")
    p.add_argument("--cost-steps", type=int, default=100, help="optimizer steps of part 2's runs")
    p.add_argument("--pairs", type=int, default=5, help="part 2's alternating groups per strategy")
    p.add_argument("--cadences", default="10,1", help="part 2's --noise-every values, each against 0")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--wandb-mode", default="disabled", choices=["offline", "disabled"], help="the trainer's")
    args = p.parse_args(argv)
    args.strategies = tuple(s for s in args.strategies.split(",") if s)
    args.parts = tuple(s for s in args.parts.split(",") if s)
    try:
        args.cadences = tuple(int(c) for c in args.cadences.split(",") if c)
    except ValueError:
        args.cadences = (-1,)
    return args


def check(args: argparse.Namespace) -> None:
    from scale_ocr.errors import UserError

    unknown = sorted(set(args.strategies) - set(STRATEGIES))
    if unknown:
        raise UserError(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    if not args.parts or set(args.parts) - {"agree", "cost"}:
        raise UserError("--parts: agree, cost, or agree,cost")
    if not args.cadences or any(c < 1 for c in args.cadences):
        raise UserError("--cadences: positive --noise-every values, comma-separated (each is compared with 0)")
    if args.world_size < 2 or args.batch_size < 1 or args.pairs < 1:
        raise UserError("--world-size must be at least 2 (two batch sizes), -b and --pairs at least 1")
    if args.agree_every < 1 or not 0 <= args.agree_smoothing < 1:
        raise UserError("--agree-every must be at least 1, --agree-smoothing in [0, 1)")
    if args.agree_steps < 2 * args.agree_every or args.cost_steps < 2 * WINDOW + 5:
        raise UserError(f"--agree-steps must be at least {2 * args.agree_every}, "
                        f"--cost-steps at least {2 * WINDOW + 5}")
    if args.out is not None and (args.out / "results.jsonl").exists():
        raise UserError(f"{args.out} already holds results; give a new --out (results folders are never rewritten)")


def main(argv: list[str] | None = None) -> int:
    return bench_main("noise_scale", parse(argv), run, write_report, check)


if __name__ == "__main__":
    run_main(main)
