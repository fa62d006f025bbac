"""Does a batch that grows while it pays (``--batch-ramp auto``) reach an accuracy in fewer steps than any fixed batch?

    python -m benchmarks.batch_ramp --out benchmarks/results/batch-ramp-HOST-DATE [--sets synthetic real] \\
        [--strategies ddp zero2] [--record benchmarks/results/scale-accuracy-vm-20261204]
    python -m benchmarks.batch_ramp --report DIR      # rebuild report.md, summary.json and the plot

The record (:mod:`benchmarks.scale_accuracy`) trained crnn_mobilenet_v3_small at fixed global batches 32..512 for
the same samples. This benchmark trains its batch-32 job again, the same command (data, rule ``none``, schedule,
budget in samples, seed) but for ``--batch-ramp auto``, under each ``--strategies`` engine on 2 ranks, validating
every ``--eval-every`` optimizer steps. Issue 54's acceptance line 4 holds the ramp against the best fixed batch
chosen in hindsight: the fewest optimizer steps to the target among the record's fixed batches that reach it on at
most 1.2x the samples batch 32 needs (the issue's reading: a measurement's steps and samples, the first at or above
the target). On real-looking crops the ramp must also take at least 20% fewer steps than batch 32, on at most 1.2x
its samples. The same command under zero2 must end within 2 points of ddp's final exact match.

A job that ended ``ok`` is not run again; an interrupted one continues from its last checkpoint (one is saved at
each validation). Each job is one line of ``results.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    REPO,
    append_line,
    bench_main,
    command_line,
    hardware,
    load,
    parser,
    run_job,
    run_main,
    versions,
    work_dir,
    write_command,
    write_outputs,
)
from scale_ocr.config import RAMP_LIMIT, RAMP_LR_RULES

MODEL = "crnn_mobilenet_v3_small"
TARGETS = {"synthetic": 0.9, "real": 0.8}  # issue 54, acceptance 4
SETS = {"synthetic": "synthetic words", "real": "real-looking crops"}
SAMPLES_SLACK = 1.2  # the ramp, and the fixed batches it is held against, on at most this x batch 32's samples
FEWER = 0.8  # on real-looking crops the ramp takes at most this x batch 32's steps
POINTS = 0.02  # zero2's final exact match within this of ddp's
START = 32  # the record's job the ramp starts from: its smallest batch, rule none
PLOT_META = {"Software": None}  # no version stamp in the PNG: the same results give the same bytes


def record_job(record: Path, set_name: str) -> dict[str, Any]:
    """The record's batch-32, rule-none job of ``set_name`` (its results line)."""
    rows = [r for r in load(record, "benchmarks.scale_accuracy") if r.get("status") == "ok" and r["model"] == MODEL
            and r["set"] == set_name and r["global_batch"] == START and r["rule"] == "none"]
    if not rows:
        from scale_ocr.errors import UserError

        raise UserError(f"{record}: no finished {MODEL} job at global batch {START}, rule none, on {set_name}; give "
                        "a scale-accuracy record of the record preset (--record)")
    return rows[-1]


def job_command(args: argparse.Namespace, row: dict[str, Any], strategy: str, work: Path,
                run_dir: Path) -> list[str]:
    """The record job's command for ``strategy`` with the ramp on, its data rebuilt here (the same words: the set
    is generated from its seed), validating and saving every ``--eval-every`` steps."""
    from benchmarks.scale_accuracy import command, job_data
    from benchmarks.scale_accuracy_plan import PRESETS, Job

    preset = PRESETS["record"]
    fields = {k: row[k] for k in ("kind", "model", "set", "global_batch", "rule", "world_size", "micro_batch",
                                  "grad_accum", "samples", "reference_batch")}
    job = Job(**fields, eval_every=args.eval_every)
    sizes = argparse.Namespace(synthetic_train=preset["synthetic_train"], real_train=preset["real_train"],
                               val=preset["val"], real_crops=args.real_crops)
    data, _ = job_data(sizes, job, work)
    cmd = command(args, job, data, row["train_size"], run_dir)
    cmd[cmd.index("--strategy") + 1] = strategy
    ramp = ["--batch-ramp", "auto"] + (["--ramp-limit", str(args.ramp_limit)] if args.ramp_limit else [])
    if args.ramp_max_batch:
        ramp += ["--ramp-max-batch", str(args.ramp_max_batch)]
    if args.ramp_lr:
        ramp += ["--ramp-lr", args.ramp_lr]
    return [*cmd, *ramp]


def read_run(run_dir: Path) -> dict[str, Any]:
    """A finished run's validation curve (step, samples, value), its batch at each logged step and its ramp."""
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    summary = json.loads((run_dir / "metrics.json").read_text())
    curve = [{"step": r["step"], "samples": r["samples"], "value": r["val/exact_match"]}
             for r in records if "val/exact_match" in r and "samples" in r]
    batches = [[r["step"], r["train/global_batch"]] for r in records if "train/global_batch" in r]
    noise = [[r["step"], r["noise/b_simple"]] for r in records if "noise/b_simple" in r]
    return {"curve": curve, "batches": batches, "b_simple": noise, "batch_ramp": summary.get("batch_ramp"),
            "steps": summary.get("steps"), "samples": summary.get("samples"),
            "final": summary.get("exact_match"), "wall": summary.get("wall_seconds")}


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    write_command(args.out, "batch_ramp")
    work, results = work_dir(args.out), args.out / "results.jsonl"
    done = {(r["set"], r["strategy"]) for r in (load(args.out, "benchmarks.batch_ramp") if results.is_file() else [])
            if r["status"] == "ok"}
    hw = hardware()
    threads = max(1, (hw["cores"] or 1) // 2)
    for set_name in args.sets:
        row = record_job(args.record, set_name)
        for strategy in args.strategies:
            if (set_name, strategy) in done:
                continue
            name = f"{MODEL}-{set_name}-ramp-{strategy}"
            run_dir = work / "runs" / name
            if not (run_dir / "checkpoints").is_dir():
                shutil.rmtree(run_dir, ignore_errors=True)  # this benchmark's own scratch, with nothing to resume
            cmd = job_command(args, row, strategy, work, run_dir)
            status, error, wall = run_job(cmd, threads, args.timeout, None)
            got = read_run(run_dir) if status == "ok" else {}
            line = {"set": set_name, "strategy": strategy, "record": _shown(args.record), "status": status,
                    "error": error, "wall_seconds": wall,
                    "start_batch": START, "eval_every": args.eval_every, "ramp_limit": args.ramp_limit or RAMP_LIMIT,
                    "ramp_lr": ((got.get("batch_ramp") or {}).get("lr_rule") or args.ramp_lr),
                    "budget_samples": row["samples"], **got,
                    "command": " ".join(cmd).replace(f"{REPO}/", ""), "versions": versions(), "hardware": hw}
            append_line(results, line)
            print(f"batch_ramp {name}: {status} [{wall:.0f} s]" + (f" ({error})" if error else ""), flush=True)


# --- the report ---------------------------------------------------------------------------------------------------

def first_at(curve: list[dict[str, Any]], target: float, batch: int | None = None) -> dict[str, Any] | None:
    """The first measurement at or above ``target`` (its step and samples; a fixed batch's samples are step x
    ``batch``), or None."""
    for p in curve:
        if p["value"] >= target:
            return {"steps": p["step"], "samples": p.get("samples", p["step"] * (batch or 0))}
    return None


def fixed_batches(record: Path, set_name: str, target: float) -> dict[int, dict[str, Any]]:
    """Per fixed global batch of the record: the fewest steps to ``target`` over its rules, with their samples."""
    out: dict[int, dict[str, Any]] = {}
    for r in load(record, "benchmarks.scale_accuracy"):
        if r.get("status") != "ok" or r["model"] != MODEL or r["set"] != set_name:
            continue
        hit = first_at(r["curve"], target, r["global_batch"])
        best = out.get(r["global_batch"])
        if hit is not None and (best is None or hit["steps"] < best["steps"]):
            out[r["global_batch"]] = {**hit, "rule": r["rule"]}
    return dict(sorted(out.items()))


def verdicts(rows: list[dict[str, Any]], record: Path) -> list[dict[str, Any]]:
    """Per set and engine: the ramp's steps and samples to the target against batch 32 and the best fixed batch."""
    out = []
    finals = {(r["set"], r["strategy"]): r.get("final") for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        target = TARGETS[r["set"]]
        fixed = fixed_batches(record, r["set"], target)
        base = fixed.get(START)
        allowed = SAMPLES_SLACK * base["samples"] if base else math.inf
        eligible = {b: f for b, f in fixed.items() if f["samples"] <= allowed}
        best_batch = min(eligible, key=lambda b: eligible[b]["steps"]) if eligible else None
        hit = first_at(r["curve"], target)
        beats = (hit is not None and best_batch is not None and hit["steps"] <= eligible[best_batch]["steps"]
                 and hit["samples"] <= allowed)
        fewer = (hit is not None and base is not None and hit["steps"] <= FEWER * base["steps"]
                 and hit["samples"] <= allowed) if r["set"] == "real" else None
        ddp = finals.get((r["set"], "ddp"))
        close = (abs(r["final"] - ddp) <= POINTS if r["strategy"] != "ddp" and ddp is not None
                 and r.get("final") is not None else None)
        out.append({"set": r["set"], "strategy": r["strategy"], "target": target, "ramp": hit, "batch32": base,
                    "best_batch": best_batch, "best": eligible.get(best_batch), "samples_allowed": allowed,
                    "beats_best": beats, "fewer_than_32": fewer, "final": r.get("final"), "within_ddp": close,
                    "path": [(c["after"], c["step"]) for c in (r.get("batch_ramp") or {}).get("changes", [])]})
    return out


def plot(rows: list[dict[str, Any]], record: Path, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for set_name in dict.fromkeys(r["set"] for r in rows if r["status"] == "ok"):
        fig, (acc, sizes) = plt.subplots(1, 2, figsize=(11, 4))
        fixed: dict[int, dict[str, Any]] = {}  # per batch up to 128: rule none, or the one rule it was trained under
        for r in load(record, "benchmarks.scale_accuracy"):
            if r.get("status") == "ok" and r["model"] == MODEL and r["set"] == set_name and r["global_batch"] <= 128 \
                    and (r["rule"] == "none" or r["global_batch"] not in fixed):
                fixed[r["global_batch"]] = r
        for batch, r in sorted(fixed.items()):
            acc.plot([p["step"] for p in r["curve"]], [p["value"] for p in r["curve"]], linestyle="--",
                     label=f"fixed {batch} ({r['rule']})")
        for r in rows:
            if r["status"] == "ok" and r["set"] == set_name:
                acc.plot([p["step"] for p in r["curve"]], [p["value"] for p in r["curve"]],
                         label=f"ramp ({r['strategy']})")
                sizes.step([s for s, _ in r["batches"]], [b for _, b in r["batches"]], where="post",
                           label=f"global batch ({r['strategy']})")
                sizes.plot([s for s, _ in r["b_simple"]], [v for _, v in r["b_simple"]], alpha=0.6,
                           label=f"B_simple ({r['strategy']})")
        acc.axhline(TARGETS[set_name], color="grey", linewidth=0.8)
        acc.set(xlabel="optimizer step", ylabel="exact match", title=f"{SETS[set_name]}: accuracy by step")
        sizes.set(xlabel="optimizer step", ylabel="samples", yscale="log", title="the ramp's batch and B_simple")
        for ax in (acc, sizes):
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        name = f"ramp-{set_name}.png"
        fig.savefig(out_dir / name, dpi=100, metadata=PLOT_META)
        plt.close(fig)
        names.append(name)
    return names


def write_report(out_dir: Path) -> Path:
    rows = load(out_dir, "benchmarks.batch_ramp")
    record = REPO / rows[0]["record"]  # every line names the record it was measured against
    found = verdicts(rows, record)
    md = ["# A batch that grows while it pays: --batch-ramp auto against fixed batches", "",
          f"Command: `{command_line(out_dir)}`; rebuild: `python -m benchmarks.batch_ramp --report {out_dir}`", "",
          f"- The record's {MODEL} job at global batch {START} (rule none, its schedule and samples), trained again "
          f"with `--batch-ramp auto` {rate_rule(rows[0])}, against the record's fixed batches "
          f"({rows[0]['record']}). Steps and samples to a target: "
          "the first validation at or above it.",
          f"- Best fixed batch: the fewest steps to the target among those reaching it on at most {SAMPLES_SLACK}x "
          f"batch {START}'s samples (issue 54, acceptance 4).", "",
          "| set | engine | target | ramp: steps, samples | batch 32: steps, samples | best fixed: batch, steps, "
          "samples | ramp matches or beats it | ramp <= 0.8x batch 32's steps | final exact match | the batch's path |",
          "|---|---|---:|---|---|---|---|---|---:|---|"]
    for v in found:
        ramp = f"{v['ramp']['steps']}, {v['ramp']['samples']}" if v["ramp"] else "not reached"
        base = f"{v['batch32']['steps']}, {v['batch32']['samples']}" if v["batch32"] else "-"
        best = (f"{v['best_batch']} ({v['best']['rule']}), {v['best']['steps']}, {v['best']['samples']}"
                if v["best"] else "-")
        fewer = "-" if v["fewer_than_32"] is None else "yes" if v["fewer_than_32"] else "no"
        final = f"{v['final']:.1%}" + ("" if v["within_ddp"] is None else
                                        f" ({'within' if v['within_ddp'] else 'beyond'} 2 points of ddp)")
        path = ", ".join(f"{b} at step {s}" for b, s in v["path"]) or "stayed"
        md.append(f"| {SETS[v['set']]} | {v['strategy']} | {v['target']:.0%} | {ramp} | {base} | {best} | "
                  f"{'yes' if v['beats_best'] else 'no'} | {fewer} | {final} | {path} |")
    md += ["", *[f"![{p}]({p})" for p in plot(rows, record, out_dir)]]
    return write_outputs(out_dir, {"record": rows[0]["record"], "verdicts": found}, md)


def rate_rule(row: dict[str, Any]) -> str:
    """How a ramp row's rate followed its batch, in the report's words (rows from before ``--ramp-lr`` say it with
    ``lr_scaling``: none held the rate, which ``--ramp-lr none`` does now)."""
    if row.get("ramp_lr"):
        return f"(`--ramp-lr {row['ramp_lr']}`: the rate grows by it with the batch, from the job's at batch {START})"
    if row.get("lr_scaling", "none") == "none":
        return "(the rate held at the job's, as the ramp did before `--ramp-lr`: now `--ramp-lr none`)"
    return (f"and `--lr-scaling {row['lr_scaling']} --lr-reference-batch {START}` (the rate grows with the batch from "
            f"the job's; now the default, `--ramp-lr {row['lr_scaling']}`)")


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it lies in it."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


DEFAULT_RECORD = "benchmarks/results/scale-accuracy-vm-20261204"


def add_job_args(p: argparse.ArgumentParser) -> None:
    """The flags the record's job is rebuilt with (:func:`job_command` reads them); benchmarks.plan_check's too."""
    p.add_argument("--record", type=Path, default=REPO / DEFAULT_RECORD, help="the scale-accuracy record")
    p.add_argument("--eval-every", type=int, default=64, help="optimizer steps between validations")
    p.add_argument("--real-crops", type=Path, default=None)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb-mode", default="disabled", choices=("offline", "disabled"))


def check_record(args: argparse.Namespace) -> None:
    from scale_ocr.errors import UserError

    if not (args.record / "results.jsonl").is_file():
        raise UserError(f"--record {args.record}: no results.jsonl there; give a scale-accuracy record")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("batch_ramp", __doc__)
    add_job_args(p)
    p.add_argument("--sets", nargs="+", choices=tuple(TARGETS), default=list(TARGETS))
    p.add_argument("--strategies", nargs="+", default=["ddp", "zero2"])
    p.add_argument("--ramp-limit", type=float, default=None, help="default: the trainer's")
    p.add_argument("--ramp-max-batch", type=int, default=None)
    p.add_argument("--ramp-lr", choices=RAMP_LR_RULES, default=None, help="the trainer's --ramp-lr: the rule the rate "
                   "follows as the batch grows, from the record job's rate at batch 32 (default: the trainer's, sqrt)")
    p.add_argument("--timeout", type=int, default=4 * 3600, help="seconds per training job")
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> None:
    from scale_ocr.errors import UserError

    check_record(args)
    if args.eval_every < 1:
        raise UserError(f"--eval-every {args.eval_every}: give a number of steps")


def main(argv: list[str] | None = None) -> int:
    return bench_main("batch_ramp", parse(argv), run, write_report, check)


if __name__ == "__main__":
    run_main(main)
