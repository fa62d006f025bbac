"""Resolve a run's config once, above the registries: the defaults that depend on the model.

:class:`~scale_ocr.config.RunConfig` is the ground floor and knows no model or task; a field left None there
means "the model's" or "the task's". :func:`resolve` fills those in from the model's registry entry and its
task, checks what only they can judge, and returns the config that ``config.json`` and W&B record.
"""

from __future__ import annotations

import dataclasses

from scale_ocr.config import RunConfig
from scale_ocr.models.factory import recommended_lr
from scale_ocr.tasks import task_class
from scale_ocr.tasks.base import check_size_overrides


def resolve(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the task's and model's defaults filled in (input size, page scale, synthetic sample counts,
    augmentation, schedule, learning rate), after the checks that need the registries; a UserError names what is wrong."""
    check_size_overrides(cfg.model)
    task = task_class(cfg.model.arch)
    train, val = task.default_samples
    data, optim = cfg.data, cfg.optim
    page_scale, max_page_side = task.resolve_page_scale(cfg)
    resolved = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, input_size=tuple(cfg.model.input_size or task.default_input_size),
                                  page_scale=page_scale, max_page_side=max_page_side),
        data=dataclasses.replace(data, train_samples=data.train_samples or train, val_samples=data.val_samples or val,
                                 augment=task.default_augment if data.augment is None else data.augment),
        optim=dataclasses.replace(optim, lr=optim.lr if optim.lr is not None else recommended_lr(cfg.model.arch),
                                  sched=optim.sched or task.default_sched),
    )
    task.check_config(resolved)  # e.g. synthetic words that CTC cannot align
    return resolved
