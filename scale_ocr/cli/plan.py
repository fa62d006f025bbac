"""``scale-ocr plan RUN_DIR --target T``: per strategy and device count, whether the job fits, its step time, the
global batch and rate to train at, and the steps, samples and time to the target, with their uncertainty.

The steps come from :mod:`scale_ocr.planning.to_target`, anchored on the finished run (its steps to the target and
the gradient noise scale it logged there); the memory from :mod:`scale_ocr.planning.estimate`; the step time from
the time model (:mod:`scale_ocr.planning.time_model`, on this host measured). docs/scaling-pays.md says how far each
part has been checked."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from scale_ocr.cli.args import _OneLineParser
from scale_ocr.cli.estimate_time import CURVE, add_cluster_args, cluster_for, row, workload
from scale_ocr.config import RAMP_LIMIT
from scale_ocr.errors import UserError, report_user_errors, say, shown
from scale_ocr.planning.to_target import SPREAD, first_reach, path_mean, seconds_to, steps_band, value_at

STRATEGIES = "ddp,fsdp,zero2,zero3"
MAX_PER_DEVICE = 1024  # per-device batches tried: the powers of two up to --max-batch-per-device (default 256)


@dataclass(frozen=True)
class Anchor:
    """What the plan takes from a finished run: where it got to the target, and how."""

    run_dir: Path
    arch: str
    model: Any  # its ModelConfig: input size, vocabulary and size overrides as it trained
    headline: str
    target: float
    global_batch: int
    world_size: int
    per_device: int
    precision: str
    strategy: str
    steps: int  # to the target: its first validation at or above it
    samples: int
    b_simple: float  # along the way to the target (to_target.path_mean): the B_crit estimate
    b_simple_at: float  # logged at the target
    lr: float
    seconds: float  # training seconds to the target, from its logged step times


def read_anchor(run_dir: Path, target: float) -> Anchor:
    """The run in ``run_dir`` as an anchor for ``target`` (its headline metric), or one line saying what it lacks."""
    from scale_ocr.cli.summary import load_run, read_curves, run_file

    run = load_run(run_dir)
    config = run_file(run_dir, "config.json")
    if run.start_batch is not None:
        raise UserError(f"{shown(str(run_dir))} grew its batch (--batch-ramp): its steps to the target belong to no "
                        "one batch; anchor the plan on a run at a fixed batch")
    metric = f"val/{run.headline}"
    curves = read_curves(run_dir / "metrics.jsonl", (metric, "noise/b_simple", "train/step_time"))
    steps, values = curves.points(metric)
    reached = first_reach(steps, values, target)
    if reached is None:
        best = f"its best validation {run.headline} was {max(values):.4g}" if values else "it logged no validation"
        raise UserError(f"{shown(str(run_dir))} never reached {run.headline} {target:g} ({best}); pass a --target it "
                        "reached, or anchor on a run that trained longer")
    b_simple_at = value_at(*curves.points("noise/b_simple"), reached)
    b_simple = path_mean(*curves.points("noise/b_simple"), reached, run.global_batch)
    if b_simple is None or b_simple_at is None:
        raise UserError(f"{shown(str(run_dir))} logged no gradient noise scale by step {reached}, where it reached "
                        f"the target; train the anchor with the noise scale on (it is by default: not --noise-every 0)")
    per_device = config.get("train.batch_size", "count", required=True)
    accumulation = config.get("train.grad_accum", "count") or 1
    step_steps, step_times = curves.points("train/step_time")
    precision = config.get("train.precision", "text") or "fp32"
    lr = config.get("lr_plan.peak_lr", "number") or 0.0
    return Anchor(run_dir, run.arch, _model_config(config, run.arch), run.headline, target, run.global_batch,
                  run.world_size, per_device * accumulation, precision, run.strategy, reached,
                  reached * run.global_batch, b_simple, b_simple_at, lr, seconds_to(reached, step_steps, step_times))


def _model_config(config, arch: str):
    """The anchor's model as it trained (input size, vocabulary, a scalable model's size), from its config.json."""
    from scale_ocr.config import MODEL_SIZE_FIELDS, ModelConfig

    size = config.data.get("model", {}).get("input_size") if isinstance(config.data.get("model"), dict) else None
    if size is not None and not (isinstance(size, list) and len(size) == 2
                                 and all(isinstance(v, int) and not isinstance(v, bool) and 8 <= v <= 2**16
                                         for v in size)):
        raise UserError(f"{shown(config.path)}: model.input_size is not [height, width]; the run directory is "
                        "damaged: repair the file or rerun the training")
    fields = {f: config.get(f"model.{f}", "number" if f == "mlp_ratio" else "count") for f in MODEL_SIZE_FIELDS}
    return ModelConfig(arch=arch, input_size=tuple(size) if size else None, vocab=config.get("vocab", "text"),
                       **{f: (int(v) if f != "mlp_ratio" else v) if v is not None else None for f, v in fields.items()})


def _check(args: argparse.Namespace) -> None:
    if not 0 < args.target <= 1 or math.isnan(args.target):
        raise UserError(f"--target {args.target:g} is not a fraction in (0, 1]; give e.g. --target 0.9 for 90%")
    if args.global_batch is not None and args.global_batch < 1:
        raise UserError(f"--global-batch {args.global_batch} is below 1; give e.g. --global-batch 64")
    if not 1 <= args.max_batch_per_device <= MAX_PER_DEVICE:
        raise UserError(f"--max-batch-per-device {args.max_batch_per_device} is not from 1 to {MAX_PER_DEVICE}")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise UserError(f"--mfu {args.mfu:g} is not in (0, 1]; give e.g. --mfu 0.4")
    if args.per_node < 1:
        raise UserError(f"--per-node {args.per_node} is below 1")


def _devices(text: str | None, on_host: bool) -> list[int]:
    if text is None:  # this host's ranks share its cores: no more ranks than cores
        return [n for n in CURVE if n <= (os.cpu_count() or 1)] if on_host else list(CURVE)
    try:
        counts = sorted({int(v) for v in text.split(",")})
    except ValueError:
        raise UserError(f"--devices {text!r}: expected device counts such as 1,2,4,8") from None
    if counts[0] < 1 or counts[-1] > CURVE[-1]:
        raise UserError(f"--devices {text!r}: each count from 1 to {CURVE[-1]}")
    return counts


def _capacity(device, ranks_on_host: int) -> tuple[float, str]:
    if device.memory is not None:
        return device.memory, f"{device.memory / 1e9:.0f} GB per device ({device.source})"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / ranks_on_host, f"this host's {host / 2**30:.1f} GiB RAM shared by {ranks_on_host} rank(s)"


class _Planner:
    """The model built once, its memory per strategy and device count, and step times per cluster."""

    def __init__(self, args: argparse.Namespace, anchor: Anchor):
        import torch

        from scale_ocr.planning.estimate import measure_activations, model_size
        from scale_ocr.tasks import create_task

        self.args, self.anchor = args, anchor
        self.task = create_task(anchor.model)
        with torch.device("cpu"):
            self.model = self.task.build_model()
        self.size = model_size(self.model)
        self.acts = measure_activations(self.model, self.task.dummy_inputs(anchor.per_device), anchor.precision)
        self.timing = argparse.Namespace(**{**vars(args), "batch_size": anchor.per_device, "world_size": 1,
                                            "precision": anchor.precision, "activation_checkpointing": False,
                                            "flops_per_sample": None})
        self.work = workload(self.timing, self.task, self.size)
        self.clusters: dict[int, tuple[Any, float, str, dict[str, Any]]] = {}

    def cluster(self, n: int):
        """The cluster at ``n`` devices: on this host measured with ``n`` ranks at once (their threads share it)."""
        key = n if self.args.device == "host" else 0
        if key not in self.clusters:
            self.clusters[key] = cluster_for(replace_ns(self.timing, world_size=n), self.task, self.work,
                                             self.names())
        return self.clusters[key]

    def names(self) -> list[str]:
        return self.args.strategies.split(",")

    def layout(self, name: str, n: int):
        from scale_ocr.planning.estimate import build_strategy

        strategy, _ = build_strategy(name, n, self.anchor.precision, None, min(self.args.per_node, n))
        strategy.configure_for(self.model)
        return strategy.state_layout()

    def memory(self, n: int, layout, per_device: list[int]) -> dict[int, float]:
        """Peak bytes a device holds at each per-device batch: the engine's state, and activations (linear in the
        batch from the measurement at the anchor's)."""
        from scale_ocr.memory.model import predict
        from scale_ocr.planning.estimate import peaks

        pred = predict(layout, self.size.params, n)
        acts = self.acts.under(layout)
        return {b: max(peaks(pred, layout, self.size.largest_layer, acts * b / self.anchor.per_device))
                for b in per_device}

    def step_seconds(self, name: str, n: int, layout, per_device: int) -> float:
        """The time model's step at ``per_device``; an engine measured here at the anchor's per-device batch has
        its compute and remainder scaled by the batch (its FLOPs are linear in it), its optimizer step kept."""
        from scale_ocr.planning.time_model import predict_step

        cluster, mfu, _, engines = self.cluster(n)
        engine = engines.get(name)
        if engine is not None:
            f = per_device / self.anchor.per_device
            engine = replace(engine, compute=engine.compute * f, other=engine.other * f)
        return predict_step(layout, replace(self.work, batch=per_device), n, cluster, mfu, engine).total


def replace_ns(ns: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(ns), **changes})


def plan_rows(planner: _Planner, devices: list[int]) -> dict[str, list[dict[str, Any]]]:
    """Per strategy, one row per device count: the per-device batch chosen (or pinned), and its predictions."""
    args, anchor = planner.args, planner.anchor
    per_device = [2**k for k in range(11) if 2**k <= args.max_batch_per_device]
    out: dict[str, list[dict[str, Any]]] = {}
    for name in planner.names():
        rows = []
        for n in devices:
            row_: dict[str, Any] = {"devices": n}
            try:
                layout = planner.layout(name, n)
            except UserError as exc:  # e.g. zero3_hpz on one rank per node
                rows.append({**row_, "skipped": str(exc)})
                continue
            capacity, _ = _capacity(planner.cluster(n)[0].device, min(n, args.per_node))
            if args.global_batch is not None:
                if args.global_batch % n:
                    rows.append({**row_, "skipped": f"--global-batch {args.global_batch} does not split over {n}"})
                    continue
                options = [args.global_batch // n]
            else:
                options = per_device
            memory = planner.memory(n, layout, options)
            fitting = [b for b in options if memory[b] <= capacity]
            if not fitting:
                need = memory[options[0]] / 1e9
                rows.append({**row_, "fits": False, "memory_gb": need, "capacity_gb": capacity / 1e9,
                             "skipped": f"needs {need:.3g} GB a device at batch {options[0]}, over "
                                        f"{capacity / 1e9:.3g}"})
                continue
            under = [b for b in fitting if n * b <= RAMP_LIMIT * anchor.b_simple] or fitting[:1]
            best = None
            for b in under if args.global_batch is None else fitting:
                step = planner.step_seconds(name, n, layout, b)
                band = steps_band(anchor.global_batch, anchor.steps, anchor.b_simple, n * b)
                seconds = band.scaled(step)
                if best is None or seconds.steps < best[2].steps:
                    best = (b, step, seconds, band)
            b, step, seconds, band = best  # type: ignore[misc]
            rows.append({**row_, "fits": True, "per_device": b, "global_batch": n * b,
                         "memory_gb": memory[b] / 1e9, "capacity_gb": capacity / 1e9,
                         "step_s": step, "steps": band.steps, "steps_low": band.low, "steps_high": band.high,
                         "samples": band.steps * n * b, "seconds": seconds.steps, "seconds_low": seconds.low,
                         "seconds_high": seconds.high, "past_knee": n * b > anchor.b_simple,
                         "lr": anchor.lr * math.sqrt(n * b / anchor.global_batch)})
        out[name] = rows
    return out


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.2g} s" if s < 10 else f"{s:.0f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def format_plan(doc: dict[str, Any]) -> str:
    a = doc["anchor"]
    lines = [f"Anchor: {shown(a['run_dir'])}: {a['arch']} at global batch {a['global_batch']} ({a['world_size']} "
             f"rank(s), {a['strategy']}) reached {a['headline']} {a['target']:g} at step {a['steps']} "
             f"({a['samples']:,} samples, {_duration(a['seconds'])} of training); B_simple along the way there "
             f"{a['b_simple']:.0f} (at the target {a['b_simple_at']:.0f}).",
             f"Steps: S(B) = S_min (1 + B_crit/B), S_min {doc['s_min']:.0f}, B_crit = B_simple along the way; the "
             f"range takes B_crit from it/{SPREAD:g} to x{SPREAD:g} (the knees the critical-batch record fitted, "
             "against it: docs/scaling-pays.md; B_simple at the target, read late in training, overstates the knee). "
             f"Recommended: at most {RAMP_LIMIT:g} B_crit.",
             f"Rate: sqrt rule from the anchor: lr x sqrt(B / {a['global_batch']}) (--lr {a['lr']:g} --lr-scaling "
             f"sqrt --lr-reference-batch {a['global_batch']}). Step time: {doc['source']}. Memory: {doc['capacity']}.",
             row("strategy", ["devices", "batch", "per dev", "mem GB", "step ms", "steps", "samples", "time",
                              "time range", "lr"], [8, 7, 8, 8, 9, 8, 10, 10, 20, 9])]
    for name, rows in doc["strategies"].items():
        for r in rows:
            if "skipped" in r:
                lines.append(row(name, [str(r["devices"]), "-", "-", "-", "-", "-", "-", "-", r["skipped"][:60], "-"],
                                 [8, 7, 8, 8, 9, 8, 10, 10, 20, 9]))
                continue
            knee = "*" if r["past_knee"] else ""
            lines.append(row(name, [str(r["devices"]), f"{r['global_batch']}{knee}", str(r["per_device"]),
                                    f"{r['memory_gb']:.3g}", f"{r['step_s'] * 1e3:.3g}", f"{r['steps']:.0f}",
                                    f"{r['samples']:,.0f}", _duration(r["seconds"]),
                                    f"{_duration(r['seconds_low'])}-{_duration(r['seconds_high'])}", f"{r['lr']:.3g}"],
                             [8, 7, 8, 8, 9, 8, 10, 10, 20, 9]))
    lines.append(f"Knee: B_crit {a['b_simple']:.0f} is reached at about {doc['knee_devices']:.3g} devices (at the "
                 "first row's per-device batch); * marks a global batch above B_crit, where more devices stop buying "
                 "time.")
    lines.append("Check first on a GPU: the step time at 1 and 8 devices against `estimate-memory --time`, and one "
                 "run at the recommended batch to the target against its predicted steps.")
    return "\n".join(lines)


def plot_plan(doc: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scale_ocr.cli.summary import write_png

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in doc["strategies"].items():
        ok = [r for r in rows if r.get("fits")]
        if not ok:
            continue
        x = [r["devices"] for r in ok]
        line, = ax.plot(x, [r["seconds"] for r in ok], marker="o", label=name)
        ax.fill_between(x, [r["seconds_low"] for r in ok], [r["seconds_high"] for r in ok], color=line.get_color(),
                        alpha=0.12)
    ax.axvline(doc["knee_devices"], color="grey", linestyle="--", label=f"knee: B_crit {doc['anchor']['b_simple']:.0f}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel(f"predicted training time to {doc['anchor']['headline']} {doc['anchor']['target']:g} (s)")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    write_png(fig, plt, out, "the plan's plot", "nothing else was written")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="scale-ocr plan", description="Time to a target accuracy per strategy and device count, "
                       "anchored on a finished run's steps to it and the gradient noise scale it measured.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a finished run (train.py --output-dir) that reached the target")
    p.add_argument("--target", type=float, required=True, help="the headline validation metric to reach, a fraction "
                   "(exact match for recognizers, recall for detectors), e.g. 0.9")
    p.add_argument("--devices", default=None, help="device counts, e.g. 1,2,4,8 (default: 1 to 1,024 in powers of "
                   "two; on --device host, up to this machine's cores)")
    p.add_argument("--global-batch", type=int, default=None, help="predict at this global batch at every device "
                   "count instead of choosing one")
    p.add_argument("--strategies", default=STRATEGIES, help=f"comma-separated (default {STRATEGIES})")
    p.add_argument("--max-batch-per-device", type=int, default=256, help="the largest per-device batch tried")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of time to the target against devices")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_cluster_args(p.add_argument_group("the cluster (as estimate-memory --time)"))
    return p


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    import contextlib

    from scale_ocr.planning.to_target import StepsModel

    args = build_parser().parse_args(argv)
    _check(args)
    anchor = read_anchor(Path(args.run_dir), args.target)
    devices = _devices(args.devices, args.device == "host")
    with contextlib.redirect_stdout(sys.stderr):  # engines' import-time lines: stdout holds the plan alone
        planner = _Planner(args, anchor)
        rows = plan_rows(planner, devices)
        cluster, _, source, _ = planner.cluster(devices[0])
    chosen = [r["per_device"] for rs in rows.values() for r in rs if r.get("fits")]  # the first fitting row's
    doc = {"anchor": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(anchor).items() if k != "model"},
           "s_min": StepsModel.anchored(anchor.global_batch, anchor.steps, anchor.b_simple).s_min,
           "source": source, "capacity": _capacity(cluster.device, min(devices[0], args.per_node))[1],
           "knee_devices": anchor.b_simple / (chosen[0] if chosen else 1), "strategies": rows}
    if args.plot is not None:
        plot_plan(doc, args.plot)
    say(json.dumps(doc, indent=1) if args.json else format_plan(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
