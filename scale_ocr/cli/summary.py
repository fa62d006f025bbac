"""``scale-ocr summary RUN_DIR``: one screen on a finished run, and a PNG of its curves.

It reads only what the run wrote (config.json, metrics.json, metrics.jsonl and W&B's offline folder), so it works
on any run directory, after the fact: what was trained, by which strategy on how many ranks, how fast and how
well, where its files are, how to upload its W&B run, and the same job under another strategy.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from pathlib import Path
from typing import Any

from scale_ocr.errors import UserError

OTHER_STRATEGIES = ("fsdp", "zero3")  # the "same job under ..." lines: sharded parameters, by torch and DeepSpeed


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: is {path.parent} a finished run's directory "
                        "(train.py --output-dir)?") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} is unreadable ({exc}); the run did not finish writing it") from None


def read_curves(path: Path) -> list[dict[str, Any]]:
    """The lines of ``metrics.jsonl`` (a torn last line, from a killed run, is left out)."""
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in rows if key in r and "step" in r and r[key] is not None]
    points = [(s, v) for s, v in points if math.isfinite(v)]
    return [s for s, _ in points], [v for _, v in points]


def plot_curves(rows: list[dict[str, Any]], headline: str, percent: bool, out: Path, title: str) -> Path:
    """Training and validation loss, and the headline validation metric, against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, metric_ax) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label in (("train/loss", "train loss"), ("val/val_loss", "validation loss")):
        steps, values = _series(rows, key)
        if steps:
            loss_ax.plot(steps, values, label=label, marker="o" if key.startswith("val") else None, markersize=3)
    loss_ax.set_xlabel("optimizer step")
    loss_ax.set_ylabel("loss")
    loss_ax.set_yscale("log")
    loss_ax.legend()
    steps, values = _series(rows, f"val/{headline}")
    scale = 100.0 if percent else 1.0
    metric_ax.plot(steps, [v * scale for v in values], marker="o", markersize=3, color="tab:green")
    metric_ax.set_xlabel("optimizer step")
    metric_ax.set_ylabel(f"validation {headline}" + (" (%)" if percent else ""))
    if percent:
        metric_ax.set_ylim(0, 100)
    metric_ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out


def wandb_runs(run_dir: Path) -> list[Path]:
    """W&B's offline run folders the run wrote (newest last): ``RUN_DIR/wandb/offline-run-*``."""
    return sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)


def same_job(config: dict[str, Any], strategy: str) -> str:
    """The command that trains this run's job under ``strategy``, into a new output directory."""
    argv = list(config.get("argv") or [])
    if not argv:
        return f"the same flags with --strategy {strategy} (this run's config.json has no command line)"
    flags = _replace(argv, "--strategy", strategy)
    out = str(Path(config["output"]["output_dir"])) + f"-{strategy}"
    flags = _replace(flags, "--output-dir", out)
    return shlex.join(["torchrun", "--nproc_per_node", str(config["world_size"]), "scale_ocr/train.py", *flags])


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
    if seconds is None:
        return "n/a"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def summarize(run_dir: Path, plot: Path | None) -> list[str]:
    """The summary's lines; writes the curves' PNG to ``plot`` (default ``RUN_DIR/curves.png``)."""
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    config, metrics = _read_json(run_dir / "config.json"), _read_json(run_dir / "metrics.json")
    arch = config["model"]["arch"]
    task = create_task(ModelConfig(arch=arch))
    headline = task.metric_names[0]
    percent = headline in task.percent_metrics
    value, best = metrics.get(headline), metrics.get(f"best_{headline}")

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1%}" if percent else f"{v:.4f}"

    rows = read_curves(run_dir / "metrics.jsonl")
    png = plot or run_dir / "curves.png"
    title = (f"{arch} - {metrics['strategy']} x {metrics['world_size']}, global batch {metrics['global_batch']}, "
             f"{metrics['steps']} steps")
    plot_curves(rows, headline, percent, png, title)
    runs = wandb_runs(run_dir)
    mode = config.get("logging", {}).get("wandb_mode")
    wandb = (f"{runs[-1]}  (upload: wandb sync {runs[-1]})" if runs
             else f"none written here (--wandb-mode {mode})")
    plan = (config.get("lr_plan") or {}).get("line", "")
    num_val = (config.get("dataset") or {}).get("num_val")
    return [
        f"scale-ocr summary of {run_dir}",
        f"  model        {arch} ({config.get('task')}), {config.get('num_params', 0) / 1e6:.2f}M parameters",
        f"  strategy     {metrics['strategy']}, world size {metrics['world_size']} ({metrics.get('launcher')}, "
        f"{metrics.get('backend')}, {metrics.get('device')}), global batch {metrics['global_batch']}",
        f"  trained      {metrics['steps']} steps, {metrics['epochs']} epochs in "
        f"{_duration(metrics.get('wall_seconds'))}"
        f" ({metrics.get('samples_per_sec') or 0:.0f} samples/s)" + (f"; {plan}" if plan else ""),
        f"  accuracy     {headline} {fmt(value)} at the end (best {fmt(best)}) on {num_val} held-out samples; "
        + task.format_metrics(metrics),
        f"  run dir      {run_dir}  (config.json, metrics.json, metrics.jsonl, checkpoints)",
        f"  W&B          {wandb}",
        f"  curves       {png}",
        *[f"  under {s:<7}{same_job(config, s)}" for s in OTHER_STRATEGIES],
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scale-ocr summary", description="One screen on a finished run: "
                                     "strategy, world size, global batch, time and accuracy, where its files and "
                                     "W&B offline run are, and a PNG of its loss and accuracy curves.")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run's --output-dir")
    parser.add_argument("--plot", type=Path, default=None, help="where the curves' PNG goes "
                        "(default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    for line in summarize(args.run_dir, args.plot):
        print(line)
    return 0
