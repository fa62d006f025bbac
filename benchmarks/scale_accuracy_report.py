"""The scale-accuracy benchmark's report, from ``results.jsonl`` alone (``python -m benchmarks.scale_accuracy
--report DIR``): the maths (samples to a threshold, the best rule per batch, how far the default rule keeps
accuracy), ``report.md``, ``summary.json`` and two plots.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, command_line, write_outputs

SETS = ("synthetic", "real", "crops")
RULES = ("none", "linear", "sqrt")
THRESHOLDS = (0.5, 0.8, 0.9)
TOLERANCE = 0.01  # "within 1 point" of exact match
LEARNED = 0.1  # a smallest batch ending below this has not learned the set: nothing to hold, no verdict
SET_NAMES = {"synthetic": "synthetic words", "real": "real-looking crops", "crops": "real-document crops",
             "synthetic-pages": "synthetic pages"}


def key_of(row: dict[str, Any]) -> tuple[str, str, str, int, str]:
    """A job's identity: (kind, model, set, global batch, rule)."""
    return row["kind"], row["model"], row["set"], int(row["global_batch"]), row["rule"]


def load_rows(out_dir: Path) -> list[dict[str, Any]]:
    """The lines of ``out_dir/results.jsonl`` (none before the first job ends)."""
    path = out_dir / "results.jsonl"
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]


def latest(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Each job's last line (a job that failed, then ran again after a resume, counts by its rerun)."""
    return {key_of(r): r for r in rows}


def load_plan(out_dir: Path) -> list[dict[str, Any]]:
    """``plan.json``: every job the run planned (empty for a folder without one)."""
    path = out_dir / "plan.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []


def pending(planned: list[dict[str, Any]], jobs: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``planned`` jobs (:func:`load_plan`) that have no ``ok`` line at their budget yet and are still to train
    (not past :func:`unlearned_below`): a record run in parts."""
    return [p for p in planned if not trained(jobs, p) and unlearned_below(planned, jobs, p) is None]


def not_trained(planned: list[dict[str, Any]], jobs: dict[tuple, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``planned`` jobs without a result that :func:`unlearned_below` leaves out, each with ``below``: the
    batch at which no rule learned the set."""
    rows = [(p, None if trained(jobs, p) else unlearned_below(planned, jobs, p)) for p in planned]
    return [p | {"below": g} for p, g in rows if g is not None]


def trained(jobs: dict[tuple, dict[str, Any]], p: dict[str, Any]) -> bool:
    """Whether the planned job ``p`` has an ``ok`` line at its budget."""
    row = cell(jobs, (p["kind"], p["model"], p["set"]), p["global_batch"], p["rule"])
    return row is not None and row["status"] == "ok" and row["samples"] == p["samples"]


def unlearned_below(planned: list[dict[str, Any]], jobs: dict[tuple, dict[str, Any]], p: dict[str, Any]) -> int | None:
    """The smallest batch of the planned job ``p``'s group, below ``p``'s, at which every planned rule ended under
    :data:`LEARNED` at ``p``'s budget; None if there is none. The budget is in samples, so a larger batch takes
    fewer optimizer steps to it: where no rule learned the set at one batch, no rule is expected to at a larger
    one, and ``p`` is not trained (``--train-all`` trains it; the report lists it as not trained, and why)."""
    group = (p["kind"], p["model"], p["set"])
    mine = [q for q in planned if (q["kind"], q["model"], q["set"]) == group and q["samples"] == p["samples"]]
    for g in sorted({q["global_batch"] for q in mine if q["global_batch"] < p["global_batch"]}):
        ends = [final(cell(jobs, group, g, q["rule"])) if trained(jobs, q) else None
                for q in mine if q["global_batch"] == g]
        if all(e is not None and e < LEARNED for e in ends):
            return g
    return None


def samples_to(curve: list[dict[str, float]], threshold: float) -> int | None:
    """Training samples seen at the first measurement at or above ``threshold``; None if never reached."""
    return next((int(p["samples"]) for p in curve if p["value"] >= threshold), None)


def final(row: dict[str, Any] | None) -> float | None:
    """A finished job's last measurement; None for a job that did not finish."""
    if row is None or row["status"] != "ok" or not row["curve"]:
        return None
    return float(row["curve"][-1]["value"])


def at_reference(job: dict[str, Any]) -> bool:
    """Whether ``job`` (a results line or a planned job) trains at its model's reference batch, where every rule
    gives the same rate: one job there stands for every rule, whichever rule it ran under."""
    return job["global_batch"] == job["reference_batch"]


def cell(jobs: dict[tuple, dict[str, Any]], group: tuple[str, str, str], batch: int, rule: str) -> dict | None:
    """The job of ``rule`` at ``batch``; at the model's reference batch, where every rule gives the same rate and
    only one rule's job runs, that job."""
    row = jobs.get((*group, batch, rule))
    if row is not None:
        return row
    same = [r for k, r in jobs.items() if k[:4] == (*group, batch) and at_reference(r)]
    return same[0] if same else None


def best_rule(cells: dict[str, dict[str, Any] | None], default_rule: str) -> str | None:
    """The rule with the highest final exact match at one batch; a tie goes to the rule that reached the highest
    threshold in fewer samples, then to the default rule, then to the first in :data:`RULES`. None when no rule
    finished, or none ended at :data:`LEARNED` or above (rules that all learned nothing have no winner)."""
    def rank(rule: str) -> tuple[float, float, bool, int]:
        row = cells[rule]
        reached = [s for s in (samples_to(row["curve"], t) for t in reversed(THRESHOLDS)) if s is not None]
        return final(row), -(reached[0] if reached else float("inf")), rule == default_rule, -RULES.index(rule)

    finished = [r for r in cells if final(cells[r]) is not None]
    best = max(finished, key=rank) if finished else None
    return best if best is not None and final(cells[best]) >= LEARNED else None


def holds_up_to(finals: dict[int, float | None], tolerance: float = TOLERANCE) -> tuple[int | None, float | None]:
    """``(largest batch, reference)``: going up from the smallest batch (the reference, its final exact match),
    the last batch before the first one that ends more than ``tolerance`` below the reference or did not finish.
    ``(None, None)`` when the smallest batch did not finish."""
    batches = sorted(finals)
    if not batches or finals[batches[0]] is None:
        return None, None
    ref, largest = finals[batches[0]], batches[0]
    for g in batches[1:]:
        value = finals[g]
        if value is None or value < ref - tolerance - 1e-12:
            break
        largest = g
    return largest, ref


def as_default(jobs: dict[tuple, dict[str, Any]], group: tuple[str, str, str], per_batch: dict[int, dict[str, Any]],
               rule: str) -> dict[str, Any]:
    """Acceptance 1 with ``rule`` as the default: the largest batch at which it stays within a point of its own
    smallest batch's final (:func:`holds_up_to`), that final, the best rule there and whether ``rule`` ties or
    leads it. The same measurements give each rule's verdict, which is what a default is chosen by."""
    reach, ref = holds_up_to({g: per_batch[g]["final"].get(rule) for g in sorted(per_batch)})
    best = per_batch[reach]["best_rule"] if reach is not None else None
    return {"holds_up_to": reach, "reference_final": ref, "best_rule_there": best, "is_best_there": None
            if best is None else final(cell(jobs, group, reach, rule)) >= per_batch[reach]["final"][best]}


def reference_of(jobs: dict[tuple, dict[str, Any]], group: tuple[str, str, str]) -> int:
    """The model's reference batch, where every rule gives the same rate."""
    return next(int(r["reference_batch"]) for k, r in jobs.items() if k[:3] == group)


def groups(jobs: dict[tuple, dict[str, Any]], kind: str) -> list[tuple[str, str, str]]:
    return list(dict.fromkeys(k[:3] for k in jobs if k[0] == kind))


def summarize(jobs: dict[tuple, dict[str, Any]], default_rule: str, to_run: list[dict[str, Any]] = (),
              skipped: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """``jobs`` (:func:`latest`: each job's last line) per recognizer and set: each batch's finals per rule and \
best rule, the default rule's reach and whether it
    is the best rule there, how many of its planned jobs (``to_run``, :func:`pending`) have no result yet, and
    which batches are not trained (``skipped``, :func:`not_trained`); per detection batch: the final recall."""
    out: dict[str, Any] = {"default_rule": default_rule, "tolerance_points": TOLERANCE * 100, "recognition": [],
                           "detection": [], "to_run": [p["name"] for p in to_run],
                           "not_trained": [p["name"] for p in skipped]}
    for group in groups(jobs, "recognition"):
        batches = sorted({k[3] for k in jobs if k[:3] == group})
        per_batch = {}
        for g in batches:
            cells = {rule: cell(jobs, group, g, rule) for rule in RULES}
            cells = {r: c for r, c in cells.items() if c is not None}
            per_batch[g] = {"final": {r: final(c) for r, c in cells.items()},
                            "best_rule": best_rule(cells, default_rule),
                            "samples_to": {r: {str(t): samples_to(c["curve"], t) for t in THRESHOLDS}
                                           for r, c in cells.items()}}
        verdicts = {rule: as_default(jobs, group, per_batch, rule) for rule in RULES}
        mine = verdicts[default_rule]
        reference = reference_of(jobs, group)
        above = [per_batch[g]["best_rule"] for g in batches if g > reference]
        out["recognition"].append({
            "model": group[1], "set": group[2], "batches": per_batch, "reference_final": mine["reference_final"],
            "to_run": sum((p["kind"], p["model"], p["set"]) == group for p in to_run),
            "not_trained": {str(p["global_batch"]): p["below"] for p in skipped
                            if (p["kind"], p["model"], p["set"]) == group},
            "default_holds_up_to": mine["holds_up_to"], "best_rule_there": mine["best_rule_there"],
            "wins_above_reference": {r: above.count(r) for r in RULES if r in above},
            "default_is_best_there": mine["is_best_there"],
            "as_default": {r: v for r, v in verdicts.items() if v["holds_up_to"] is not None}})
    out["detection_not_trained"] = {str(p["global_batch"]): p["below"] for p in skipped if p["kind"] == "detection"}
    for group in groups(jobs, "detection"):  # every rule a job ran under, the default's first at each batch
        for key in sorted((k for k in jobs if k[:3] == group), key=lambda k: (k[3], k[4] != default_rule, k[4])):
            row = jobs[key]
            out["detection"].append({"model": group[1], "set": group[2], "global_batch": key[3], "rule": key[4],
                                     "final_recall": final(row), "status": row["status"], "samples": row["samples"]})
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _samples(n: int | None) -> str:
    return "not reached" if n is None else f"{n:,}"


def group_lines(jobs: dict[tuple, dict[str, Any]], s: dict[str, Any], default_rule: str) -> list[str]:
    """One recognizer on one set: a table row per batch and rule, then the verdict."""
    group = ("recognition", s["model"], s["set"])
    budgets = sorted({r["samples"] for k, r in jobs.items() if k[:3] == group})
    lines = [f"### {s['model']} on {SET_NAMES.get(s['set'], s['set'])}", "",
             f"{' or '.join(f'{n:,}' for n in budgets)} training samples per job.", "",
             "| global batch | ranks x micro x accum | rule | peak lr | 50% | 80% | 90% | final EM % | best rule | "
             "wall |", "|---:|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for g, b in s["batches"].items():
        shown: set[int] = set()
        for rule in [r for r in RULES if r in b["final"]]:
            row = cell(jobs, group, g, rule)
            if id(row) in shown:
                continue  # the reference batch's one job, which every rule shares, is shown once
            shown.add(id(row))
            label = f"every rule (ran as {row['rule']})" if at_reference(row) else rule
            to = [_samples(n) for n in b["samples_to"][rule].values()] if row["status"] == "ok" else ["-"] * 3
            lr = f"{row['peak_lr']:.2e}" if row.get("peak_lr") else "-"
            status = _pct(b["final"][rule]) if row["status"] == "ok" else f"**{row['status']}**"
            lines.append(f"| {g} | {row['world_size']} x {row['micro_batch']} x {row['grad_accum']} | {label} | "
                         f"{lr} | " + " | ".join(to) + f" | {status} | {b['best_rule'] or '-'} | "
                         f"{_wall(row)} |")
    if s["not_trained"]:
        batches = sorted(s["not_trained"], key=int)
        lines += ["", f"Not trained: global batch {', '.join(batches)}. Every rule ended under {LEARNED * 100:.0f}% at "
                  f"batch {min(s['not_trained'].values())}, and a larger batch takes fewer optimizer steps to the same "
                  "samples (`--train-all` trains them)."]
    reach = s["default_holds_up_to"]
    if s["to_run"]:
        verdict = (f"- In progress: {s['to_run']} of this group's planned jobs have no result yet; "
                   "no verdict until then.")
    elif reach is None:
        verdict = f"- The default rule ({default_rule}) has no finished run at the smallest batch: no verdict."
    elif s["reference_final"] < LEARNED:
        verdict = (f"- INCONCLUSIVE: under the default rule ({default_rule}) the smallest batch ends at "
                   f"{_pct(s['reference_final'])}% exact match, so it has not learned the set; a larger --samples.")
    else:
        best = s["best_rule_there"]
        verdict = (f"- The default rule ({default_rule}) stays within {TOLERANCE * 100:.0f} point of the smallest "
                   f"batch's final exact match ({_pct(s['reference_final'])}%) up to global batch **{reach}**; there "
                   f"the best rule is {best}"
                   + (f" (the default {'ties or leads' if s['default_is_best_there'] else 'trails it'})"
                      if best != default_rule else ", the default") + ".")
    return [*lines, "", verdict, ""]


def _wall(row: dict[str, Any]) -> str:
    """A job's training seconds, and the steps an interrupted try's checkpoint was continued from."""
    resumed = row.get("resumed_at") or []
    return f"{row['wall_seconds']:.0f} s" + (f" (resumed at step {', '.join(map(str, resumed))})" if resumed else "")


def detection_lines(jobs: dict[tuple, dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    if not summary["detection"]:
        return []
    lines = ["## Detection", "",
             "| model | pages | global batch | ranks x micro x accum | rule | peak lr | final recall % "
             "| wall |", "|---|---|---:|---|---|---:|---:|---:|"]
    for d in summary["detection"]:
        row = jobs[("detection", d["model"], d["set"], d["global_batch"], d["rule"])]
        lr = f"{row['peak_lr']:.2e}" if row.get("peak_lr") else "-"
        recall = _pct(d["final_recall"]) if row["status"] == "ok" else f"**{row['status']}**: {row['error']}"
        rule = d["rule"] + (" (default)" if d["rule"] == summary["default_rule"] else "")
        lines.append(f"| {d['model']} | {row['samples']:,} ({row['train_size']} synthetic, {row['val_size']} held out) "
                     f"| {d['global_batch']} | {row['world_size']} x {row['micro_batch']} x {row['grad_accum']} "
                     f"| {rule} | {lr} | {recall} | {_wall(row)} |")
    skipped = summary["detection_not_trained"]
    if skipped:
        lines += ["", f"Not trained: global batch {', '.join(sorted(skipped, key=int))}. Recall ended under "
                  f"{LEARNED * 100:.0f}% at batch {min(skipped.values())} (`--train-all` trains them)."]
    return [*lines, ""]


def plot(jobs: dict[tuple, dict[str, Any]], summary: dict[str, Any], out_dir: Path) -> list[str]:
    """``final.png`` (final exact match against global batch, a line per rule, the band 1 point under the
    reference) and ``curves.png`` (the default rule's exact match against samples, a line per batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.report import PLOT_META

    rec = summary["recognition"]
    if not rec:
        return []
    names = []
    for name, draw in (("final.png", _draw_final), ("curves.png", _draw_curves)):
        fig, axes = plt.subplots(1, len(rec), figsize=(5 * len(rec), 3.8), squeeze=False)
        for ax, s in zip(axes[0], rec, strict=True):
            draw(ax, jobs, s, summary["default_rule"])
            ax.set_title(f"{s['model']}\n{SET_NAMES.get(s['set'], s['set'])}", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # a group in progress may have no line to draw yet
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110, metadata=PLOT_META)
        plt.close(fig)
        names.append(name)
    return names


def _draw_final(ax, jobs, s: dict[str, Any], default_rule: str) -> None:
    batches = [int(g) for g in s["batches"]]
    for rule in RULES:
        pts = [(g, s["batches"][g]["final"].get(rule)) for g in s["batches"]]
        pts = [(g, v) for g, v in pts if v is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=rule + (" (default)" if rule == default_rule else ""))
    if s["reference_final"] is not None:
        ax.axhspan(s["reference_final"] - TOLERANCE, s["reference_final"], color="grey", alpha=0.2,
                   label="within 1 point of the smallest batch")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="global batch", ylabel="final exact match", xticks=batches, xticklabels=[str(b) for b in batches])


def _draw_curves(ax, jobs, s: dict[str, Any], default_rule: str) -> None:
    for g in s["batches"]:
        row = cell(jobs, ("recognition", s["model"], s["set"]), g, default_rule)
        if row and row["curve"]:
            ax.plot([p["samples"] for p in row["curve"]], [p["value"] for p in row["curve"]], marker=".",
                    label=f"batch {g}")
    for t in THRESHOLDS:
        ax.axhline(t, color="grey", lw=0.5, ls=":")
    ax.set(xlabel=f"training samples ({default_rule} rule)", ylabel="validation exact match", ylim=(0, 1))


def header(rows: list[dict[str, Any]], jobs: dict[tuple, dict[str, Any]], out_dir: Path, default_rule: str,
           to_run: list[dict[str, Any]]) -> list[str]:
    """The report's head; ``jobs`` is :func:`latest` of ``rows`` (each job's last line), ``to_run`` the planned
    jobs without a result (:func:`pending`)."""
    r0 = rows[0]
    gits = sorted({r["versions"].get("git") or "?" for r in rows})
    hosts = sorted({f"{r['hardware'].get('cpu')}, {r['hardware'].get('cores')} cores" for r in jobs.values()})
    where_ran = (" (the parts ran on more than one host: each line of `results.jsonl` names its own)"
                 if len(hosts) > 1 else "")
    rec = [r for r in jobs.values() if r["kind"] == "recognition"]
    per_set = {SET_NAMES.get(r["set"], r["set"]): r["samples"] for r in rec}
    budget = (f"training samples per job: {', '.join(f'{n:,} on {name}' for name, n in per_set.items())}; validation "
              f"exact match every {rec[0]['eval_every'] * rec[0]['global_batch']:,} samples and at each epoch's end"
              if rec else "")
    replaced = len(rows) - len(jobs)
    where = out_dir.resolve()
    shown = where.relative_to(REPO) if where.is_relative_to(REPO) else where
    progress = [f"**In progress: {len(to_run)} planned job(s) have no result yet** "
                f"({', '.join(p['name'] for p in to_run[:3])}"
                f"{', ...' if len(to_run) > 3 else ''}): the command above, run again, trains them (`--max-minutes` "
                "bounds a part); a model-and-set group with a job to run has no verdict yet.", ""] if to_run else []
    return ["# Scale accuracy: the same recipe at growing global batches", "",
            f"Command: `{command_line(out_dir)}` (preset {r0.get('preset')}); rebuild: "
            f"`python -m benchmarks.scale_accuracy --report {shown}`", "", *progress,
            f"- `scale_ocr/train.py` with its defaults (DDP, AdamW, the task's schedule) but for the global batch and "
            f"`--lr-scaling`; {budget}. The budget is in samples (Goyal et al.'s setting: the same epochs at every "
            "batch), so a batch k times larger takes k times fewer optimizer steps. The global "
            "batch is ranks x micro-batch x accumulation: accumulation stands in for ranks this host does not have "
            "(each rank's BatchNorm sees its micro-batch, as it would on more ranks).",
            f"- The default rule is **{default_rule}** (`scale_ocr.config.DEFAULT_LR_SCALING`). At a model's "
            "reference batch every rule gives the same rate: that batch is trained once.",
            f"- Samples to 50/80/90%: training samples seen at the first measurement at or above it. Best rule: "
            f"highest final exact match (none where every rule ends under {LEARNED * 100:.0f}%). \"Holds up to\": the "
            f"largest batch, going up from the smallest, whose final exact match under the default rule is at most "
            f"{TOLERANCE * 100:.0f} point below the smallest batch's.",
            f"- {' / '.join(hosts)}{where_ran}, {r0['threads_per_rank']} thread(s) per rank; git {', '.join(gits)}; "
            f"torch {r0['versions'].get('torch')}.",
            *([f"- `results.jsonl` holds {replaced} line(s) a later line of the same job replaces (a failed try run "
               "again, or a job trained again under a changed budget with `--supersede`); the report reads each "
               "job's last line."] if replaced else []), ""]


def overview(summary: dict[str, Any]) -> list[str]:
    """Issue 32's acceptance 1 in one table: per model and set, how far the default rule keeps accuracy."""
    if not summary["recognition"]:
        return []
    lines = ["## Verdicts", "", f"| model | set | smallest batch's final EM % ({summary['default_rule']}) | default "
             "holds up to | best rule there | default is best there | best rule above the reference batch |",
             "|---|---|---:|---:|---|---|---|"]
    for s in summary["recognition"]:
        learned = has_verdict(s)
        best = {None: "-", True: "yes", False: "no"}[s["default_is_best_there"]] if learned else "-"
        verdictless = f"in progress ({s['to_run']} to run)" if s["to_run"] else "no verdict"
        wins = s["wins_above_reference"]
        above = ", ".join(f"{r} at {n} of {sum(wins.values())}" for r, n in sorted(wins.items(), key=lambda w: -w[1]))
        lines.append(f"| {s['model']} | {SET_NAMES.get(s['set'], s['set'])} | {_pct(s['reference_final'])} | "
                     f"{s['default_holds_up_to'] if learned else verdictless} | "
                     f"{s['best_rule_there'] if learned else '-'} | {best} | {above or '-'} |")
    return [*lines, "",
            "\"Best rule above the reference batch\": of the batches above the model's reference batch (where "
            f"the rules part) at which some rule ends at {LEARNED * 100:.0f}% or above, how many each rule ends best "
            "at: the evidence a default rule rests on.", "", *each_rule(summary)]


def has_verdict(s: dict[str, Any]) -> bool:
    """A group's verdict stands: every planned job is in and the default's smallest batch learned the set."""
    return not s["to_run"] and s["reference_final"] is not None and s["reference_final"] >= LEARNED


def each_rule(summary: dict[str, Any]) -> list[str]:
    """The same verdict with each rule as the default (:func:`as_default`), for the groups that have one: the
    measurements a default is chosen by, and which rules would meet acceptance 1 in every such group."""
    done = [s for s in summary["recognition"] if has_verdict(s)]
    if not done:
        return []
    lines = ["Each rule as the default, on the same measurements: the largest batch at which it stays within "
             f"{TOLERANCE * 100:.0f} point of its own smallest batch, and whether it is the best rule there.", "",
             f"| model | set | {' | '.join(RULES)} |", "|---|---|" + "---|" * len(RULES)]
    for s in done:
        cells = []
        for rule in RULES:
            v = s["as_default"].get(rule)
            cells.append("-" if v is None or v["is_best_there"] is None else f"{v['holds_up_to']}, " + (
                "best there" if v["is_best_there"] else f"trails {v['best_rule_there']}"))
        lines.append(f"| {s['model']} | {SET_NAMES.get(s['set'], s['set'])} | {' | '.join(cells)} |")
    meets = {r: sum(bool(s["as_default"].get(r, {}).get("is_best_there")) for s in done) for r in RULES}
    every = [r for r in RULES if meets[r] == len(done)]
    return [*lines, "", f"Best where it holds in every group above: {', '.join(f'`{r}`' for r in every) or 'no rule'}. "
            + chosen(done, meets, summary["default_rule"]), ""]


def chosen(done: list[dict[str, Any]], meets: dict[str, int], default_rule: str) -> str:
    """The rule these runs choose as the default: best where it holds in the most groups (``meets``, acceptance 1),
    a tie to the rule that ends best at the most batches above the reference batch (what scaling out meets), then to
    the default."""
    wins = {r: sum(s["wins_above_reference"].get(r, 0) for s in done) for r in RULES}
    pick = max(RULES, key=lambda r: (meets[r], wins[r], r == default_rule))
    return (f"By these runs the default is `{pick}`: best where it holds in {meets[pick]} of {len(done)} group(s), "
            f"and the best rule above the reference batch at {wins[pick]} of {sum(wins.values())} batch(es)"
            + (f" (today's default, `{default_rule}`: {meets[default_rule]} and {wins[default_rule]})."
               if pick != default_rule else ", today's default."))


def build_report(out_dir: Path) -> Path:
    """``report.md``, ``summary.json`` and the plots of ``out_dir``; returns the report's path."""
    from scale_ocr.config import DEFAULT_LR_SCALING
    from scale_ocr.errors import UserError

    rows = load_rows(out_dir)
    if not rows:
        raise UserError(f"{out_dir}/results.jsonl has no results; run `python -m benchmarks.scale_accuracy` first")
    jobs = latest(rows)
    planned = load_plan(out_dir)
    to_run = pending(planned, jobs)
    summary = summarize(jobs, DEFAULT_LR_SCALING, to_run, not_trained(planned, jobs))
    lines = header(rows, jobs, out_dir, DEFAULT_LR_SCALING, to_run) + overview(summary) + ["## Recognition", ""]
    for s in summary["recognition"]:
        lines += group_lines(jobs, s, DEFAULT_LR_SCALING)
    lines += [f"![{p[:-4]}]({p})" for p in plot(jobs, summary, out_dir)] + [""]
    lines += detection_lines(jobs, summary)
    bad = [r for r in jobs.values() if r["status"] != "ok"]
    if bad:
        lines += ["## Jobs without a result", ""] + [f"- `{'/'.join(map(str, key_of(r)))}`: **{r['status']}**: "
                                                      f"{r['error']}" for r in bad] + [""]
    return write_outputs(out_dir, summary, lines)
