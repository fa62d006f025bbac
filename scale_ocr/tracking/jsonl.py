"""Metrics to ``metrics.jsonl`` (every logged step) and ``metrics.json`` (the summary), whatever W&B does."""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from scale_ocr.disk import (
    GiB,
    check_entry,
    disk_fault,
    open_own,
    raise_or_defer,
    read_user_text,
    take_pending,
    write_atomic,
)

METRICS_LIMIT = 8 * GiB  # a metrics.jsonl: a record a step, about 500 bytes each


def clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlLogger:
    """Appends one JSON object per logged step; the summary is replaced atomically.

    ``append`` keeps a resumed run's earlier records, only the first ``keep`` of them: those its checkpoint accounts
    for (later ones belong to steps trained again, and would appear twice).
    """

    def __init__(self, run_dir: Path, append: bool = False, keep: int | None = None) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        path = self.path = run_dir / "metrics.jsonl"
        check_entry(path)  # a link or another user's file is refused before it is read or written
        lines = (read_user_text(path, what="the run's metrics", limit=METRICS_LIMIT).splitlines(keepends=True)
                 if append and path.is_file() else [])
        if keep is not None and len(lines) > keep:
            lines = lines[:keep]
            # atomic: a crash here leaves the old file, never a truncated one
            write_atomic(path, "".join(lines), what="metrics", kept="the previous metrics.jsonl is kept")
        self.count = len(lines)
        # Opened once, appended per step with one write each: never through a link, truncated only once known ours.
        self.fd: int | None = open_own(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        if not append:
            os.ftruncate(self.fd, 0)

    def records(self) -> int:
        """Records in metrics.jsonl so far (a checkpoint stores it, see ``keep``)."""
        return self.count

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.fd is None:  # a disk fault stopped the stream; the run ends at the ranks' next agreement
            return
        record = {"step": step, "time": round(time.time(), 3), **{k: clean(v) for k, v in metrics.items()}}
        data = (json.dumps(record) + "\n").encode("utf-8")
        end = os.fstat(self.fd).st_size
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as exc:
            fault = disk_fault(exc, self.path, "metrics", f"metrics.jsonl up to step {step} (before this record) "
                               "and every checkpoint written are kept", len(data))
            if fault is None:
                raise
            with suppress(OSError):
                os.ftruncate(self.fd, end)  # no half record: every line stays JSON
            self.close()
            raise_or_defer(fault)
            return
        self.count += 1

    def log_examples(self, examples: list[dict[str, Any]], step: int) -> None:
        """Each example row without its images (W&B keeps those)."""
        rows = [{k: v for k, v in row.items() if not hasattr(v, "shape")} for row in examples]
        self.log({"val/examples": rows}, step)

    def summary(self, metrics: dict[str, Any]) -> None:
        held = take_pending()  # a fault held for an agreement the run never reached (its last steps)
        if held is not None:
            raise held
        text = json.dumps({k: clean(v) for k, v in metrics.items()}, indent=2)
        write_atomic(self.run_dir / "metrics.json", text + "\n", what="the run summary",
                     kept="metrics.jsonl and every checkpoint written are kept")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
