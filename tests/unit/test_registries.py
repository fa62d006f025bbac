"""The model and task registries hold together: every registered task is complete, and every registered model's
task is registered and gives it a batch, so a new model or task is tested without anyone editing a list
(docs/extending.md names these tests)."""

from __future__ import annotations

import inspect

import pytest
import torch

from scale_ocr.config import ModelConfig
from scale_ocr.models import list_models
from scale_ocr.tasks import create_task, registry, task_class


@pytest.mark.parametrize("name", sorted(registry._TASKS))
def test_a_registered_task_leaves_no_abstract_method(name):
    cls = registry._TASKS[name]
    assert not inspect.isabstract(cls), f"task {name!r} leaves abstract: {sorted(cls.__abstractmethods__)}"


@pytest.mark.parametrize("arch", list_models())
def test_a_registered_models_task_is_registered_and_gives_it_a_batch(arch):
    assert task_class(arch).name in registry._TASKS
    inputs = create_task(ModelConfig(arch=arch)).dummy_inputs(2)
    assert inputs and all(isinstance(t, torch.Tensor) and t.shape[0] == 2 for t in inputs), arch
