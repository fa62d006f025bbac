"""What a run records about itself: the resolved config file and the closing summary line."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from scale_ocr.config import RunConfig
from scale_ocr.disk import DiskFault, raise_or_defer, write_atomic
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.models.init import full_numel
from scale_ocr.run.breakdown import compact


def library_versions() -> dict[str, str | None]:
    """Versions of the engines a run may use (None when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("torch", "torchvision", "deepspeed", "fairscale", "wandb", "einops"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def device_names(dist: DistInfo) -> list[str]:
    """Every rank's device, e.g. ``["NVIDIA H200 (cuda:0)", ...]`` (a collective)."""
    if dist.device.type == "cuda":
        name = f"{torch.cuda.get_device_name(dist.device)} ({dist.device})"
    else:
        name = f"{platform.processor() or platform.machine()} cpu x{torch.get_num_threads()} threads"
    names: list[Any] = [None] * dist.world_size
    if tdist.is_initialized() and dist.world_size > 1:
        tdist.all_gather_object(names, name)
    else:
        names = [name]
    return names


def describe_run(cfg: RunConfig, plan, strategy, model: nn.Module, data, task) -> dict[str, Any]:
    """The resolved config plus what was derived at start-up (``plan``: a :class:`~scale_ocr.run.plan.RunPlan`);
    every rank calls it (it gathers)."""
    dist = strategy.dist
    return {
        **cfg.to_dict(),  # model, data, optim, train, strategy, output, logging sections
        "world_size": dist.world_size,
        "global_batch": plan.global_batch,
        "launcher": dist.launcher,
        "backend": dist.backend,
        "devices": device_names(dist),
        "num_params": sum(full_numel(p) for p in model.parameters()),
        **task.describe(),  # task, and e.g. the vocabulary
        "dataset": {"num_train": data.num_train, "num_val": data.num_val, "skipped_samples": data.skipped,
                    "train_labels_sha256": data.labels_sha256, **({"sources": data.sources} if data.sources else {})},
        "ds_config": strategy.engine_config(),
        "versions": library_versions(),
        "host": {"python": platform.python_version(), "machine": platform.machine(),
                 "cuda": torch.version.cuda if torch.cuda.is_available() else None},
    }


def write_run_config(run_dir: Path, doc: dict[str, Any]) -> None:
    """Write ``config.json`` in the run directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        write_atomic(run_dir / "config.json", json.dumps(doc, indent=2, default=str) + "\n", what="the run's config",
                     kept="nothing was trained yet")
    except DiskFault as fault:
        raise_or_defer(fault)  # the other ranks end with this one, at their first step's agreement


def run_summary_line(s: dict[str, Any], run_dir: Path, task) -> str:
    """One line for stdout with the figures people compare (n/a where a value was not measured)."""
    def fmt(key: str, spec: str, scale: float = 1.0) -> str:
        v = s.get(key)
        return "n/a" if v is None else format(v * scale, spec)

    parts = compact(s.get("time_breakdown"))  # where a timed step's time went
    breakdown = f" time=[{parts}]" if parts else ""
    drawn = s.get("data_drawn")  # a mix's samples from each source
    breakdown += f" drawn=[{', '.join(f'{k}: {v}' for k, v in drawn.items())}]" if drawn else ""

    return (
        f"scale-ocr: strategy={s['strategy']} world_size={s['world_size']} global_batch={s['global_batch']} "
        f"steps={s['steps']} train_loss={fmt('train_loss', '.4f')} val_loss={fmt('val_loss', '.4f')} "
        f"{task.format_metrics(s)} "
        f"samples/s={fmt('samples_per_sec', '.1f')} peak_mem={fmt('peak_memory_bytes', '.0f', 2**-20)}MiB "
        f"wall={fmt('wall_seconds', '.1f')}s{breakdown} -> {run_dir / 'metrics.json'}"
    )
