"""The critical batch fitted from a scale-accuracy record: the knee of steps-to-target against the global batch.

    python -m benchmarks.critical_batch benchmarks/results/scale-accuracy-vm-20261204 [LATER_RECORD ...] \\
        --out benchmarks/results/critical-batch-vm-DATE [--noise crnn_mobilenet_v3_small/synthetic=RUN_DIR ...]
    python -m benchmarks.critical_batch --report DIR     # rebuild report.md, summary.json and the plots

McCandlish et al. (2018, arXiv 1812.06162) find that, for a fixed target, the optimizer steps S and the samples
E = B x S that a batch B needs trade off as (S/S_min - 1)(E/E_min - 1) = 1, that is S(B) = S_min + E_min/B: below
the critical batch B_crit = E_min/S_min a larger batch saves steps almost in proportion, above it hardly any. Their
gradient noise scale B_simple (docs/scaling-pays.md, measured in every run) predicts B_crit.

For each model and data set of the record (benchmarks.scale_accuracy) and each target exact match, a global batch's
steps to the target are the first crossing of its validation curve, linear between the measurements (every 8,192
samples), and the fewest over the record's rate rules (the paper assumes a rate tuned at every batch). S = S_min +
E_min/B is fitted by least squares in 1/B over the batches that reach the target (two at least); a batch that stops
short is drawn as a lower bound (its last step), and the report says whether the fit respects it. ``--noise
GROUP=RUN`` sets a run's online B_simple beside that group's knee, per target two ways (its metrics.jsonl):

* at the target: the smoothed value logged when its validation first reached it;
* along the path to it, the one the knee is compared with: if every stretch of training obeys the relation with
  its own noise scale B(t), a step at batch B makes 1 / (1 + B(t)/B) of an ideal step, and summing gives
  S(B) = S_min + (the mean of B(t) over the ideal steps) S_min / B: the knee of a run to a target is B_simple
  averaged over the way there, each reading weighted by 1 / (1 + B_simple/B) at the run's batch B. Near the end
  of training |G|^2 falls toward its estimate's noise and B_simple at the target reads 10 to 100 times the knee,
  while the path's mean stays within 2x (benchmarks/results/README.md, critical_batch).

Issue 54 asks for the knee and the online B_simple within 2x.

Several records may be given, oldest first: a group (model and set) that a later record holds is taken from that
record alone, whole. That is how a group is refitted after the trainer changed (a record at today's code), without
mixing its batches with runs of the older code.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    append_line,
    bench_main,
    command_line,
    load,
    parser,
    refuse_written,
    run_main,
    write_command,
    write_outputs,
)

TARGETS = (0.3, 0.5, 0.7, 0.8, 0.9)  # exact match
AGREE = 2.0  # the knee within this factor of the online B_simple (issue 54, acceptance 3)
SETS = {"synthetic": "synthetic words", "real": "real-looking crops"}
PLOT_META = {"Software": None}  # no version stamp in the PNG: the same results give the same bytes


def crossing(curve: list[dict[str, Any]], target: float) -> float | None:
    """The step at which ``curve`` (points with ``step`` and ``value``) first reaches ``target``, linear between
    measurements; None if it never does."""
    previous = None
    for point in curve:
        if point["value"] >= target:
            if previous is None:
                return float(point["step"])
            frac = (target - previous["value"]) / (point["value"] - previous["value"])
            return previous["step"] + frac * (point["step"] - previous["step"])
        previous = point
    return None


def steps_to_target(records: list[dict[str, Any]], target: float) -> dict[tuple[str, str], dict[int, dict]]:
    """Per (model, set) and global batch: the fewest steps to ``target`` over the rules (``reached``), or the most
    steps any rule trained without reaching it (a lower bound)."""
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for r in records:
        if r.get("status") != "ok" or r.get("kind", "recognition") != "recognition" or not r.get("curve"):
            continue
        group, batch = out.setdefault((r["model"], r["set"]), {}), int(r["global_batch"])
        step = crossing(r["curve"], target)
        best = group.get(batch)
        if step is not None and (best is None or not best["reached"] or step < best["steps"]):
            group[batch] = {"steps": step, "reached": True, "rule": r["rule"]}
        elif step is None and (best is None or (not best["reached"] and r["steps"] > best["steps"])):
            group[batch] = {"steps": float(r["steps"]), "reached": False, "rule": r["rule"]}
    return out


def fit(points: dict[int, dict]) -> dict[str, Any] | None:
    """S = S_min + E_min/B by least squares over the batches that reached the target; None with fewer than two."""
    import numpy as np

    reached = sorted((b, p["steps"]) for b, p in points.items() if p["reached"])
    if len(reached) < 2:
        return None
    x = np.array([[1.0, 1.0 / b] for b, _ in reached])
    s_min, e_min = (float(v) for v in np.linalg.lstsq(x, np.array([s for _, s in reached]), rcond=None)[0])
    knee = e_min / s_min if s_min > 0 and e_min > 0 else None
    # a batch that stopped short: the fit must not predict that it got there within the steps it trained
    bounds = {b: p["steps"] for b, p in points.items() if not p["reached"]}
    broken = sorted(b for b, s in bounds.items() if s_min + e_min / b <= s)
    return {"s_min": s_min, "e_min": e_min, "b_crit": knee, "batches": [b for b, _ in reached],
            "short_of_target_but_predicted_there": broken}


def run(args: argparse.Namespace) -> None:
    """One line per group, target and batch (steps to the target), and one per ``--noise`` run."""
    args.out.mkdir(parents=True, exist_ok=True)
    write_command(args.out, "critical_batch")
    for record, lines in latest_groups(args.record):
        for target in TARGETS:
            for (model, data), points in steps_to_target(lines, target).items():
                for batch, p in sorted(points.items()):
                    append_line(args.out / "results.jsonl", {"kind": "steps", "model": model, "set": data,
                                                             "target": target, "global_batch": batch, **p,
                                                             "record": str(record)})
    for group, run_dir in args.noise:
        model, _, data = group.partition("/")
        noise = json.loads((run_dir / "metrics.json").read_text()).get("noise_scale") or {}
        records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        batch = json.loads((run_dir / "metrics.json").read_text()).get("global_batch") or noise.get("b_big")
        for target in TARGETS:
            step, b_simple = at_target(records, target)
            append_line(args.out / "results.jsonl", {
                "kind": "noise", "model": model, "set": data, "run": str(run_dir), "target": target,
                "b_simple": b_simple, "b_simple_path": along(records, step, batch), "batch": batch,
                "at_step": step, "final_b_simple": noise.get("b_simple"),
                **{k: noise.get(k) for k in ("b_small", "b_big", "readings", "every")}})


def latest_groups(records: list[Path]) -> list[tuple[Path, list[dict[str, Any]]]]:
    """Each record with the lines of the groups (model, set) no later record holds: a later record's group
    replaces the earlier ones' whole."""
    loaded = [(path, load(path, "benchmarks.scale_accuracy")) for path in records]
    owner = {(ln.get("model"), ln.get("set")): path for path, lines in loaded for ln in lines}
    return [(path, [ln for ln in lines if owner[(ln.get("model"), ln.get("set"))] == path]) for path, lines in loaded]


def at_target(records: list[dict[str, Any]], target: float, metric: str = "val/exact_match") -> tuple[int | None,
                                                                                                      float | None]:
    """The step at which a run's validation first reached ``target`` and its smoothed B_simple then (the last one
    logged at or before that step): B_crit grows as the loss falls, so each target's knee is set against the noise
    scale the run measured where it got there. (None, None) if it never did."""
    from scale_ocr.planning.to_target import first_reach, value_at

    scores = [(r["step"], r[metric]) for r in records if r.get(metric) is not None]
    reached = first_reach([s for s, _ in scores], [v for _, v in scores], target)
    if reached is None:
        return None, None
    noise = [(r["step"], r["noise/b_simple"]) for r in records if r.get("noise/b_simple")]
    return reached, value_at([s for s, _ in noise], [v for _, v in noise], reached)


def along(records: list[dict[str, Any]], step: int | None, batch: float | None) -> float | None:
    """:func:`~scale_ocr.planning.to_target.path_mean` of a run's logged B_simple up to ``step``."""
    from scale_ocr.planning.to_target import path_mean

    noise = [(r["step"], r["noise/b_simple"]) for r in records if r.get("noise/b_simple")]
    if step is None or not batch or not noise:
        return None
    return path_mean([s for s, _ in noise], [v for _, v in noise], step, batch)


def analyse(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per group and target: the points, the fit, and the online B_simple with its ratio to the knee."""
    noise = {(ln["model"], ln["set"], ln.get("target")): ln for ln in lines if ln["kind"] == "noise"}
    groups: dict[tuple[str, str, float], dict[int, dict]] = {}
    for ln in lines:
        if ln["kind"] == "steps":
            groups.setdefault((ln["model"], ln["set"], ln["target"]), {})[ln["global_batch"]] = ln
    rows = []
    for (model, data, target), points in groups.items():
        found = fit(points)
        line = noise.get((model, data, target)) or {}
        online = line.get("b_simple_path") or line.get("b_simple")  # records before the path mean: at the target
        knee = found["b_crit"] if found else None
        ratio = max(knee / online, online / knee) if knee and online else None
        rows.append({"model": model, "set": data, "target": target, "fit": found, "b_simple": line.get("b_simple"),
                     "b_simple_path": line.get("b_simple_path"), "ratio": ratio,
                     "agree": ratio is not None and ratio <= AGREE,
                     "points": {b: {k: p[k] for k in ("steps", "reached", "rule")} for b, p in sorted(points.items())}})
    return sorted(rows, key=lambda r: (r["model"], r["set"], r["target"]))


def plot(rows: list[dict[str, Any]], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = []
    for model, data in dict.fromkeys((r["model"], r["set"]) for r in rows):
        mine = [r for r in rows if (r["model"], r["set"]) == (model, data) and r["fit"]]
        if not mine:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for r in mine:
            pts = sorted((int(b), p) for b, p in r["points"].items())
            line = ax.plot([b for b, p in pts if p["reached"]], [p["steps"] for b, p in pts if p["reached"]],
                           "o", label=f"{r['target']:.0%}: B_crit {r['fit']['b_crit']:.0f}"
                           if r["fit"]["b_crit"] else f"{r['target']:.0%}")[0]
            short = [(b, p["steps"]) for b, p in pts if not p["reached"]]
            if short:
                ax.plot(*zip(*short, strict=True), "^", color=line.get_color(), alpha=0.5)
            grid = np.geomspace(min(b for b, _ in pts), max(b for b, _ in pts), 50)
            ax.plot(grid, r["fit"]["s_min"] + r["fit"]["e_min"] / grid, "-", color=line.get_color(), alpha=0.6)
        for r in mine:  # the online B_simple where the run reached each target: a marker on that target's fit
            online = r["b_simple_path"] or r["b_simple"]
            if online:
                f = r["fit"]
                ax.plot([online], [f["s_min"] + f["e_min"] / online], "kx", ms=9)
        if any(r["b_simple_path"] for r in mine):
            ax.plot([], [], "kx", label="online B_simple along a run's way to it")
        elif any(r["b_simple"] for r in mine):
            ax.plot([], [], "kx", label="online B_simple where a run reached it")
        ax.set(xscale="log", yscale="log", xlabel="global batch", ylabel="optimizer steps to the target",
               title=f"{model}, {SETS.get(data, data)}\nsteps to each exact match (triangles: stopped short)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"knee_{model}_{data}.png"
        fig.savefig(out_dir / name, dpi=110, metadata=PLOT_META)
        plt.close(fig)
        names.append(name)
    return names


def write_report(out_dir: Path) -> Path:
    lines = load(out_dir, "benchmarks.critical_batch")
    rows = analyse(lines)
    pngs = plot(rows, out_dir)
    paths = any(r["b_simple_path"] for r in rows)  # records before the path mean keep their table
    records = dict.fromkeys(ln["record"] for ln in lines if ln["kind"] == "steps") or {"?": None}
    owners = dict.fromkeys(f"{SETS.get(ln['set'], ln['set'])} of {ln['model']} from `{ln['record']}`"
                           for ln in lines if ln["kind"] == "steps")
    md = ["# The critical batch, fitted from a scale-accuracy record", "",
          f"Command: `{command_line(out_dir)}`  ", "Record: " + ", ".join(f"`{r}`" for r in records), ""]
    if len(records) > 1:
        md += ["A group (model and set) held by a later record is taken from it alone: " + "; ".join(owners) + ".",
               ""]
    md += ["S(B) = S_min + E_min/B fitted to each global batch's fewest steps to the target over the record's rate "
           "rules; B_crit = E_min/S_min, the knee (McCandlish et al. 2018). A batch that stops short of the target "
           "is a lower bound; `respects the bounds` says whether the fit predicts none of those reached it. "
           f"Online B_simple from a run's metrics.json where given; the target is the two within {AGREE:.0f}x."
           + (" Along the way: B_simple averaged over the run's readings up to the target, each weighted by "
              "1 / (1 + B_simple / B) at the run's batch B, the ideal steps it stands for: the knee of the integrated "
              "relation (the module's docstring), and what the knee is compared with." if paths else ""), "",
           *(["| model | set | target | steps to it per batch (rule) | S_min | E_min | B_crit | respects the bounds "
             "| online B_simple there | along the way there | knee / B_simple along the way |",
             "|---|---|---:|---|---:|---:|---:|---|---:|---:|---|"] if paths else
            ["| model | set | target | steps to it per batch (rule) | S_min | E_min | B_crit | respects the bounds "
             "| online B_simple there | knee / B_simple |", "|---|---|---:|---|---:|---:|---:|---|---:|---|"])]
    for r in rows:
        pts = ", ".join(f"{b}: {p['steps']:.0f} ({p['rule']})" if p["reached"] else f"{b}: {p['steps']:.0f}+"
                        for b, p in r["points"].items())
        f = r["fit"]
        knee = f"{f['b_crit']:.0f}" if f and f["b_crit"] else "-"
        bounds = ("yes" if not f["short_of_target_but_predicted_there"] else
                  "no: " + ", ".join(map(str, f["short_of_target_but_predicted_there"]))) if f else "-"
        ratio = (f"{r['ratio']:.2f} ({'within' if r['agree'] else 'beyond'} {AGREE:.0f}x)" if r["ratio"] else "-")
        online = f"{r['b_simple']:.0f}" if r["b_simple"] else "-"
        if paths:
            online += f" | {r['b_simple_path']:.0f}" if r["b_simple_path"] else " | -"
        fitted = f"{f['s_min']:.0f} | {f['e_min']:.0f} | {knee} | {bounds}" if f else "- | - | - | -"
        md.append(f"| {r['model']} | {SETS.get(r['set'], r['set'])} | {r['target']:.0%} | {pts or 'none reached'} "
                  f"| {fitted} | {online} | {ratio} |")
    md += ["", "`+`: stopped short of the target after that many steps (every rule).", ""]
    md += [f"![{p}]({p})" for p in pngs]
    return write_outputs(out_dir, {"rows": rows}, md)


def _noise_arg(text: str) -> tuple[str, Path]:
    group, sep, run_dir = text.partition("=")
    if not sep or "/" not in group:
        raise argparse.ArgumentTypeError(f"{text!r}: give MODEL/SET=RUN_DIR, e.g. crnn_mobilenet_v3_small/synthetic="
                                         "runs/noise")
    return group, Path(run_dir)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("critical_batch", __doc__)
    p.add_argument("record", type=Path, nargs="*",
                   help="scale-accuracy results folders (benchmarks.scale_accuracy), oldest first: a group a later "
                        "one holds replaces the earlier ones' whole")
    p.add_argument("--noise", type=_noise_arg, action="append", default=[],
                   help="MODEL/SET=RUN_DIR: a run whose metrics.json holds that group's online B_simple")
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> None:
    from scale_ocr.errors import UserError

    if not args.record:
        raise UserError("give a scale-accuracy results folder (one with results.jsonl), e.g. "
                        "benchmarks/results/scale-accuracy-vm-20261204")
    for record in args.record:
        if not (record / "results.jsonl").is_file():
            raise UserError(f"{record}: no results.jsonl there; give a scale-accuracy results folder, e.g. "
                            "benchmarks/results/scale-accuracy-vm-20261204")
    for _, run_dir in args.noise:
        if not (run_dir / "metrics.json").is_file():
            raise UserError(f"--noise {run_dir}: no metrics.json there; give a finished run's folder")
    refuse_written(args.out)


def main(argv: list[str] | None = None) -> int:
    return bench_main("critical_batch", parse(argv), run, write_report, check)


if __name__ == "__main__":
    run_main(main)
