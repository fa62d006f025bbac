"""Initial weights that depend only on (seed, parameter name): the same whole, sharded or partitioned.

A model's ``init_param(name, tensor, generator)`` rule draws each whole parameter from a generator seeded by both,
one at a time, so a model built on meta (FSDP2) or inside ``zero.Init`` (ZeRO-3) ends with exactly the weights of
one built whole, and no rank holds more than one whole parameter beyond its shards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from scale_ocr.models.checkpointing import bare_name
from scale_ocr.models.registry import capable


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's real shape, also for ZeRO-3's empty stand-ins of partitioned parameters (``ds_shape``)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def full_numel(param: torch.Tensor) -> int:
    """A parameter's element count, also for ZeRO-3's partitioned ones (DTensors count their global size)."""
    return int(getattr(param, "ds_numel", param.numel()))


def has_init_rule(model: nn.Module) -> bool:
    """Whether ``model`` says how to initialise each parameter by name (and so can be built on meta)."""
    return capable(model, "init_param") and not any(True for _ in model.buffers())


@dataclass(frozen=True)
class ModelFactory:
    """How to build a run's model, handed to a strategy, which never learns whose model it is (a task's).

    ``create`` builds the bare architecture (an engine may call it inside ``zero.Init``); ``apply_options`` wraps it
    as the run asks without renaming parameters; ``load_weights`` (``--init-from``) fills a whole built model before
    an engine shards it and returns a line saying so.
    """

    create: Callable[[], nn.Module]
    apply_options: Callable[[nn.Module], nn.Module] = lambda model: model
    load_weights: Callable[[nn.Module], str] | None = None

    def build(self) -> nn.Module:
        """The model with its options, built whole where the current device context puts it."""
        return self.apply_options(self.create())

    def meta_with_rule(self) -> nn.Module | None:
        """The model built on the meta device when it has a per-parameter init rule (to be materialised anywhere and
        filled by :func:`init_weights`); None when it must be built whole (global RNG, or ``--init-from``)."""
        if self.load_weights is not None:
            return None
        with torch.device("meta"):
            model = self.build()
        return model if has_init_rule(model) else None


def param_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one parameter, stable across processes and Python versions."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # Every rank drew the same whole tensor, so each slices its own shard without communicating.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int,
                 gathered: Callable[[nn.Parameter], AbstractContextManager] = lambda p: nullcontext()) -> None:
    """Set every parameter of ``model`` from its ``init_param`` rule and ``(seed, name)``.

    Names are the bare model's (without activation-checkpointing wrappers), so the result does not depend on
    how the model was wrapped either. ``gathered(param)`` makes one partitioned parameter whole while it is
    written (ZeRO-3's ``GatheredParameters``); DTensor shards need none.
    """
    for name, param in model.named_parameters():
        name = bare_name(name)
        with gathered(param):
            full = torch.empty(param.shape, dtype=torch.float32)
            model.init_param(name, full, torch.Generator().manual_seed(param_seed(seed, name)))
            _assign(param, full.to(device=param.device, dtype=param.dtype))
