"""``scale-ocr summary RUN_DIR``: one screen on a finished run, and a PNG of its curves.

It reads only what the run wrote (config.json, metrics.json, metrics.jsonl and W&B's offline folder), so it works
on any run directory, after the fact: what was trained, by which strategy on how many ranks, how fast and how
well, where its files are, how to upload its W&B run, and the same job under another strategy.

A run directory is read as a user's input, not trusted: each file through :func:`scale_ocr.disk.open_user_file`
(a regular file of bounded size, never through a link), parsed into a typed :class:`Run` (a field of the wrong
type is one line naming the file and the field) before anything is formatted; every line goes out through
:func:`scale_ocr.errors.say` (escaped); the plot is written whole, never through a link, never over a run's file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import stat
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scale_ocr.disk import GiB, KiB, atomic_file, check_output, open_user_file, read_user_json
from scale_ocr.errors import JSON_ERRORS, UserError, on_interrupt, printable, say, shown

OTHER_STRATEGIES = ("fsdp", "zero3")  # the "same job under ..." lines: sharded parameters, by torch and DeepSpeed
CURVES_LIMIT = 4 * GiB  # metrics.jsonl: a million logged steps take ~0.5 GiB; it is streamed, never held whole
CURVE_LINE_LIMIT = 64 * KiB  # one metrics.jsonl record is well under 1 KiB; a longer line is skipped, not read whole
TEXT_LIMIT = 200  # characters of a run file's string shown on the screen
COUNT_LIMIT = 1 << 63
# A plotted value beyond this is no loss or metric (matplotlib's log axis overflows near 1e308); a step beyond
# STEP_LIMIT has no exact float. Such points are left out of the plot.
VALUE_LIMIT, STEP_LIMIT = 1e30, 1 << 53
NOISE_FIELDS = ("b_simple", "grad_sq", "trace", "b_small", "b_big", "smoothing", "every", "readings", "clipped")
_JSON_TYPES = ((bool, "true or false"), (str, "a string"), (int, "a number"), (float, "a number"), (list, "an array"),
               (dict, "an object"))


def _json_kind(value: object) -> str:
    if value is None:
        return "null"
    return next((words for t, words in _JSON_TYPES if isinstance(value, t)), type(value).__name__)


class _Fields:
    """A run file's JSON object, read one dotted field at a time with its type checked (:meth:`get`)."""

    def __init__(self, data: object, path: Path) -> None:
        self.path = path
        if not isinstance(data, dict):
            raise self._wrong("its content", data, "an object")
        self.data = data

    def _wrong(self, name: str, value: object, expected: str) -> UserError:
        return UserError(f"{shown(self.path)}: {name} is {_json_kind(value)} ({printable(json.dumps(value), 40)}), not "
                         f"{expected}; the run directory is damaged: repair the file or rerun the training")

    def get(self, dotted: str, kind: str, *, required: bool = False) -> Any:
        """The field ``dotted`` (``"model.arch"``) as ``kind``: ``text``, ``count`` (an integer >= 0), ``number``
        (a float, NaN allowed), ``texts`` (a list of strings); None when absent or null, unless ``required``."""
        node: Any = self.data
        parts = dotted.split(".")
        for i, part in enumerate(parts):
            if node is not None and not isinstance(node, dict):
                raise self._wrong(".".join(parts[:i]), node, "an object")
            node = None if node is None else node.get(part)
        if node is None:
            if required:
                raise UserError(f"{shown(self.path)} has no {dotted}; the run directory is damaged or not a "
                                "scale-ocr run: repair the file or rerun the training")
            return None
        return self._typed(dotted, node, kind)

    def _typed(self, dotted: str, value: Any, kind: str) -> Any:
        if kind == "text" and isinstance(value, str):
            return value
        if kind == "texts" and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if kind == "count" and is_int and 0 <= value < COUNT_LIMIT:
            return value
        if kind == "number" and (is_int or isinstance(value, float)):
            try:
                return float(value)
            except OverflowError:
                pass
        expected = {"text": "a string", "texts": "an array of strings", "count": "a whole number >= 0",
                    "number": "a number"}[kind]
        raise self._wrong(dotted, value, expected)


@dataclass
class Run:
    """What summary shows of a run, every field of the type it formats."""

    run_dir: Path
    arch: str
    headline: str
    percent: bool
    metric_names: tuple[str, ...]
    percent_metrics: frozenset[str]
    task: str | None
    num_params: float | None
    argv: list[str] | None
    world_size: int
    output_dir: str | None
    wandb_mode: str | None
    lr_line: str | None
    num_val: int | None
    strategy: str
    global_batch: int
    start_batch: int | None  # where --batch-ramp started (None: the run did not ramp)
    steps: int
    epochs: int
    launcher: str | None
    backend: str | None
    device: str | None
    wall_seconds: float | None
    samples_per_sec: float | None
    metrics: dict[str, float | None] = field(default_factory=dict)  # the task's metrics and best_<headline>
    noise: dict[str, float | None] = field(default_factory=dict)  # metrics.json's noise_scale (NOISE_FIELDS)


def run_file(run_dir: Path, name: str) -> _Fields:
    """A run's JSON file ``name`` (config.json, metrics.json), read as a user's file: one line if it is missing,
    not a regular file or not JSON."""
    path = run_dir / name
    missing = f"{shown(path)} does not exist: is {shown(run_dir)} a finished run's directory (train.py --output-dir)?"
    return _Fields(read_user_json(path, what=f"the run's {name}", nan_ok=True, missing=missing), path)


def load_run(run_dir: Path) -> Run:
    """The run in ``run_dir``, from its config.json and metrics.json, each field checked (one line otherwise)."""
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    config, metrics = run_file(run_dir, "config.json"), run_file(run_dir, "metrics.json")
    arch = config.get("model.arch", "text", required=True)
    try:
        task = create_task(ModelConfig(arch=arch))
    except UserError as exc:
        raise UserError(f"{shown(config.path)}: model.arch {shown(arch)} is not a model this scale-ocr knows "
                        f"({exc})") from None
    headline = task.metric_names[0]
    return Run(
        run_dir=run_dir, arch=arch, headline=headline, percent=headline in task.percent_metrics,
        metric_names=tuple(task.metric_names), percent_metrics=frozenset(task.percent_metrics),
        task=config.get("task", "text"), num_params=config.get("num_params", "number"),
        argv=config.get("argv", "texts"),
        world_size=metrics.get("world_size", "count", required=True),
        output_dir=config.get("output.output_dir", "text"), wandb_mode=config.get("logging.wandb_mode", "text"),
        lr_line=config.get("lr_plan.line", "text"), num_val=config.get("dataset.num_val", "count"),
        strategy=metrics.get("strategy", "text", required=True),
        global_batch=metrics.get("global_batch", "count", required=True),
        start_batch=metrics.get("batch_ramp.start_batch", "count"),
        steps=metrics.get("steps", "count", required=True), epochs=metrics.get("epochs", "count", required=True),
        launcher=metrics.get("launcher", "text"), backend=metrics.get("backend", "text"),
        device=metrics.get("device", "text"), wall_seconds=metrics.get("wall_seconds", "number"),
        samples_per_sec=metrics.get("samples_per_sec", "number"),
        metrics={k: metrics.get(k, "number") for k in (*task.metric_names, f"best_{headline}")},
        noise={k: metrics.get(f"noise_scale.{k}", "number") for k in NOISE_FIELDS},
    )


@dataclass
class Curves:
    """The plotted series of metrics.jsonl: steps and values, compact (a million records take a few MB)."""

    series: dict[str, tuple[array, array]]

    def points(self, key: str) -> tuple[list[int], list[float]]:
        steps, values = self.series.get(key, (array("q"), array("d")))
        return list(steps), list(values)


def read_curves(path: Path, keys: tuple[str, ...]) -> Curves:
    """``keys``' finite values against their ``step`` from ``metrics.jsonl``, streamed a line at a time; a line
    that is not such a record (a torn last line from a killed run, another logger's) is left out. No file: none."""
    series = {k: (array("q"), array("d")) for k in keys}
    needles = [json.dumps(k).encode() for k in keys]
    try:
        os.lstat(path)
    except FileNotFoundError:
        return Curves(series)
    with open_user_file(path, what="the run's metrics.jsonl", limit=CURVES_LIMIT) as f:
        while line := f.readline(CURVE_LINE_LIMIT):
            if not line.endswith(b"\n") and len(line) == CURVE_LINE_LIMIT:
                while (rest := f.readline(CURVE_LINE_LIMIT)) and not rest.endswith(b"\n"):
                    pass  # the rest of an over-long line
                continue
            if any(n in line for n in needles):
                _add_record(line, series)
    return Curves(series)


def _add_record(line: bytes, series: dict[str, tuple[array, array]]) -> None:
    try:
        row = json.loads(line)
    except JSON_ERRORS:
        return
    if not isinstance(row, dict):
        return
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < STEP_LIMIT:
        return
    for key, (steps, values) in series.items():
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                continue
            if abs(value) <= VALUE_LIMIT:  # NaN and infinities too
                steps.append(step)
                values.append(value)


def _figure(curves: Curves, run: Run, title: str):
    """Training and validation loss, and the headline validation metric, against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, metric_ax, noise_ax) = plt.subplots(1, 3, figsize=(14, 3.8))
    for key, label in (("train/loss", "train loss"), ("val/val_loss", "validation loss")):
        steps, values = curves.points(key)
        if steps:
            loss_ax.plot(steps, values, label=label, marker="o" if key.startswith("val") else None, markersize=3)
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("loss")
    if any(v > 0 for v in curves.points("train/loss")[1] + curves.points("val/val_loss")[1]):
        loss_ax.set_yscale("log")
    loss_ax.legend()
    steps, values = curves.points(f"val/{run.headline}")
    scale = 100.0 if run.percent else 1.0
    metric_ax.plot(steps, [v * scale for v in values], marker="o", markersize=3, color="tab:green")
    metric_ax.set_xlabel("optimizer step")
    metric_ax.set_ylabel(f"validation {run.headline}" + (" (%)" if run.percent else ""))
    if run.percent:
        metric_ax.set_ylim(0, 100)
    metric_ax.grid(alpha=0.3)
    _noise_panel(noise_ax, curves, run)
    fig.suptitle(title, fontsize=10, parse_math=False)  # a run's strings are shown as they are, never as TeX
    fig.tight_layout()
    return fig, plt


def _noise_panel(ax, curves: Curves, run: Run) -> None:
    """B_simple against the step, beside the run's global batch: where the curve is above the line, a larger
    batch would still have paid."""
    steps, values = curves.points("noise/b_simple")
    if steps:
        ax.plot(steps, values, color="tab:purple", label="noise scale B_simple")
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "noise scale not measured", ha="center", va="center", transform=ax.transAxes)
    batch_steps, batches = curves.points("train/global_batch")  # logged where --batch-ramp grew it
    if batch_steps:
        ax.step(batch_steps, batches, where="post", color="grey", linestyle="--",
                label=f"global batch {run.start_batch or batches[0]}-{run.global_batch} (--batch-ramp)")
    else:
        ax.axhline(run.global_batch, color="grey", linestyle="--", label=f"global batch {run.global_batch}")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("samples")
    ax.legend()
    ax.grid(alpha=0.3)


def plot_curves(curves: Curves, run: Run, out: Path) -> Path:
    """The curves' PNG, written whole (a temp file renamed over ``out``), never through a link."""
    title = (f"{printable(run.arch, 60)} - {printable(run.strategy, 60)} x {run.world_size}, global batch "
             f"{run.global_batch}, {run.steps} steps")
    fig, plt = _figure(curves, run, title)
    return write_png(fig, plt, out, "the curves' plot", "the run's files are untouched")


def write_png(fig, plt, out: Path, what: str, kept: str) -> Path:
    """``fig`` as a PNG written whole at ``out`` (a temp file renamed over it, never through a link), then closed;
    a folder this user cannot write is one line naming --plot."""
    try:
        with atomic_file(out, what=what, kept=kept) as f:
            fig.savefig(f, format="png", dpi=110)
    except OSError as exc:
        raise UserError(f"cannot write {what} {shown(out)} ({os.strerror(exc.errno or 0)}); pick a folder this user "
                        "can write with --plot PATH") from None
    finally:
        plt.close(fig)
    return out


def wandb_runs(run_dir: Path) -> list[Path]:
    """W&B's offline run folders the run wrote (newest last): ``RUN_DIR/wandb/offline-run-*``, each a folder of its
    own (a link there, or a ``wandb`` that is a link, is not one)."""
    folder = run_dir / "wandb"
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return []
        entries = [(e.stat(follow_symlinks=False).st_mtime, e.name) for e in os.scandir(folder)
                   if e.name.startswith("offline-run-") and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    return [folder / name for _, name in sorted(entries)]


def same_job(run: Run, strategy: str) -> str:
    """The command that trains this run's job under ``strategy``, into a new output directory."""
    if not run.argv:
        return f"the same flags with --strategy {strategy} (this run's config.json has no command line)"
    flags = _replace(run.argv, "--strategy", strategy)
    out = str(Path(run.output_dir or str(run.run_dir))) + f"-{strategy}"
    flags = _replace(flags, "--output-dir", out)
    return shlex.join(["torchrun", "--nproc_per_node", str(run.world_size), "scale_ocr/train.py", *flags])


def _replace(argv: list[str], flag: str, value: str) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == flag:
            skip = True
            continue
        if arg.startswith(flag + "="):
            continue
        out.append(arg)
    return [*out, flag, value]


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "n/a"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def _text(value: str | None) -> str:
    return "None" if value is None else printable(value, TEXT_LIMIT)


def _lines(run: Run, png: Path) -> list[str]:
    def fmt(name: str, v: float | None, digits: int = 1) -> str:
        return "n/a" if v is None else f"{v:.{digits}%}" if name in run.percent_metrics else f"{v:.4f}"

    runs = wandb_runs(run.run_dir)
    wandb = (f"{runs[-1]}  (upload: wandb sync {shlex.quote(str(runs[-1]))})" if runs
             else f"none written here (--wandb-mode {_text(run.wandb_mode)})")
    sps = run.samples_per_sec
    h, m = run.headline, run.metrics
    every = " ".join(f"{k}={fmt(k, m.get(k), 2)}" for k in run.metric_names)
    return [
        f"scale-ocr summary of {run.run_dir}",
        f"  model        {_text(run.arch)} ({_text(run.task)}), {(run.num_params or 0) / 1e6:.2f}M parameters",
        f"  strategy     {_text(run.strategy)}, world size {run.world_size} ({_text(run.launcher)}, "
        f"{_text(run.backend)}, {_text(run.device)}), global batch {_batch(run)}",
        f"  trained      {run.steps} steps, {run.epochs} epochs in {_duration(run.wall_seconds)}"
        f" ({'n/a' if sps is None or not math.isfinite(sps) else f'{sps:.0f}'} samples/s)"
        + (f"; {_text(run.lr_line)}" if run.lr_line else ""),
        f"  accuracy     {h} {fmt(h, m.get(h))} at the end (best {fmt(h, m.get(f'best_{h}'))}) on {run.num_val} "
        f"held-out samples; {every}",
        _noise_line(run),
        f"  run dir      {run.run_dir}  (config.json, metrics.json, metrics.jsonl, checkpoints)",
        f"  W&B          {wandb}",
        f"  curves       {png}",
        *[f"  under {s:<7}{same_job(run, s)}" for s in OTHER_STRATEGIES],
    ]


def _batch(run: Run) -> str:
    if run.start_batch is None or run.start_batch == run.global_batch:
        return str(run.global_batch)
    return f"{run.start_batch} grown to {run.global_batch} (--batch-ramp auto)"


def _noise_line(run: Run) -> str:
    n = run.noise
    if n.get("readings") is None:
        return "  noise scale  not measured (--noise-every 0, or one process with --grad-accum 1)"
    if n.get("b_simple") is None:
        return (f"  noise scale  no estimate ({n['readings']:.0f} readings: the averaged gradient was not above its "
                "noise)")
    how = (f"micro-batch {n.get('b_small') or 0:.0f} against global {n.get('b_big') or 0:.0f}, "
           f"{n['readings']:.0f} readings every {n.get('every') or 0:.0f} steps, smoothing {n.get('smoothing') or 0:g}"
           + (f", {n['clipped']:.0f} spiky bounded" if n.get("clipped") else ""))
    return (f"  noise scale  B_simple {n['b_simple']:.0f} at the end ({how}): past a global batch of about that, a "
            f"larger one buys little per sample (this run's: {run.global_batch})")


def summarize(run_dir: Path, plot: Path | None) -> list[str]:
    """The summary's lines; writes the curves' PNG to ``plot`` (default ``RUN_DIR/curves.png``). Every run file is
    read and checked before the plot is written."""
    run = load_run(run_dir)
    png = check_output(plot if plot is not None else run_dir / "curves.png", "--plot")
    keys = ("train/loss", "val/val_loss", f"val/{run.headline}", "noise/b_simple", "train/global_batch")
    curves = read_curves(run_dir / "metrics.jsonl", keys)
    plot_curves(curves, run, png)
    return _lines(run, png)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scale-ocr summary", description="One screen on a finished run: "
                                     "strategy, world size, global batch, time and accuracy, where its files and "
                                     "W&B offline run are, and a PNG of its loss and accuracy curves.")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run's --output-dir")
    parser.add_argument("--plot", type=Path, default=None, help="where the curves' PNG goes "
                        "(default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    on_interrupt("nothing was changed in the run directory (the plot is written whole or not at all)")
    for line in summarize(args.run_dir, args.plot):
        say(printable(line))  # a newline inside a value (a W&B folder's name, an argument) stays on its line
    return 0
