"""Metric sinks. Rank 0 writes; every other rank gets a null logger so the loop has no rank checks."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlLogger:
    """Appends one JSON object per logged step to ``metrics.jsonl``; the summary goes to ``metrics.json``."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.file = (run_dir / "metrics.jsonl").open("w", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        record = {"step": step, "time": round(time.time(), 3), **{k: _clean(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def summary(self, metrics: dict[str, Any]) -> None:
        text = json.dumps({k: _clean(v) for k, v in metrics.items()}, indent=2)
        tmp = self.run_dir / "metrics.json.tmp"
        tmp.write_text(text + "\n", encoding="utf-8")
        tmp.replace(self.run_dir / "metrics.json")

    def close(self) -> None:
        self.file.close()


class NullLogger:
    """Accepts everything, writes nothing (ranks other than 0)."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def summary(self, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def build_logger(is_main: bool, run_dir: Path) -> JsonlLogger | NullLogger:
    return JsonlLogger(run_dir) if is_main else NullLogger()
