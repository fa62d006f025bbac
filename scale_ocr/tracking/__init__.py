"""Experiment tracking: JSONL always, W&B on top; rank 0 logs, every other rank gets a null logger."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scale_ocr.config import LoggingConfig
from scale_ocr.tracking.jsonl import JsonlLogger
from scale_ocr.tracking.wandb_logger import WandbLogger, open_wandb


class NullLogger:
    """Accepts everything, writes nothing (ranks other than 0)."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        pass

    def log_examples(self, examples, step: int) -> None:
        pass

    def summary(self, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

    def records(self) -> int:
        return 0


class FanOut:
    """Sends every call to several loggers; W&B trouble never stops the JSONL stream."""

    def __init__(self, *loggers) -> None:
        self.loggers = [lg for lg in loggers if lg is not None]

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for lg in self.loggers:
            lg.log(metrics, step)

    def log_examples(self, examples, step: int) -> None:
        for lg in self.loggers:
            lg.log_examples(examples, step)

    def summary(self, metrics: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.summary(metrics)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()

    def records(self) -> int:
        """Records in metrics.jsonl (the stream a resumed run trims back to its checkpoint)."""
        return max((lg.records() for lg in self.loggers if hasattr(lg, "records")), default=0)


def build_logger(cfg: LoggingConfig, is_main: bool, run_dir: Path, run_config: dict[str, Any],
                 resume: bool = False, keep_records: int | None = None):
    """JSONL plus W&B on global rank 0 (``keep_records``: :class:`JsonlLogger`'s ``keep``); a :class:`NullLogger`
    on every other rank."""
    if not is_main:
        return NullLogger()
    jsonl = JsonlLogger(run_dir, append=resume, keep=keep_records)
    return FanOut(jsonl, open_wandb(cfg, run_dir, run_config, resume=resume))


__all__ = ["FanOut", "JsonlLogger", "NullLogger", "WandbLogger", "build_logger", "open_wandb"]
