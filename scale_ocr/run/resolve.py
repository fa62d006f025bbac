"""Resolve a run's config once, above the registries: the defaults that depend on the model.

:class:`~scale_ocr.config.RunConfig` is the ground floor and knows no model or task; a field left None there
means "the model's" or "the task's". :func:`resolve` fills those in from the model's registry entry and its
task, checks what only they can judge, and returns the config that ``config.json`` and W&B record.
"""

from __future__ import annotations

import dataclasses

from scale_ocr.config import DEFAULT_LR_SCALING, ModelConfig, OptimConfig, RunConfig
from scale_ocr.data.degrade import parse as degradations
from scale_ocr.errors import UserError
from scale_ocr.models.factory import recommended_lr, reference_batch
from scale_ocr.tasks import task_class
from scale_ocr.tasks.base import Task, check_size_overrides


def resolve(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the task's and model's defaults filled in (input size, page scale, synthetic sample counts,
    augmentation, schedule, learning rate), after the checks that need the registries; a UserError names what is
    wrong."""
    check_size_overrides(cfg.model)
    task = task_class(cfg.model.arch)
    train, val = task.default_samples
    data, optim = cfg.data, cfg.optim
    page_scale, max_page_side = task.resolve_page_scale(cfg)
    resolved = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, input_size=input_size(cfg.model, task), page_scale=page_scale,
                                  max_page_side=max_page_side),
        data=dataclasses.replace(data, train_samples=data.train_samples or train, val_samples=data.val_samples or val,
                                 augment=task.default_augment if data.augment is None else data.augment),
        optim=dataclasses.replace(resolve_rate(optim, cfg.model.arch), sched=optim.sched or task.default_sched),
    )
    task.check_config(resolved)  # e.g. synthetic words that CTC cannot align
    degradations(resolved.data.degrade, task.moves_text)  # named, each with a probability, that the task's images take
    return resolved


def input_size(model: ModelConfig, task: type[Task]) -> tuple[int, int]:
    """The run's input size: ``--input-size`` or the task's; with ``--max-width``, its height and the widest input
    (a model reading crops at their own width is built for the widest: a ViTSTR's position embeddings cover it)."""
    size = tuple(model.input_size or task.default_input_size)
    if model.max_width is None:
        return size
    if not task.reads_own_width:
        raise UserError(f"--max-width: {model.arch} reads its inputs at one size (--input-size); drop --max-width, or "
                        "pick a model that reads crops at their own width (a crnn_* or vitstr_* recognizer)")
    if model.max_width < size[0]:
        raise UserError(f"--max-width {model.max_width} is narrower than the input height {size[0]}; crops are read "
                        f"from the height up to --max-width, so give at least {size[0]}")
    return size[0], model.max_width


def resolve_rate(optim: OptimConfig, arch: str) -> OptimConfig:
    """The rate, the batch it is stated at and the rule that scales it, all filled in.

    No ``--lr``: the model's recommended rate at its reference batch, scaled by ``--lr-scaling`` (default
    :data:`~scale_ocr.config.DEFAULT_LR_SCALING`). A ``--lr``: the rate at this run's global batch, used as given
    (rule ``none``), unless ``--lr-reference-batch`` names the batch it was tuned at. The global batch itself is
    known only once the ranks are (:func:`scale_ocr.optim.plan_lr` applies the rule); this config, kept in
    ``config.json``, stays the rate *before* scaling, so the same file scales again at another world size.
    """
    rule, ref = optim.lr_scaling, optim.lr_reference_batch
    if optim.lr is None:
        if ref is not None:
            raise UserError(f"--lr-reference-batch {ref} names the batch a --lr was tuned at, and no --lr is given; "
                            f"give --lr too, or drop it: the model's rate is stated at its own batch "
                            f"({reference_batch(arch)}, `scale-ocr models --params`)")
        rule = rule or DEFAULT_LR_SCALING  # under none the model's rate is used as it is, at any batch
        return dataclasses.replace(optim, lr=recommended_lr(arch), lr_scaling=rule,
                                   lr_reference_batch=reference_batch(arch) if rule != "none" else None)
    if ref is None and rule not in (None, "none"):
        raise UserError(f"--lr-scaling {rule} with --lr {optim.lr:g}: say which global batch that rate was tuned at "
                        f"with --lr-reference-batch R (the model's rate is stated at {reference_batch(arch)}), or "
                        f"drop --lr-scaling to use --lr as given at this run's batch")
    scaled = rule or DEFAULT_LR_SCALING  # the rule a --lr-reference-batch scales by
    if ref is not None and scaled == "none":
        said = "--lr-scaling none" if rule else f"the default --lr-scaling ({DEFAULT_LR_SCALING})"
        raise UserError(f"--lr-reference-batch {ref} with {said}: none uses --lr as given, so the reference batch "
                        f"would change nothing; add --lr-scaling linear or sqrt to scale --lr from it, or drop it")
    return dataclasses.replace(optim, lr_scaling=scaled if ref is not None else "none")
