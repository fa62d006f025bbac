"""The task registry, a leaf: task classes by name, and the task of a model (its registry entry names it).

It imports no task: task modules register themselves here (``@register_task``), and ``scale_ocr.tasks`` imports
them all, so asking the package for a task finds every one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scale_ocr.errors import UserError
from scale_ocr.models.factory import model_entry

if TYPE_CHECKING:  # annotations only: the base class imports the config and models, this module does not
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks.base import Task

_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    if cls.name in _TASKS:
        raise ValueError(f"task {cls.name!r} is registered twice")
    _TASKS[cls.name] = cls
    return cls


def task_name(arch: str) -> str:
    """The task a registered model belongs to (its registry entry's ``task``)."""
    return model_entry(arch).task


def task_class(arch: str) -> type[Task]:
    name = task_name(arch)
    if name not in _TASKS:
        raise ValueError(f"{arch}'s task {name!r} is not registered; import scale_ocr.tasks, which loads every task")
    return _TASKS[name]


def create_task(model_cfg: ModelConfig) -> Task:
    """The task of ``model_cfg.arch``."""
    return task_class(model_cfg.arch)(model_cfg)


def task_from_identity(identity: dict[str, Any]) -> Task:
    """The task of a checkpoint or export, from its recorded identity (``arch`` and the task's own keys)."""
    if "arch" not in identity:
        raise UserError("the model file records no architecture (arch); export it with `scale-ocr export`")
    return task_class(identity["arch"]).from_identity(identity)
