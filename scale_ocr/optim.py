"""Optimizer specification and learning-rate schedules that work with every engine's optimizer."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from scale_ocr.config import OptimConfig
from scale_ocr.models.init import full_shape

_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: matrices and kernels get weight decay; biases and norm scales (1-D) do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if len(full_shape(p)) >= 2 else no_decay).append(p)  # a ZeRO-3 stand-in is 1-D and empty
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # an empty group would not survive a checkpoint's round trip


@dataclass(frozen=True)
class OptimizerSpec:
    """How to build the optimizer, for strategies that must build it themselves (after sharding,
    or as fairscale's OSS wrapper around a base class).

    Attributes:
        cls: the torch optimizer class.
        kwargs: its constructor arguments (``lr``, ``betas``, ``weight_decay``).
    """

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def groups(self, model: nn.Module) -> list[dict[str, Any]]:
        return param_groups(model, self.kwargs.get("weight_decay", 0.0))

    def options(self, groups: list[dict[str, Any]]) -> dict[str, Any]:
        """Constructor arguments for the parameters of ``groups``: ``kwargs``, plus ``fused=True`` where torch has a
        fused kernel for them. Torch's default on CPU is a Python loop over the parameters: measured on one core, an AdamW step over
        crnn_mobilenet_v3_small's 156 tensors took 11.9 ms that way, 11.2 ms with ``foreach`` and 3.0 ms fused."""
        kwargs = dict(self.kwargs)
        if ("fused" in inspect.signature(self.cls).parameters and not {"fused", "foreach"} & kwargs.keys()
                and fused_supported(p for g in groups for p in g["params"])):
            kwargs["fused"] = True
        return kwargs

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        groups = self.groups(model)
        return self.cls(groups, **self.options(groups))


def fused_supported(params: Iterable[torch.Tensor]) -> bool:
    """Every parameter is floating point and all are on one device type torch has fused optimizer kernels for."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # a torch without the helper: keep its default
        return False
    params = list(params)
    devices = {p.device.type for p in params}
    return (len(devices) == 1 and devices <= set(_get_fused_kernels_supported_devices())
            and all(p.is_floating_point() for p in params))


def build_optimizer_spec(cfg: OptimConfig) -> OptimizerSpec:
    """The optimizer named by ``cfg.optim`` with the run's learning rate and weight decay (fused where supported)."""
    return OptimizerSpec(_OPTIMIZERS[cfg.optim], {"lr": cfg.peak_lr, "betas": (0.9, 0.999), "weight_decay": cfg.wd})


def lr_factor(sched: str, total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak learning rate at optimizer step ``s`` (0-based)."""
    total = max(1, total_steps)

    def cosine(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / (warmup_steps + 1)
        progress = min(1.0, (s - warmup_steps) / max(1, total - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    def onecycle(s: int) -> float:
        # torch's OneCycleLR defaults: 30% rise from lr/25, then anneal to lr/(25*1e4), cosine shaped.
        up = max(1, int(0.3 * total))
        start, end = 1 / 25, 1 / (25 * 1e4)
        if s < up:
            return start + (1 - start) * 0.5 * (1 - math.cos(math.pi * s / up))
        progress = min(1.0, (s - up) / max(1, total - up))
        return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * progress))

    def constant(s: int) -> float:
        return min(1.0, (s + 1) / (warmup_steps + 1)) if warmup_steps else 1.0

    return {"cosine": cosine, "onecycle": onecycle, "constant": constant}[sched]


class LRSchedule:
    """Sets ``lr`` on an optimizer's param groups for each optimizer step.

    It writes ``param_groups`` directly instead of using ``torch.optim.lr_scheduler``: DeepSpeed's
    ZeRO optimizers and fairscale's OSS expose torch-compatible ``param_groups`` but are not all
    ``torch.optim.Optimizer`` instances, and this one mechanism serves every strategy.
    """

    def __init__(self, optimizer: Any, peak_lr: float, factor: Callable[[int], float]) -> None:
        self.optimizer, self.peak_lr, self.factor = optimizer, peak_lr, factor
        self.step_count = 0
        self._apply()

    def _apply(self) -> None:
        lr = self.peak_lr * self.factor(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return self.peak_lr * self.factor(self.step_count)

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step_count = int(state["step_count"])
        self._apply()


def default_warmup(cfg: OptimConfig, total_steps: int) -> int:
    """Warm-up steps: the configured number, else 5% of the run for cosine and none otherwise."""
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    return int(0.05 * total_steps) if cfg.sched == "cosine" else 0
