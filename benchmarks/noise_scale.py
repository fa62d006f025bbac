"""The gradient noise scale under every strategy: do the engines' estimates agree, and what does measuring cost.

    python -m benchmarks.noise_scale --out benchmarks/results/noise-scale-HOST-DATE
    python -m benchmarks.noise_scale --parts agree --agree-steps 20 --out /tmp/ns     # a quick look
    python -m benchmarks.noise_scale --report DIR     # rebuild report.md, summary.json and the plot

Part 1, agreement (issue 54, acceptance 1): the same model, seed and pre-rendered synthetic words are trained by
``scale_ocr/train.py`` with its defaults for the same optimizer steps under ddp, fsdp, zero2 and zero3 on
``--world-size`` ranks accumulating ``--grad-accum`` micro-batches, and under single accumulating world size x
that many, so every run compares a micro-batch of ``-b`` with the same global batch. Each run's B_simple curve
(``noise/b_simple`` in metrics.jsonl) and final value (metrics.json's ``noise_scale``) are read; the four
distributed estimates must agree within 20% (max / min <= 1.2).

The global batch matters. A reading of |G|² is a difference of two squared norms, so where the global batch is far
below B_simple both are mostly noise and a 1% change in either moves the reading by 5-15% (at micro-batch 8 and
global batch 16, against a B_simple near 100, about 14%): runs whose weights have parted in their last bits then
read visibly different values. Part 1 therefore runs at a global batch near the one the estimate is for.

Part 1b, the yardstick (``--parts jitter``): ddp once more, the same seed, data, steps and threads, with its CPU
kernels held one instruction set lower (AVX-512 hosts: AVX2, through ``ATEN_CPU_CAPABILITY`` and
``ONEDNN_MAX_CPU_ISA``). Only the float arithmetic inside its kernels changes (a convolution's weight gradient then
differs in its last bits), so the spread between the two ddp runs is how far one engine's B_simple moves under a
last-bit difference: what the engines' spread is to be read against. (More threads would do the same, but two
ranks of two threads on two cores run ten times slower.)

Part 2, cost, measured within one run: per strategy, ``--cost-runs`` runs at ``--noise-every 2`` with every step
logged, so measured and unmeasured steps alternate on the same host state. The measurement's hooks exist only for
a measured step's backwards, so an unmeasured step runs as with the measurement off. Each measured step after the
warm-up is set against the mean of its two neighbours; the median of those ratios, minus one, is the cost of one
reading as a share of a step, and that over the default cadence (10) is the cost of measuring at the default.
Target: <= 3%. (Timing runs with the measurement off against runs with it on cannot see a few per cent here:
separate runs on this host differ by about 10%.)
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
    refuse_written,
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
COST = 0.03  # the default cadence's share of step time (issue 54, acceptance 1)
COST_EVERY = 2  # part 2's cadence: measured and unmeasured steps alternate
COST_SKIP = 10  # part 2's first steps, left out of its ratios (allocations, the loader filling up)
DEFAULT_EVERY = 10  # the trainer's --noise-every
DEFAULT_SMOOTHING = 0.9  # and its --noise-smoothing
LOWER_ISA = {  # part 1b: the host's CPU capability -> the one below it, and the variables that select it
    "AVX512": ("AVX2", {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}),
    "AVX2": ("SSE4.1", {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}),
}
DIVERGED = 0.05  # the runs' training has parted once their gradient norms at a logged step differ by more
PLOT_META = {"Software": None}  # no version stamp in the PNG: the same results give the same bytes


# --- running ------------------------------------------------------------------------------------------------------

def job(args: argparse.Namespace, strategy: str, steps: int, every: int, cache: str, run_dir: Path,
        smoothing: float, log_every: int) -> tuple[list[str], int, int, int]:
    """Train.py's command for one run, and its ranks, accumulation and threads per rank: ``--world-size`` ranks
    accumulating ``--grad-accum`` micro-batches, or one process accumulating world size x as many (single), so all
    compare ``-b`` with the same global batch."""
    ws = 1 if strategy == "single" else args.world_size
    accum = args.grad_accum * (args.world_size if strategy == "single" else 1)
    cores = args.hw["cores"] or 1
    threads = cores if ws == 1 else max(1, cores // ws)
    cli = [args.arch, "--strategy", strategy, "-b", str(args.batch_size), "--grad-accum", str(accum),
           "--max-steps", str(steps), "--epochs", "1000", "--data-cache", cache, "--seed", str(args.seed),
           "--noise-every", str(every), "--noise-smoothing", str(smoothing), "--log-every", str(log_every),
           "--no-eval", "--no-save-model",
           "--save-every", "0", "--save-minutes", "0", "--resume", "none", "--output-dir", str(run_dir),
           "--wandb-mode", args.wandb_mode, "--run-name", run_dir.name]
    return launch(strategy, ws, TRAIN, cli), ws, accum, threads


def read_run(run_dir: Path) -> dict[str, Any]:
    """A finished run's B_simple curve, its final noise scale, global batch and loss."""
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    summary = json.loads((run_dir / "metrics.json").read_text())
    keys = ("noise/b_simple", "noise/grad_sq", "noise/trace", "train/grad_norm", "train/loss")
    curve = [{"step": r["step"], **{k.split("/")[1]: r[k] for k in keys if k in r}}
             for r in records if any(k.startswith("noise/") for k in r)]
    times = [[r["step"], r["train/step_time"]] for r in records if "train/step_time" in r]
    return {"curve": curve, "noise_scale": summary.get("noise_scale"), "global_batch": summary.get("global_batch"),
            "train_loss": summary.get("train_loss"), "samples_per_sec": summary.get("samples_per_sec"),
            "step_times": times}


def lower_isa() -> tuple[str, dict[str, str]]:
    """Part 1b's kernels: the instruction set one below this host's, and the environment that selects it."""
    import torch

    have = torch.backends.cpu.get_cpu_capability()
    if have not in LOWER_ISA:
        from scale_ocr.errors import UserError

        raise UserError(f"--parts jitter: this CPU's kernels are {have}, with no lower set to hold them at; leave "
                        "jitter out")
    return LOWER_ISA[have]


def run_one(args: argparse.Namespace, part: str, strategy: str, steps: int, every: int, cache: str, run_dir: Path,
            extra: dict[str, Any]) -> dict[str, Any]:
    """Run one job and append its line to results.jsonl."""
    smoothing = DEFAULT_SMOOTHING if part == "cost" else args.agree_smoothing
    cmd, ws, accum, threads = job(args, strategy, steps, every, cache, run_dir, smoothing,
                                  1 if part == "cost" else WINDOW)
    isa, env = lower_isa() if part == "jitter" else (None, {})
    status, error, wall = run_job(cmd, threads, args.timeout, None, env)
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
            "grad_accum": accum, "threads_per_rank": threads, "isa": isa, "arch": args.arch,
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
    """Part 1's run per strategy, then part 2's runs, into ``args.out/results.jsonl``."""
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    args.out.mkdir(parents=True, exist_ok=True)
    write_command(args.out, "noise_scale")
    args.hw, args.versions = hardware(), versions()
    work = work_dir(args.out)
    task = create_task(ModelConfig(arch=args.arch))
    steps = max(args.agree_steps if {"agree", "jitter"} & set(args.parts) else 0,
                args.cost_steps if "cost" in args.parts else 0)
    cache = task_data(task, work, steps * args.batch_size * args.world_size * args.grad_accum)[1]
    if "agree" in args.parts:
        for strategy in args.strategies:
            line = run_one(args, "agree", strategy, args.agree_steps, args.agree_every, cache,
                           work / "runs" / f"agree-{strategy}", {})
            _say(line, "agree")
    if "jitter" in args.parts:
        line = run_one(args, "jitter", DISTRIBUTED[0], args.agree_steps, args.agree_every, cache,
                       work / "runs" / f"jitter-{DISTRIBUTED[0]}", {})
        _say(line, "jitter")
    if "cost" in args.parts:
        for rep in range(args.cost_runs):
            for strategy in args.strategies:
                line = run_one(args, "cost", strategy, args.cost_steps, COST_EVERY, cache,
                               work / "runs" / f"cost-{strategy}-{rep}", {"run": rep})
                _say(line, f"cost [{rep + 1}/{args.cost_runs}]")


# --- the report ---------------------------------------------------------------------------------------------------

def agreement(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Part 1: per strategy its final B_simple; the spread max / min over the distributed strategies."""
    runs = {ln["strategy"]: ln for ln in lines if ln["part"] == "agree"}  # the last line of each strategy
    finals = {s: (ln.get("noise_scale") or {}).get("b_simple") if ln["status"] == "ok" else None
              for s, ln in runs.items()}
    dist = [finals[s] for s in DISTRIBUTED if s in finals]
    measured = [v for v in dist if v]
    spread = max(measured) / min(measured) if len(measured) == len(dist) and len(dist) >= 2 else None
    by_step, apart = parting([runs[s].get("curve") or [] for s in DISTRIBUTED if s in runs])
    spreads = [{"step": st, "spread": r} for st, r in by_step.items()]
    return {"finals": finals, "spread": spread, "diverged_at": apart, "target": SPREAD,
            "jitter": jitter(lines, runs),
            "pass": spread is not None and spread <= SPREAD,
            "spread_by_step": spreads,
            "runs": {s: {k: ln.get(k) for k in ("status", "error", "noise_scale", "global_batch", "train_loss",
                                                "world_size", "grad_accum", "wall_seconds", "samples_per_sec")}
                     for s, ln in runs.items()}}


def parting(curves: list[list[dict[str, Any]]]) -> tuple[dict[int, float], int | None]:
    """Two or more runs' logged curves, step by step: max / min of their B_simple at each step every one measured it,
    and the first such step at which their global gradient norms differ by more than :data:`DIVERGED` (from there
    they are different trajectories)."""
    if len(curves) < 2:
        return {}, None
    at = [{p["step"]: p for p in curve} for curve in curves]
    steps = sorted(set.intersection(*[{st for st, p in a.items() if p.get("b_simple")} for a in at]))
    spread = {st: max(v) / min(v) for st in steps if (v := [a[st]["b_simple"] for a in at])}
    apart = next((st for st in steps if all(v := [a[st].get("grad_norm") for a in at])
                  and max(v) / min(v) > 1 + DIVERGED), None)
    return spread, apart


def jitter(lines: list[dict[str, Any]], runs: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Part 1b: the spread between ddp's part-1 run and its run with its kernels one instruction set lower (a last-bit
    difference), the final B_simple and the largest over the second half, and the logged step at which their
    gradient norms first part."""
    again = [ln for ln in lines if ln["part"] == "jitter" and ln["status"] == "ok"]
    base = runs.get(DISTRIBUTED[0])
    if not again or not base or base["status"] != "ok":
        return None
    finals = [(ln.get("noise_scale") or {}).get("b_simple") for ln in (base, again[-1])]
    ratio, apart = parting([ln.get("curve") or [] for ln in (base, again[-1])])
    late = [r for st, r in ratio.items() if st > base["steps"] // 2]
    return {"strategy": DISTRIBUTED[0], "isa": again[-1].get("isa"),
            "finals": finals, "spread": max(finals) / min(finals) if all(finals) else None,
            "late_max": max(late) if late else None, "diverged_at": apart}


def paired_ratios(times: list[list[float]], warmup: int) -> list[float]:
    """Each measured step's time (an even step, at ``--noise-every 2``) over the mean of its two unmeasured
    neighbours', after the warm-up and :data:`COST_SKIP` steps: the host's drift cancels in each ratio."""
    at = {int(step): t for step, t in times}
    first = max(warmup, COST_SKIP)
    return [at[k] / ((at[k - 1] + at[k + 1]) / 2) for k in sorted(at)
            if k % COST_EVERY == 0 and k > first and k - 1 in at and k + 1 in at and at[k - 1] + at[k + 1] > 0]


def cost(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Part 2: per strategy, the median measured / unmeasured step ratio over its runs, its quartiles, and the cost
    of the default cadence it implies."""
    mine = [ln for ln in lines if ln["part"] == "cost"]
    rows = []
    for strategy in dict.fromkeys(ln["strategy"] for ln in mine):
        runs = [ln for ln in mine if ln["strategy"] == strategy]
        ratios = [r for ln in runs if ln["status"] == "ok" for r in paired_ratios(ln.get("step_times") or [],
                                                                                   ln["warmup"])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [None] * 3
        per = q[1] - 1 if q[1] is not None else None
        rows.append({"strategy": strategy, "runs": len(runs), "steps": len(ratios), "median": q[1],
                     "q1": q[0], "q3": q[2], "per_reading": per,
                     "default_cost": per / DEFAULT_EVERY if per is not None else None,
                     "off_step_s": statistics.median([t for ln in runs if ln["status"] == "ok"
                                                      for k, t in ln.get("step_times") or [] if k % COST_EVERY]
                                                     or [0]),
                     "failed": [f"run {ln['run']}: {ln['status']} {ln['error']}" for ln in runs
                                if ln["status"] != "ok"]})
    return rows


def plot(lines: list[dict[str, Any]], out_dir: Path) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {ln["strategy"]: ln for ln in lines if ln["part"] == "agree" and ln.get("curve")}
    runs |= {f"{ln['strategy']}, kernels at {ln['isa']}": ln for ln in lines
             if ln["part"] == "jitter" and ln.get("curve")}
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for strategy, ln in runs.items():
        points = [p for p in ln["curve"] if p.get("b_simple")]
        label = f"{strategy} ({ln['world_size']} rank{'s' if ln['world_size'] > 1 else ''} x {ln['grad_accum']})"
        ax.plot([p["step"] for p in points], [p["b_simple"] for p in points], marker=".",
                label=label if ln["part"] == "agree" else strategy,
                ls="--" if strategy not in DISTRIBUTED else "-",
                **({"color": "black"} if ln["part"] == "jitter" else {}))
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
    jit = agree.get("jitter")
    if jit and jit["spread"]:
        md += ["", f"**The yardstick** (`--parts jitter`): {jit['strategy']} again, the same seed, data, steps and "
               f"threads, with its CPU kernels held at {jit['isa']} (only the float arithmetic inside its kernels "
               f"differs): final B_simple {jit['finals'][0]:.1f} and {jit['finals'][1]:.1f}, spread "
               f"**{jit['spread']:.3f}**" + (f" (largest over the second half {jit['late_max']:.2f})"
                                            if jit["late_max"] else "")
               + (f"; their gradient norms first differ by more than {DIVERGED:.0%} at logged step "
                  f"{jit['diverged_at']}" if jit["diverged_at"] else "; their gradient norms never differ by more "
                  f"than {DIVERGED:.0%}")
               + ". The engines' spread is to be read against this: one engine under a last-bit change."]
    return md + ["", "![B_simple against step](b_simple.png)", ""]


def _g(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else "-"


def _cost_md(rows: list[dict[str, Any]], lines: list[dict[str, Any]]) -> list[str]:
    costed = [ln for ln in lines if ln["part"] == "cost"]
    if not costed:
        return []
    first = costed[0]
    md = ["## Part 2: what does the measurement cost?", "",
          f"Runs of {first['steps']} steps at `--noise-every {COST_EVERY} --log-every 1` (every step timed; the first "
          f"{max(first['warmup'], COST_SKIP)} left out), micro-batch {first['batch_size']}, "
          f"{first['world_size']} ranks x {first['grad_accum']}. Each measured step is set against the mean of its "
          "two unmeasured neighbours in the same run; per reading = median ratio - 1, the cost of one measured step "
          f"as a share of a step; at the default cadence ({DEFAULT_EVERY}) that is paid once every {DEFAULT_EVERY} "
          "steps. "
          f"Target: <= {COST:.0%} of step time at the default cadence.", "",
          "| strategy | threads/rank | step time, unmeasured | measured / unmeasured: median (quartiles) | steps "
          "| per reading | default cadence | meets target |", "|---|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        ln = next(x for x in costed if x["strategy"] == r["strategy"])
        if r["median"] is None:
            md.append(f"| {r['strategy']} | {ln['threads_per_rank']} | - | - | 0 | - | - | - |")
            continue
        md.append(f"| {r['strategy']} | {ln['threads_per_rank']} | {1000 * r['off_step_s']:.1f} ms | "
                  f"{r['median']:.3f} ({r['q1']:.3f} - {r['q3']:.3f}) | {r['steps']} | "
                  f"{100 * r['per_reading']:+.1f}% | {100 * r['default_cost']:+.2f}% | "
                  f"{'yes' if r['default_cost'] <= COST else 'no'} |")
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
    p.add_argument("--parts", default="agree,jitter,cost", help="comma-separated: agree (part 1), jitter (part 1b: "
                   "ddp again with its kernels one instruction set lower, the yardstick), cost (part 2)")
    p.add_argument("--world-size", type=int, default=2, help="ranks of the distributed runs; single accumulates "
                                                             "as many micro-batches")
    p.add_argument("-b", "--batch-size", type=int, default=16, help="micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches each rank accumulates per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--agree-steps", type=int, default=200, help="optimizer steps of part 1's runs")
    p.add_argument("--agree-every", type=int, default=DEFAULT_EVERY, help="part 1's --noise-every")
    p.add_argument("--agree-smoothing", type=float, default=DEFAULT_SMOOTHING, help="part 1's --noise-smoothing")
    p.add_argument("--cost-steps", type=int, default=120, help="optimizer steps of part 2's runs")
    p.add_argument("--cost-runs", type=int, default=1, help="part 2's runs per strategy")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--wandb-mode", default="disabled", choices=["offline", "disabled"], help="the trainer's")
    args = p.parse_args(argv)
    args.strategies = tuple(s for s in args.strategies.split(",") if s)
    args.parts = tuple(s for s in args.parts.split(",") if s)
    return args


def check(args: argparse.Namespace) -> None:
    from scale_ocr.errors import UserError

    unknown = sorted(set(args.strategies) - set(STRATEGIES))
    if unknown:
        raise UserError(f"--strategies: unknown {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    if not args.parts or set(args.parts) - {"agree", "jitter", "cost"}:
        raise UserError(f"--parts {','.join(args.parts)}: give some of agree, jitter and cost, comma-separated")
    if args.world_size < 2 or min(args.batch_size, args.grad_accum, args.cost_runs) < 1:
        raise UserError("--world-size must be at least 2 (two batch sizes), -b, --grad-accum and --cost-runs at "
                        "least 1")
    if args.agree_every < 1 or not 0 <= args.agree_smoothing < 1:
        raise UserError("--agree-every must be at least 1, --agree-smoothing in [0, 1)")
    if args.agree_steps < 2 * args.agree_every or args.cost_steps < 2 * WINDOW + 5:
        raise UserError(f"--agree-steps must be at least {2 * args.agree_every}, "
                        f"--cost-steps at least {2 * WINDOW + 5}")
    refuse_written(args.out)


def main(argv: list[str] | None = None) -> int:
    return bench_main("noise_scale", parse(argv), run, write_report, check)


if __name__ == "__main__":
    run_main(main)
