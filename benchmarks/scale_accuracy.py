"""Does accuracy hold as the global batch grows? The same recipe at global batches 32..512 under each rate rule.

    python -m benchmarks.scale_accuracy --preset smoke --out /tmp/scale-accuracy-smoke
    python -m benchmarks.scale_accuracy --preset record [--real-crops DIR] \
--out benchmarks/results/scale-accuracy-HOST-DATE
    python -m benchmarks.scale_accuracy --preset record --estimate     # the plan and its CPU time, nothing run
    python -m benchmarks.scale_accuracy --report DIR                   # rebuild report.md, summary.json, the plots

For each recognizer (a CRNN and a ViTSTR) and word set (``synthetic``: the trainer's own synthetic words;
``real``: the real-looking crops of :mod:`benchmarks.real_words`; ``crops``: the recognition folders of a
``scale-ocr make-dataset`` output given as ``--real-crops``), ``scale_ocr/train.py`` trains with its defaults at
each global batch (world size x micro-batch x accumulation: accumulation stands in for the ranks this host does
not have) under each ``--lr-scaling`` rule, for the same number of training SAMPLES at every batch (the set's
budget, one the smallest batch learns the set in), and measures validation exact match every ``--eval-samples``
samples. At a model's reference batch every rule gives the same rate, so
that batch is trained once. Detection (db_mobilenet_v3_large on synthetic pages) trains at two global batches
under the default rule, recall measured the same way. Each finished job is one line of ``results.jsonl``: an
interrupted benchmark, run again with the same flags, starts with the first job that has no ``ok`` line and
continues it from the last checkpoint its interrupted try left (a job saves one at each validation). Jobs run
group by group, the cheapest group first, and ``--max-minutes`` starts no job that would end past the limit (a
record longer than one session or one scheduler allocation runs in parts; ``plan.json`` lists every planned job,
and the report says which have no result yet). A batch above one at which every rule ended under 10% is not
trained (fewer steps to the same samples; ``--train-all`` trains it).
What runs and in which order is :mod:`benchmarks.scale_accuracy_plan`'s. The report
(:mod:`benchmarks.scale_accuracy_report`) gives samples-to-50/80/90 %, the final exact match, the best
rule per batch and the largest global batch at which the default rule stays within 1 point of the smallest
batch's final exact match.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    RECORD_FONTS,
    REPO,
    TRAIN,
    append_line,
    bench_main,
    hardware,
    launch_command,
    parser,
    run_job,
    run_main,
    versions,
    work_dir,
    write_command,
)
from benchmarks.scale_accuracy_plan import (
    OTHER_RATE,
    PRESETS,
    Job,
    budget,
    estimate,
    finished,
    plan,
    plan_rows,
    split_batch,
    to_train,
)
from benchmarks.scale_accuracy_report import (
    LEARNED,
    RULES,
    SETS,
    build_report,
    latest,
    load_rows,
    unlearned_below,
)
from benchmarks.word_sets import count, crops_folders, word_set

TRIES = ".tries.json"  # beside a job's run folder (train.py takes only an empty or its own): each try of the job


def command(args: argparse.Namespace, job: Job, data: list[str], train_size: int, run_dir: Path) -> list[str]:
    """``train.py``'s launch command for ``job``: its defaults but for the batch, the rule and the budget; the run
    stops at ``job.steps`` (an epoch more than it needs, as the loader may round an epoch down) and validates every
    ``job.eval_every`` steps and at the end, and saves a checkpoint with each validation, which ``--resume auto``
    continues when a try is interrupted (:func:`earlier_tries`)."""
    steps_per_epoch = max(1, train_size // job.global_batch)
    cli = [job.model, "--strategy", "ddp", *data, "-b", str(job.micro_batch), "--grad-accum", str(job.grad_accum),
           "--lr-scaling", job.rule, "--epochs", str(math.ceil(job.steps / steps_per_epoch) + 1), "--max-steps",
           str(job.steps), "--eval-every", str(job.eval_every), "--save-every", str(job.eval_every), "--seed",
           str(args.seed), "--no-save-model",
           "--workers", str(args.workers), "--resume", "auto", "--output-dir", str(run_dir), "--run-name", job.name,
           "--wandb-mode", args.wandb_mode]
    return launch_command("torchrun", job.world_size, TRAIN, cli)


def read_curve(run_dir: Path, metric: str, global_batch: int,
               tries: list[dict[str, float]]) -> tuple[list[dict[str, float]], float]:
    """``[{step, samples, seconds, value}]``, the run's validation ``metric`` at each measurement, and the seconds of
    training the tries before the last kept. A record belongs to the last try begun before it; ``seconds`` count
    from the first try's start through each try's kept records (the trainer trims a resumed run's records back to
    its checkpoint), so the time between sessions and the work a kill lost are not in them."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []
    starts = [t["t0"] for t in tries]
    owner = [max(0, bisect.bisect_right(starts, r["time"]) - 1) for r in records]  # each record's try
    ends = list(starts)  # each try's last kept record, or its start when it kept none
    for r, i in zip(records, owner, strict=True):
        ends[i] = max(ends[i], r["time"])
    before = list(itertools.accumulate((e - s for s, e in zip(starts, ends, strict=True)), initial=0.0))
    points = []
    for r, i in zip(records, owner, strict=True):
        if f"val/{metric}" in r:
            points.append({"step": r["step"], "samples": r["step"] * global_batch,
                           "seconds": round(before[i] + r["time"] - starts[i], 1), "value": r[f"val/{metric}"]})
    return points, before[len(tries) - 1]


def earlier_tries(run_dir: Path, cmd: list[str]) -> tuple[list[dict[str, float]], int]:
    """The tries of this job an interrupted benchmark left in ``run_dir`` (a session's or a scheduler's end, a kill)
    and the step of the checkpoint the next continues from: ``([{t0, from_step}, ...], step)`` when the folder
    holds a checkpoint of the same ``train.py`` arguments (``--resume``'s aside) that no finished try left; else
    ``([], 0)``. A folder from before ``tries.json`` has one try, begun when its ``config.json`` was written."""
    from scale_ocr.checkpoint.pointer import latest_checkpoint

    try:
        argv = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))["argv"]
        ckpt = latest_checkpoint(run_dir / "checkpoints")
        step = int(json.loads((ckpt / "trainer.json").read_text(encoding="utf-8"))["step"]) if ckpt else 0
        tries = (json.loads(tries_file(run_dir).read_text(encoding="utf-8")) if tries_file(run_dir).is_file()
                 else [{"t0": (run_dir / "config.json").stat().st_mtime, "from_step": 0}])
    except (OSError, ValueError, KeyError, TypeError):
        argv, step, tries = None, 0, []
    same = argv is not None and _but_resume(argv) == _but_resume(cmd[cmd.index(str(TRAIN)) + 1:])
    return (tries, step) if same and step > 0 and tries and "ended" not in tries[-1] else ([], 0)


def _but_resume(argv: list[str]) -> list[str]:
    i = argv.index("--resume") if "--resume" in argv else len(argv)
    return argv[:i] + argv[i + 2:]


def tries_file(run_dir: Path) -> Path:
    """``RUNS/NAME.tries.json`` for the run folder ``RUNS/NAME``."""
    return run_dir.with_name(run_dir.name + TRIES)


def _write_tries(run_dir: Path, tries: list[dict[str, Any]]) -> None:
    from scale_ocr.disk import write_atomic

    write_atomic(tries_file(run_dir), json.dumps(tries) + "\n", what="the job's tries", kept="the run's own files")


def lr_plan(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "config.json").read_text(encoding="utf-8")).get("lr_plan") or {}
    except (OSError, ValueError):
        return {}


def run_one(args: argparse.Namespace, job: Job, data: list[str], sizes: tuple[int, int], work: Path,
            context: dict[str, Any]) -> dict[str, Any]:
    """Train ``job`` (continuing an interrupted try of it, :func:`earlier_tries`) and return its results line:
    ``wall_seconds`` the training time its curve kept, ``resumed_at`` the steps later tries continued from."""
    run_dir = work / "runs" / job.name
    cmd = command(args, job, data, sizes[0], run_dir)
    tries, step = earlier_tries(run_dir, cmd)
    if not tries:
        shutil.rmtree(run_dir, ignore_errors=True)  # this benchmark's own scratch: a finished or another try
    run_dir.mkdir(parents=True, exist_ok=True)
    tries.append({"t0": time.time(), "from_step": step})
    _write_tries(run_dir, tries)
    status, error, wall = run_job(cmd, context["threads"], args.timeout, None)
    _write_tries(run_dir, [*tries[:-1], tries[-1] | {"ended": status}])
    metric = "exact_match" if job.kind == "recognition" else "recall"
    curve, before = read_curve(run_dir, metric, job.global_batch, tries)
    if status == "ok" and (not curve or curve[-1]["step"] != job.steps):
        status, error = "failed", f"the curve ends at step {curve[-1]['step'] if curve else None}, not {job.steps}"
    plan_ = lr_plan(run_dir)
    return {**asdict(job), "steps": job.steps, "status": status, "error": error,
            "wall_seconds": round(before + wall, 1),
            "resumed_at": [t["from_step"] for t in tries[1:]], "train_size": sizes[0], "val_size": sizes[1],
            "metric": metric, "curve": curve, "peak_lr": plan_.get("peak_lr"), "lr_factor": plan_.get("factor"),
            "lr_line": plan_.get("line"), "warmup_steps": plan_.get("warmup_steps"),
            "threads_per_rank": context["threads"], "preset": args.preset,
            "command": " ".join(cmd).replace(f"{REPO}/", ""), **context["stamp"]}


def job_data(args: argparse.Namespace, job: Job, work: Path) -> tuple[list[str], tuple[int, int]]:
    """``train.py``'s data flags for ``job`` and its (train, val) sizes."""
    if job.kind == "detection":  # the trainer's own synthetic pages
        return (["--train-samples", str(args.det_train), "--val-samples", str(args.det_val), *RECORD_FONTS],
                (args.det_train, args.det_val))
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    chars = create_task(ModelConfig(arch=job.model)).vocab.chars
    train_size = args.synthetic_train if job.set == "synthetic" else args.real_train
    train, val = word_set(job.set, work / f"vocab-{len(chars)}", chars, train_size, args.val, args.real_crops)
    return ["--train-path", str(train), "--val-path", str(val)], (count(train), count(val))


def run(args: argparse.Namespace) -> None:
    """Each job without an ``ok`` line in ``args.out/results.jsonl``, appended there as it ends."""
    args.out.mkdir(parents=True, exist_ok=True)
    work = work_dir(args.out)
    results = args.out / "results.jsonl"
    jobs = plan(args)
    rows = load_rows(args.out)  # read once; each job's line joins it as it ends (the rates --max-minutes uses)
    todo = to_train(args, jobs, rows)
    print_estimate(args, jobs, todo, rows)
    write_command(args.out, "scale_accuracy")
    hw = hardware()
    context = {"threads": max(1, (hw["cores"] or 1) // args.world_size),
               "stamp": {"versions": versions(), "hardware": hw}}
    planned = plan_rows(jobs)
    write_plan(args.out, planned)
    by_name = {p["name"]: p for p in planned}
    started, ran = time.time(), 0
    for i, job in enumerate(todo, 1):
        below = None if args.train_all else unlearned_below(planned, latest(rows), by_name[job.name])
        if below is not None:  # a smaller batch of its group, trained in this run, learned nothing
            print(f"scale_accuracy [{i}/{len(todo)}] {job.name}: not trained: every rule ended under "
                  f"{LEARNED:.0%} at global batch {below} (--train-all trains it)", flush=True)
            continue
        data, sizes = job_data(args, job, work)
        run_dir = work / "runs" / job.name
        step = earlier_tries(run_dir, command(args, job, data, sizes[0], run_dir))[1]
        if not fits(args, job, len(todo) - i + 1, rows, time.time() - started, first=ran == 0, done=step / job.steps):
            break
        ran += 1
        row = run_one(args, job, data, sizes, work, context)
        append_line(results, row)
        rows.append(row)
        final = f"{row['curve'][-1]['value']:.3f}" if row["curve"] else "-"
        print(f"scale_accuracy [{i}/{len(todo)}] {job.name}: {row['status']}, final {row['metric']} {final}, "
              f"{row['lr_line'] or ''} [{row['wall_seconds']:.0f} s]" + (f" ({row['error']})" if row["error"] else ""),
              flush=True)


def write_plan(out: Path, planned: list[dict[str, Any]]) -> None:
    """``plan.json``: every planned job (:func:`plan_rows`), for the report to say which have no result yet."""
    (out / "plan.json").write_text(json.dumps(planned, indent=1) + "\n", encoding="utf-8")


def fits(args: argparse.Namespace, job: Job, left: int, rows: list[dict[str, Any]], spent: float, first: bool,
         done: float = 0.0) -> bool:
    """Whether ``job``, of which an interrupted try trained the fraction ``done``, ends within ``--max-minutes`` of
    the run's start (at its model's rate, measured by the folder's finished jobs where it has them, plus 10%); if
    not, one line says where the run stops and how it goes on. A limit too short for the run's first job is a user
    error: the run would do nothing."""
    from scale_ocr.errors import UserError

    if args.max_minutes is None:
        return True
    need, remain = estimate([job], rows)[0] * (1 - done) * 1.1 / 60, args.max_minutes - spent / 60
    if need <= remain:
        return True
    if first:
        raise UserError(f"--max-minutes {args.max_minutes}: the first job to run, {job.name}, needs about "
                        f"{need:.0f} min on this host; give it at least {math.ceil(need)}")
    print(f"scale_accuracy: stopped before {job.name} with {left} job(s) to run: it needs about {need:.0f} min, "
          f"{remain:.0f} of --max-minutes {args.max_minutes} remain; the same command resumes there", flush=True)
    return False


def print_estimate(args: argparse.Namespace, jobs: list[Job], todo: list[Job], rows: list[dict[str, Any]]) -> None:
    """The plan's size and how long its remaining jobs take, in all and per model."""
    seconds, rates = estimate(todo, rows)
    done = len(finished(jobs, rows, args.supersede))
    skipped = len(jobs) - done - len(todo)
    parts = []
    for m in dict.fromkeys(j.model for j in jobs):
        mine = [j for j in todo if j.model == m]
        parts.append(f"{m}: {len(mine)} jobs, {estimate(mine, rows)[0] / 3600:.1f} h "
                     f"at {rates.get(m, OTHER_RATE):.1f} samples/s")
    bound, less = (("about", "") if args.train_all else  # else skips can only shorten the run
                   ("at most", "; less where a batch learns nothing: the batches above it are not trained"))
    print(f"scale_accuracy: preset {args.preset}: {len(jobs)} jobs, {done} done, "
          f"{f'{skipped} not trained (above a batch that learned nothing), ' if skipped else ''}{len(todo)} to run: "
          f"{bound} {seconds / 3600:.1f} h ({seconds / 60:.0f} min) of this host's cores ({'; '.join(parts)}; a rate "
          f"per job, measured by this folder's finished jobs where it has them{less})", flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("scale_accuracy", __doc__)
    p.add_argument("--preset", choices=tuple(PRESETS), default="smoke")
    p.add_argument("--real-crops", type=Path, default=None,
                   help="a `scale-ocr make-dataset` output: its recognition crops become the set `crops`")
    p.add_argument("--estimate", action="store_true", help="print the plan's size and CPU time, run nothing")
    p.add_argument("--train-all", action="store_true",
                   help="train every planned job, also those above a batch of their group at which every rule ended "
                        f"under {LEARNED * 100:.0f}%% (by default not trained: a larger batch takes fewer steps to "
                        "the same samples)")
    p.add_argument("--supersede", action="store_true",
                   help="train again the jobs --out holds lines of trained with other settings (a changed budget); "
                        "once a job's new line is in, the same command resumes without it")
    lists = {"models": "recognizers", "sets": f"of {', '.join(SETS)}", "batches": "global batches",
             "rules": f"of {', '.join(RULES)}", "det_batches": "detection's global batches (pages)"}
    for name, what in lists.items():
        p.add_argument(f"--{name.replace('_', '-')}", default=None,
                       help=f"comma-separated {what} (default: the preset's)")
    for name in ("samples", "eval_samples", "synthetic_train", "real_train", "val", "det_samples", "det_train",
                 "det_val"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help="every word set's budget (default: the preset's, per set)" if name == "samples" else
                       "default: the preset's")
    p.add_argument("--det-eval-samples", type=int, default=None, help="default: a quarter of --det-samples")
    p.add_argument("--world-size", type=int, default=2, help="ranks per job (accumulation makes up the rest)")
    p.add_argument("--micro-batch", type=int, default=32, help="largest words per rank per micro-batch")
    p.add_argument("--det-micro-batch", type=int, default=2, help="largest pages per rank per micro-batch")
    p.add_argument("-j", "--workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wandb-mode", default="disabled", choices=("offline", "disabled"))
    p.add_argument("--timeout", type=int, default=4 * 3600, help="seconds per training job")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no job that would end past this many minutes from the start (a session's or a "
                        "scheduler's time limit); the same command resumes with the next")
    return fill(p, p.parse_args(argv))


def fill(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The preset's values for every flag not given; lists split and checked. A ``--samples`` given is every word
    set's budget; without it each set has the preset's."""
    args.set_samples = {} if args.samples is not None else dict(PRESETS[args.preset]["set_samples"])
    for name, value in PRESETS[args.preset].items():
        if name == "set_samples":
            continue
        given = getattr(args, name)
        if given is None:
            setattr(args, name, value)
        elif isinstance(value, list):
            items = [v for v in given.split(",") if v]
            if name.endswith("batches") and not all(v.isdigit() and int(v) > 0 for v in items):
                p.error(f"--{name.replace('_', '-')} {given}: give comma-separated positive whole numbers, e.g. 32,64")
            setattr(args, name, [int(v) for v in items] if name.endswith("batches") else items)
    if args.det_eval_samples is None:
        args.det_eval_samples = max(1, args.det_samples // 4)
    if args.real_crops is not None and "crops" not in args.sets:
        args.sets = [*args.sets, "crops"]
    for bad in [s for s in args.sets if s not in SETS] + [r for r in args.rules if r not in RULES]:
        p.error(f"unknown set or rule {bad!r}: sets {', '.join(SETS)}; rules {', '.join(RULES)}")
    return args


def check(args: argparse.Namespace) -> None:
    """Every flag's value before anything runs (one line each)."""
    from scale_ocr.errors import UserError
    from scale_ocr.models.factory import model_entry

    for model in args.models:
        if "recognition" not in model_entry(model).task:  # an unknown name: one line listing the known ones
            raise UserError(f"--models {model}: a {model_entry(model).task} model; this list is of word recognizers "
                            "(detection trains db_mobilenet_v3_large at --det-batches)")
    if "crops" in args.sets:
        crops_folders(args.real_crops)
    for name in ("samples", "eval_samples", "det_samples", "det_eval_samples", "world_size", "micro_batch",
                 "det_micro_batch"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)}: use at least 1")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise UserError(f"--max-minutes {args.max_minutes}: give the minutes this run may take, more than 0")
    budgets = [(args.batches, budget(args, name), "--samples") for name in args.sets]
    for batches, samples, flag in (*budgets, (args.det_batches, args.det_samples, "--det-samples")):
        for g in batches:
            split_batch(g, args.world_size, 1)
            if g > samples:
                raise UserError(f"global batch {g} is more than the sample budget {samples}: raise {flag}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.estimate and not args.report:
        check(args)
        from benchmarks.harness import default_out

        out = args.out or default_out("scale-accuracy")
        jobs = plan(args)
        rows = load_rows(out)
        print_estimate(args, jobs, to_train(args, jobs, rows), rows)
        return 0
    return bench_main("scale_accuracy", args, run, build_report, check)


if __name__ == "__main__":
    run_main(main)
