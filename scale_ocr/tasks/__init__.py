"""Tasks: what differs between recognising words and detecting them, behind one interface.

``create_task(model_cfg)`` builds the task of a model. The registry is a leaf (:mod:`scale_ocr.tasks.registry`);
this package face imports every task module, which registers itself there.
"""

from __future__ import annotations

# Imported for their registration (each module's @register_task), after the registry they register in.
from scale_ocr.tasks import detection, doctr_detection, doctr_recognition, recognition  # noqa: E402, F401, I001
from scale_ocr.tasks.base import EvalResult, Task
from scale_ocr.tasks.registry import create_task, register_task, task_class, task_from_identity, task_name

__all__ = ["EvalResult", "Task", "create_task", "register_task", "task_class", "task_from_identity", "task_name"]
