"""Metrics to ``metrics.jsonl`` (every logged step) and ``metrics.json`` (the summary), whatever W&B does."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlLogger:
    """Appends one JSON object per logged step; the summary is replaced atomically.

    Args:
        run_dir: the run directory.
        append: keep earlier records (a resumed run) instead of starting the file afresh.
        keep: with ``append``, keep only the first ``keep`` records: those the resumed checkpoint
            accounts for. Later ones belong to steps the resumed run trains again, and would
            otherwise appear twice.
    """

    def __init__(self, run_dir: Path, append: bool = False, keep: int | None = None) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / "metrics.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if append and path.is_file() else []
        if keep is not None and len(lines) > keep:
            lines = lines[:keep]
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(lines), encoding="utf-8")
            tmp.replace(path)  # atomic: a crash here leaves the old file, never a truncated one
        self.count = len(lines)
        self.file = path.open("a" if append else "w", encoding="utf-8")

    def records(self) -> int:
        """Records in metrics.jsonl so far (a checkpoint stores it, see ``keep``)."""
        return self.count

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, "time": round(time.time(), 3), **{k: clean(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.count += 1

    def log_examples(self, examples: list[dict[str, Any]], step: int) -> None:
        """Each example row without its images (W&B keeps those)."""
        rows = [{k: v for k, v in row.items() if not hasattr(v, "shape")} for row in examples]
        self.log({"val/examples": rows}, step)

    def summary(self, metrics: dict[str, Any]) -> None:
        text = json.dumps({k: clean(v) for k, v in metrics.items()}, indent=2)
        tmp = self.run_dir / "metrics.json.tmp"
        tmp.write_text(text + "\n", encoding="utf-8")
        tmp.replace(self.run_dir / "metrics.json")

    def close(self) -> None:
        self.file.close()
