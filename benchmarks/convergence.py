"""How fast scale_ocr's default recipe learns, against the bare textbook CRNN loop on the same data.

    python -m benchmarks.convergence --out benchmarks/results/convergence-HOST-DATE
    python -m benchmarks.convergence --sets real --recipes defaults ...    # a part
    python -m benchmarks.convergence --sets real,crops --real-crops DIR     # + word crops of real documents
    python -m benchmarks.convergence --report DIR                         # rebuild report.md and the plot

Word sets, each a docTR recognition folder pair (train, val): ``synthetic``, the words scale_ocr trains on
when given no data (its renderer, seeds and sizes), and ``real``, a small set of "real-looking" crops
(:mod:`benchmarks.real_words`: other fonts, paper, ink and capture damage than anything else here renders), both
written once under benchmarks/.work; and ``crops``, the recognition folders of a ``scale-ocr make-dataset`` output
(``--real-crops DIR``: words cut from real documents). On each, the same model (crnn_mobilenet_v3_small) is
trained by two recipes through torchrun at the same global batch (``--world-size`` x ``-b``, 64 by default) for
the same number of optimizer steps (``--steps``, or the set's epochs):

* ``defaults``: ``scale_ocr/train.py`` with nothing but the data, the epochs and ``--eval-every``: its own
  learning rate, schedule, warm-up, augmentation, clipping and weight decay;
* ``bare``: :mod:`benchmarks.hand_loop`, DDP with no augmentation, AdamW at 3e-3 and torch's OneCycleLR;
* trials (``--recipes defaults,degraded``), each the defaults with flags added (:data:`TRIALS`): ``degraded`` adds
  real scans' degradations (:data:`scale_ocr.data.degrade.CANDIDATE`), the trial that decides their defaults.

Both measure exact match on the set's validation folder every ``--eval-every`` steps and at the end. The
report gives the steps and wall-clock seconds (from the launch, start-up and evaluation included on both
sides) to reach 50 / 80 / 90 %, the final and best exact match, and per set the defaults' exact match after the
same optimizer steps as the bare loop's, the difference in points (issue 32: within 2 points or above).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    HAND,
    REPO,
    TRAIN,
    append_line,
    bench_main,
    command_line,
    hardware,
    launch_command,
    parser,
    run_job,
    run_main,
    versions,
    work_dir,
    write_command,
)
from benchmarks.word_sets import crops_folders, word_set
from scale_ocr.data.degrade import CANDIDATE

ARCH = "crnn_mobilenet_v3_small"
SETS = ("synthetic", "real", "crops")
SET_NAMES = {"synthetic": "synthetic", "real": "real-looking", "crops": "real-document crops"}
RECIPES = ("defaults", "bare")
# Recipes tried against the defaults (--recipes defaults,degraded): the trainer with these flags added. The
# verdicts compare each with the defaults at equal steps; a record's default --recipes stays the two above.
TRIALS = {"degraded": ["--degrade", *CANDIDATE]}  # issue 56: do real scans' degradations pay on real crops?
THRESHOLDS = (0.5, 0.8, 0.9)
LEARNED = 0.1  # exact match below which a recipe has not learned the set at all: no comparison to make
MARGIN = 0.02  # issue 32: the defaults end within 2 points of the bare loop's exact match, or above it
BARE = ["--lr", "3e-3", "--sched", "onecycle"]  # the textbook recipe: no augmentation, OneCycle, AdamW 3e-3


def folders(args: argparse.Namespace, name: str, work: Path, chars: str) -> tuple[Path, Path]:
    """The set's (train, val) folders (:func:`benchmarks.word_sets.word_set`), written once."""
    synthetic = name == "synthetic"
    return word_set(name, work, chars, args.synthetic_train if synthetic else args.real_train,
                    args.synthetic_val if synthetic else args.real_val, args.real_crops)


def epochs_for(args: argparse.Namespace, name: str) -> int:
    return {"synthetic": args.synthetic_epochs, "real": args.real_epochs}.get(name, args.crops_epochs)


def plan_steps(args: argparse.Namespace, name: str, n_train: int) -> tuple[int, int]:
    """``(epochs, optimizer steps)`` both recipes train ``name`` for: ``--steps`` (epochs enough to hold them), else
    the set's epochs of whole global batches."""
    per_epoch = max(1, n_train // (args.batch_size * args.world_size))
    if args.steps:
        return -(-args.steps // per_epoch), args.steps
    epochs = epochs_for(args, name)
    return epochs, epochs * per_epoch


def job(args: argparse.Namespace, recipe: str, train: Path, val: Path, epochs: int, steps: int, run_dir: Path,
        chars: str) -> tuple[list[str], Path]:
    """The launch command of one recipe and the file its curve is read from."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if recipe != "bare":
        cli = [ARCH, "--strategy", "ddp", "--train-path", str(train), "--val-path", str(val), *TRIALS.get(recipe, []),
               "-b", str(args.batch_size),
               "--epochs", str(epochs), "--max-steps", str(steps), "--eval-every", str(args.eval_every),
               "--workers", str(args.workers),
               "--resume", "none", "--output-dir", str(run_dir), "--run-name", run_dir.name,
               "--wandb-mode", args.wandb_mode]
        return launch_command("torchrun", args.world_size, TRAIN, cli), run_dir / "metrics.jsonl"
    curve = run_dir / "curve.jsonl"
    curve.unlink(missing_ok=True)
    cli = ["--engine", "ddp", "--arch", ARCH, "--folder", str(train), "--chars", chars, "--val-folder", str(val),
           "-b", str(args.batch_size), "--workers", str(args.workers), "--steps", str(steps), "--warmup", "0", *BARE,
           "--eval-every", str(args.eval_every), "--curve", str(curve), "--out", str(run_dir / "hand.json")]
    return launch_command("torchrun", args.world_size, HAND, cli), curve


def read_curve(path: Path, t0: float) -> list[dict[str, float]]:
    """``[{step, seconds, exact_match}]`` from the trainer's metrics.jsonl or the hand loop's curve."""
    points = []
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        em = r.get("val/exact_match", r.get("exact_match"))
        if em is not None:
            points.append({"step": r["step"], "seconds": round(r["time"] - t0, 1), "exact_match": em})
    return points


def reached(curve: list[dict[str, float]], threshold: float) -> dict[str, float] | None:
    return next((p for p in curve if p["exact_match"] >= threshold), None)


def run(args: argparse.Namespace) -> None:
    """Each set's recipes into ``args.out/results.jsonl``, replacing only the rows of the sets and recipes run."""
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    args.out.mkdir(parents=True, exist_ok=True)
    work = work_dir(args.out)
    chars = create_task(ModelConfig(arch=ARCH)).vocab.chars
    hw, ver = hardware(), versions()
    results = args.out / "results.jsonl"
    redo = {(s, c) for s in args.sets for c in args.recipes}
    keep = [r for r in load_rows(args.out) if (r["set"], r["recipe"]) not in redo]
    results.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")
    threads = max(1, (hw["cores"] or 1) // args.world_size)
    for name in args.sets:
        train, val = folders(args, name, work, chars)
        n_train = len(json.loads((train / "labels.json").read_text(encoding="utf-8")))
        n_val = len(json.loads((val / "labels.json").read_text(encoding="utf-8")))
        epochs, steps = plan_steps(args, name, n_train)
        for recipe in args.recipes:
            cmd, curve_file = job(args, recipe, train, val, epochs, steps, work / "runs" / f"{name}-{recipe}", chars)
            t0 = time.time()
            status, error, wall = run_job(cmd, threads, args.timeout, None)
            curve = read_curve(curve_file, t0) if curve_file.is_file() else []
            if status == "ok" and (not curve or curve[-1]["step"] != steps):
                status, error = "failed", f"the curve ends at step {curve[-1]['step'] if curve else None}, not {steps}"
            append_line(results, {
                "set": name, "recipe": recipe, "status": status, "error": error, "wall_seconds": round(wall, 1),
                "epochs": epochs, "steps": steps, "train_words": n_train,
                "val_words": n_val, "world_size": args.world_size, "global_batch": args.world_size * args.batch_size,
                "threads_per_rank": threads, "batch_size": args.batch_size, "workers": args.workers,
                "eval_every": args.eval_every, "arch": ARCH, "curve": curve,
                "command": " ".join(cmd).replace(f"{REPO}/", ""), "versions": ver, "hardware": hw})
            final = f"{curve[-1]['exact_match']:.3f}" if curve else "-"
            print(f"convergence {name} {recipe}: {status} final exact match {final} [{wall:.0f} s]"
                  + (f" ({error})" if error else ""), flush=True)
    write_command(args.out, "convergence")


def load_rows(out_dir: Path) -> list[dict[str, Any]]:
    """The rows of ``out_dir/results.jsonl`` (none before the first run: a part can be run into a new folder)."""
    path = out_dir / "results.jsonl"
    return [json.loads(ln) for ln in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []


def _cell(p: dict[str, float] | None) -> str:
    return f"{p['step']} ({p['seconds']:.0f} s)" if p else "not reached"


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 12's acceptance 3 and issue 32's acceptance 2, line by line, where both recipes ran."""
    by = {(r["set"], r["recipe"]): r for r in rows if r["status"] == "ok"}
    lines = []
    if ("synthetic", "defaults") in by and ("synthetic", "bare") in by:
        d, b = (reached(by[("synthetic", k)]["curve"], 0.9) for k in RECIPES)
        ok = d is not None and (b is None or d["step"] <= b["step"])
        verdict = "INCONCLUSIVE (neither reached 90%: train longer)" if d is None and b is None else \
            "PASS" if ok else "FAIL"
        lines.append(f"- synthetic: defaults reach 90% at step {d['step'] if d else '-'}, the bare loop at "
                     f"{b['step'] if b else '-'}: {verdict} (no more steps than the bare loop)")
    if ("real", "defaults") in by and ("real", "bare") in by:
        d, b = (by[("real", k)]["curve"][-1]["exact_match"] for k in RECIPES)
        verdict = "INCONCLUSIVE (neither learned: more words or epochs)" if max(d, b) < LEARNED else \
            "PASS" if d >= b else "FAIL"
        lines.append(f"- real-looking: after {by[('real', 'defaults')]['epochs']} epochs, defaults {d:.3f} vs bare "
                     f"{b:.3f}: {verdict} (at least the bare loop's accuracy)")
    return lines + equal_steps(rows) + trials(rows)


def trials(rows: list[dict[str, Any]]) -> list[str]:
    """Each trial recipe against the defaults on each set where both ran: final exact match, in points."""
    by = {(r["set"], r["recipe"]): r for r in rows if r["status"] == "ok" and r["curve"]}
    lines = []
    for name in SETS:
        for trial in [t for t in TRIALS if (name, t) in by and (name, "defaults") in by]:
            d, t = (by[(name, k)]["curve"][-1] for k in ("defaults", trial))
            lines.append(f"- {SET_NAMES[name]}: {trial} ends at {100 * t['exact_match']:.1f}% after step {t['step']}, "
                         f"defaults {100 * d['exact_match']:.1f}% after step {d['step']}: "
                         f"{100 * (t['exact_match'] - d['exact_match']):+.1f} points")
    return lines


def equal_steps(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 32's acceptance 2, per set where both recipes ran: the defaults' exact match after the same optimizer
    steps at the same global batch as the bare loop, the difference in points, and whether it is at most
    :data:`MARGIN` below."""
    by = {(r["set"], r["recipe"]): r for r in rows if r["status"] == "ok" and r["curve"]}
    lines = []
    for name in [s for s in SETS if (s, "defaults") in by and (s, "bare") in by]:
        d_row, b_row = by[(name, "defaults")], by[(name, "bare")]
        step = min(d_row["curve"][-1]["step"], b_row["curve"][-1]["step"])
        d, b = (next((p["exact_match"] for p in r["curve"] if p["step"] == step), None) for r in (d_row, b_row))
        if d is None or b is None:
            lines.append(f"- {SET_NAMES[name]}: no measurement of both recipes at step {step}: no verdict")
            continue
        verdict = "INCONCLUSIVE (neither learned: more words or steps)" if max(d, b) < LEARNED else \
            "PASS" if d >= b - MARGIN - 1e-12 else "FAIL"
        batch = d_row.get("global_batch") or d_row["world_size"] * d_row["batch_size"]
        lines.append(f"- {SET_NAMES[name]}, global batch {batch}, after {step} optimizer steps each: defaults "
                     f"{100 * d:.1f}% vs bare {100 * b:.1f}%, {100 * (d - b):+.1f} points: {verdict} (within "
                     f"{100 * MARGIN:.0f} points of the bare loop or above)")
    return lines


def plot(rows: list[dict[str, Any]], out_dir: Path) -> str | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [s for s in SETS if any(r["set"] == s and r["curve"] for r in rows)]
    if not sets:
        return None
    fig, axes = plt.subplots(1, len(sets), figsize=(6 * len(sets), 4), squeeze=False)
    for ax, name in zip(axes[0], sets, strict=True):
        for r in rows:
            if r["set"] == name and r["curve"]:
                ax.plot([p["step"] for p in r["curve"]], [p["exact_match"] for p in r["curve"]], marker=".",
                        label=r["recipe"])
        for t in THRESHOLDS:
            ax.axhline(t, color="grey", lw=0.5, ls=":")
        ax.set(title=f"{name} words", xlabel="optimizer step", ylabel="validation exact match", ylim=(0, 1))
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=110)
    plt.close(fig)
    return "curves.png"


def build_report(out_dir: Path) -> Path:
    rows = load_rows(out_dir)
    command = command_line(out_dir)
    lines = ["# Convergence: scale_ocr's defaults vs the bare textbook loop", "", f"Command: `{command}`", ""]
    if rows:
        r0 = rows[0]
        lines += [f"{r0['arch']}, DDP on {r0['world_size']} ranks x {r0['threads_per_rank']} thread(s), batch "
                  f"{r0['batch_size']} per rank (global batch {r0['world_size'] * r0['batch_size']}), exact match on "
                  f"the validation folder every {r0['eval_every']} steps; "
                  f"seconds from the launch. Bare loop: {' '.join(BARE)}, AdamW, no augmentation. "
                  f"{r0['hardware'].get('cpu')}.", ""]
    lines += ["| set | recipe | epochs (steps) | 50% | 80% | 90% | final | best | wall | git |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["curve"]
        cells = [_cell(reached(c, t)) for t in THRESHOLDS] if c else ["-"] * 3
        final = f"{c[-1]['exact_match']:.3f}" if c else r["status"]
        best = f"{max(p['exact_match'] for p in c):.3f}" if c else "-"
        lines.append(f"| {r['set']} ({r['train_words']} words) | {r['recipe']} | {r['epochs']} ({r['steps']}) | "
                     + " | ".join(cells) + f" | {final} | {best} | {r['wall_seconds']:.0f} s | "
                     f"{r['versions'].get('git')} |")
    lines += ["", *verdicts(rows)]
    image = plot(rows, out_dir)
    if image:
        lines += ["", f"![exact match by step]({image})"]
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return report


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("convergence", __doc__)
    p.add_argument("--sets", default=None,
                   help="comma-separated (default: synthetic,real, and crops with --real-crops)")
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("-b", "--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--eval-every", type=int, default=64)
    p.add_argument("-j", "--workers", type=int, default=0, help="data-loading workers per rank, the same on both sides")
    p.add_argument("--synthetic-train", type=int, default=32768, help="the trainer's default --train-samples")
    p.add_argument("--synthetic-val", type=int, default=512)
    p.add_argument("--synthetic-epochs", type=int, default=3)
    p.add_argument("--real-train", type=int, default=8192, help="4096 crops x 12 epochs: learned by neither recipe")
    p.add_argument("--real-val", type=int, default=512)
    p.add_argument("--real-epochs", type=int, default=12)
    p.add_argument("--real-crops", type=Path, default=None,
                   help="a `scale-ocr make-dataset` output: its recognition crops are the set `crops`")
    p.add_argument("--crops-epochs", type=int, default=12)
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps of every job, both recipes (default: each set's epochs)")
    p.add_argument("--wandb-mode", default="offline", choices=("offline", "disabled"))
    p.add_argument("--timeout", type=int, default=7200, help="seconds per training job")
    args = p.parse_args(argv)
    default_sets = ["synthetic", "real", *(["crops"] if args.real_crops else [])]
    args.sets = args.sets.split(",") if args.sets else default_sets
    args.recipes = args.recipes.split(",")
    known = (*RECIPES, *TRIALS)
    for bad in [s for s in args.sets if s not in SETS] + [r for r in args.recipes if r not in known]:
        p.error(f"unknown set or recipe {bad!r}: sets {', '.join(SETS)}; recipes {', '.join(known)}")
    return args


def check(args: argparse.Namespace) -> None:
    """The flags a job would trip on, each one line before anything runs."""
    from scale_ocr.errors import UserError

    if "crops" in args.sets:
        crops_folders(args.real_crops)
    if args.steps is not None and args.steps < 1:
        raise UserError(f"--steps {args.steps}: use at least 1")


def main(argv: list[str] | None = None) -> int:
    return bench_main("convergence", parse(argv), run, build_report, check)


if __name__ == "__main__":
    run_main(main)
