"""Activation checkpointing (``--activation-checkpointing``): trade compute for memory (docs/models.md).

Each of a model's ``checkpoint_units()`` is replaced in its parent by torch's non-reentrant ``checkpoint_wrapper``
(parameter names kept) as the model is built, before any strategy wraps it, so FSDP2 shards the wrapped units.
A recomputed forward would update BatchNorm's running statistics twice: during it their momentum is zero and the
batch counter is put back, so a checkpointed run's buffers equal the plain run's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

from scale_ocr.errors import UserError
from scale_ocr.models.registry import capable


@contextmanager
def _running_stats_frozen(module: nn.Module) -> Iterator[None]:
    norms = [m for m in module.modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats]
    saved = [(m.momentum, m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, count) in zip(norms, saved, strict=True):
            m.momentum = momentum
            m.num_batches_tracked.copy_(count)


def _checkpoint(module: nn.Module, *args, **kwargs):
    # The module is the one running (a DataParallel replica, say), not the one wrapped at build time.
    return checkpoint(module, *args, use_reentrant=False,
                      context_fn=lambda: (nullcontext(), _running_stats_frozen(module)), **kwargs)


def bare_name(name: str) -> str:
    """A parameter's name without checkpoint wrappers: the name checkpoints use under every strategy
    (torch's own state-dict helpers strip the wrapper; engines that walk ``named_parameters`` call this)."""
    return name.replace(_CHECKPOINT_PREFIX, "")


def apply_activation_checkpointing(model: nn.Module, arch: str) -> int:
    """Wrap each of ``model.checkpoint_units()`` in place; returns how many were wrapped."""
    if not capable(model, "checkpoint_units"):
        raise UserError(f"--activation-checkpointing: {arch} does not say where to checkpoint (no "
                        "checkpoint_units()); train it without the flag")
    parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    units = model.checkpoint_units()
    for unit in units:
        parent, name = parents[id(unit)]
        setattr(parent, name, checkpoint_wrapper(unit, CheckpointImpl.NO_REENTRANT, checkpoint_fn=_checkpoint))
    return len(units)
