"""What the scale-accuracy benchmark trains: its presets, its jobs (a model on a word set at a global batch under a
rate rule) in the order they run, which of them a results folder already holds, and how long the rest take on this
host. :mod:`benchmarks.scale_accuracy` runs them; :mod:`benchmarks.scale_accuracy_report` reports them."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.scale_accuracy_report import RULES, at_reference, key_of, latest, unlearned_below

CRNN, VIT, DET = "crnn_mobilenet_v3_small", "vitstr_tiny", "db_mobilenet_v3_large"
# Samples (words or pages) per second of one job on the 2-core VM (2 ranks x 1 thread, loading and evaluation
# included), for the estimate until the folder's own finished jobs measure them. CRNN: the convergence record
# convergence-vm-20261203 on a quiet host (98,304 synthetic words in 417 s; 1195 s on a loaded one the day
# before); the others from it by their training step's cost per sample against the CRNN's, measured interleaved in
# one 1-thread process (vitstr_tiny x7.0, vitstr_small x22, db_mobilenet_v3_large at 512x512 x138). vitstr_tiny:
# its first record job since (98,304 synthetic words at batch 64 in 2103 s), faster than that ratio said.
RATES = {CRNN: 236.0, VIT: 46.7, "vitstr_small": 10.7, DET: 1.7}
OTHER_RATE = 10.0  # a model measured neither here nor by the folder: a guess, corrected by its first finished job
PRESETS: dict[str, dict[str, Any]] = {
    # A minute or two: does every piece run end to end (one model, one set, two batches, one rule, detection).
    "smoke": {"models": [CRNN], "sets": ["synthetic"], "batches": [32, 64], "rules": ["sqrt"], "samples": 1024,
              "set_samples": {}, "eval_samples": 512, "synthetic_train": 1024, "val": 64, "real_train": 1024,
              "det_batches": [2, 4], "det_samples": 16, "det_train": 16, "det_val": 4},
    # The report of record: the convergence records' budgets, every batch from 32 to 512, every rule. Synthetic
    # words: 3 epochs of 32768 (98304 samples, 1536 steps at batch 64). Real-looking crops: 24 epochs of 8192
    # (196608 samples, convergence-real-vm-20261204's 3072 steps at batch 64, where the CRNN reaches 75.6%; at 98304
    # it ended at 10% at batch 64 and 34% at 32, before it had learned the set).
    "record": {"models": [CRNN, VIT], "sets": ["synthetic", "real"], "batches": [32, 64, 128, 256, 512],
               "rules": list(RULES), "samples": 98304, "set_samples": {"real": 196608}, "eval_samples": 8192,
               "synthetic_train": 32768, "val": 512, "real_train": 8192, "det_batches": [4, 32], "det_samples": 2048,
               "det_train": 1024, "det_val": 64},
}


@dataclass(frozen=True)
class Job:
    """One training run: a model on a set at a global batch under a rule."""

    kind: str  # recognition or detection
    model: str
    set: str
    global_batch: int
    rule: str
    world_size: int
    micro_batch: int
    grad_accum: int
    samples: int
    eval_every: int  # optimizer steps
    reference_batch: int

    @property
    def key(self) -> tuple[str, str, str, int, str]:
        return key_of(asdict(self))

    @property
    def steps(self) -> int:
        return self.samples // self.global_batch

    @property
    def name(self) -> str:
        return f"{self.model}-{self.set}-g{self.global_batch}-{self.rule}"


def split_batch(global_batch: int, world_size: int, max_micro: int) -> tuple[int, int]:
    """``(micro-batch, accumulation)`` with ``world_size x micro x accum == global_batch`` and the largest micro-batch
    up to ``max_micro`` (accumulation stands in for the ranks this host lacks)."""
    from scale_ocr.errors import UserError

    if global_batch % world_size:
        raise UserError(f"global batch {global_batch} is not a multiple of --world-size {world_size}")
    per_rank = global_batch // world_size
    micro = max(m for m in range(1, min(max_micro, per_rank) + 1) if per_rank % m == 0)
    return micro, per_rank // micro


def plan(args: argparse.Namespace) -> list[Job]:
    """Every job of the run, in order: group by group (a recognizer on a word set, then detection as one group), the
    cheapest group first at :data:`RATES`, so that a record run in parts completes whole groups early; within a
    group batch by batch, rule by rule. At a model's reference batch the rules coincide: only the default rule's job
    runs there."""
    from scale_ocr.config import DEFAULT_LR_SCALING
    from scale_ocr.models.factory import reference_batch

    groups = []
    for model in args.models:
        ref = reference_batch(model)
        for name in args.sets:
            jobs = []
            for g in args.batches:
                rules = [r for r in args.rules if g != ref or r == DEFAULT_LR_SCALING] or args.rules[:1]
                micro, accum = split_batch(g, args.world_size, args.micro_batch)
                jobs += [Job("recognition", model, name, g, rule, args.world_size, micro, accum, budget(args, name),
                             max(1, args.eval_samples // g), ref) for rule in rules]
            groups.append(jobs)
    ref = reference_batch(DET)
    detection = []
    for g in args.det_batches:
        micro, accum = split_batch(g, args.world_size, args.det_micro_batch)
        detection.append(Job("detection", DET, "synthetic-pages", g, DEFAULT_LR_SCALING, args.world_size, micro,
                             accum, args.det_samples, max(1, args.det_eval_samples // g), ref))
    groups.append(detection)
    return [job for group in sorted(groups, key=lambda jobs: estimate(jobs, [])[0]) for job in group]


def budget(args: argparse.Namespace, name: str) -> int:
    """Training samples per job on the word set ``name``: the preset's for that set, else ``--samples``."""
    return int(args.set_samples.get(name, args.samples))


def estimate(jobs: list[Job], rows: list[dict[str, Any]]) -> tuple[float, dict[str, float]]:
    """Seconds the jobs take on this host, and each model's rate. A job goes at the rate the folder's finished jobs
    of its model on its set measured (sets differ in what a sample costs: the real-looking words train a CRNN at
    about 0.8x the synthetic rate), else of its model on any set, else :data:`RATES`."""
    done = [r for r in rows if r["status"] == "ok" and r["wall_seconds"] > 0]

    def rate(of: list[dict[str, Any]]) -> float:
        return sum(r["samples"] for r in of) / sum(r["wall_seconds"] for r in of)

    rates = dict(RATES) | {m: rate([r for r in done if r["model"] == m]) for m in {r["model"] for r in done}}
    pairs = {(r["model"], r["set"]) for r in done}
    by_set = {pair: rate([r for r in done if (r["model"], r["set"]) == pair]) for pair in pairs}
    return sum(j.samples / by_set.get((j.model, j.set), rates.get(j.model, OTHER_RATE)) for j in jobs), rates

def plan_rows(jobs: list[Job]) -> list[dict[str, Any]]:
    """``jobs`` as ``plan.json`` lists them: what names a job and its budget."""
    keys = ("kind", "model", "set", "global_batch", "rule", "samples")
    return [{k: asdict(j)[k] for k in keys} | {"name": j.name} for j in jobs]


def to_train(args: argparse.Namespace, jobs: list[Job], rows: list[dict[str, Any]]) -> list[Job]:
    """The planned ``jobs`` that ``rows`` holds no ``ok`` line of (:func:`finished`), less those above a batch of
    their group at which every rule ended under the report's learned line (unless ``--train-all``)."""
    done, planned, last = finished(jobs, rows, args.supersede), plan_rows(jobs), latest(rows)
    return [j for j, p in zip(jobs, planned, strict=True) if j.key not in done
            and (args.train_all or unlearned_below(planned, last, p) is None)]


def finished(jobs: list[Job], rows: list[dict[str, Any]], supersede: bool = False) -> set[tuple]:
    """The keys of ``jobs`` whose last ``ok`` line in ``rows`` trained them as planned. At a model's reference batch
    every rule gives the same rate, so a line there ran under any rule stands for the planned job (a default rule
    changed between two sessions of one record does not train it again). A job whose last line was trained otherwise
    (another budget, split of the batch or evaluation interval) is refused, as a resumed folder holds one
    experiment, unless ``supersede``: then the job trains again, and once its new line is in, the same command
    resumes without it (the report reads each job's last line)."""
    from scale_ocr.errors import UserError

    planned = {j.key: asdict(j) for j in jobs}
    shared = {k[:4]: k for k, j in planned.items() if at_reference(j)}
    last = {}
    for r in rows:
        key = key_of(r)
        if key not in planned and at_reference(r):
            key = shared.get(key[:4], key)
        if key in planned and r["status"] == "ok":
            last[key] = r
    done = set()
    for key, r in last.items():
        differ = [f for f in ("samples", "world_size", "micro_batch", "grad_accum", "eval_every")
                  if r[f] != planned[key][f]]
        if differ and not supersede:
            raise UserError(f"the results folder already holds {'/'.join(map(str, key_of(r)))} trained with other "
                            f"{', '.join(differ)} ({', '.join(f'{f} {r[f]}' for f in differ)}); resume with the flags "
                            "it was run with, give another --out, or pass --supersede to train such jobs again")
        if not differ:
            done.add(key)
    return done
