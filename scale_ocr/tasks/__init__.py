"""Task registry: ``task_for(arch)`` names the task of a registered model and builds it."""

from __future__ import annotations

from typing import Any

from scale_ocr.config import ModelConfig
from scale_ocr.errors import UserError
from scale_ocr.tasks.base import EvalResult, Task

_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    if cls.name in _TASKS:
        raise ValueError(f"task {cls.name!r} is registered twice")
    _TASKS[cls.name] = cls
    return cls


def task_name(arch: str) -> str:
    """The task a registered model belongs to (its builder's ``task`` attribute; recognition by default)."""
    from scale_ocr.models import builder

    return getattr(builder(arch), "task", "recognition")


def task_class(arch: str) -> type[Task]:
    _load()
    return _TASKS[task_name(arch)]


def create_task(model_cfg: ModelConfig) -> Task:
    """The task of ``model_cfg.arch``."""
    return task_class(model_cfg.arch)(model_cfg)


def task_from_identity(identity: dict[str, Any]) -> Task:
    """The task of a checkpoint or export, from its recorded identity (``arch`` and the task's own keys)."""
    if "arch" not in identity:
        raise UserError("the model file records no architecture (arch); export it with `scale-ocr export`")
    return task_class(identity["arch"]).from_identity(identity)


def _load() -> None:
    # Task modules register themselves on import; imported here, lazily, so that `scale_ocr.tasks`
    # itself stays cheap and free of cycles with the models and data packages.
    import scale_ocr.tasks.detection  # noqa: F401
    import scale_ocr.tasks.doctr_detection  # noqa: F401
    import scale_ocr.tasks.doctr_recognition  # noqa: F401
    import scale_ocr.tasks.recognition  # noqa: F401


__all__ = ["EvalResult", "Task", "create_task", "register_task", "task_class", "task_from_identity", "task_name"]
