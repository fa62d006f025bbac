"""``single``: the plain module on one device, and ``dp``: torch.nn.DataParallel over local GPUs."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from scale_ocr.memory.model import StateLayout
from scale_ocr.optim import OptimizerSpec
from scale_ocr.strategies.base import ModelPiece, Strategy, replica_pieces
from scale_ocr.strategies.common import (
    StepperMixin,
    replica_stepper,
    torch_checkpoint_state,
    torch_load_checkpoint_state,
    torch_state_meter,
)


class SingleDevice(StepperMixin, Strategy):
    """One process, one device, no wrapper: the reference every other strategy is compared to."""

    max_world_size = 1
    compiles = True

    def _wrap(self, model: nn.Module) -> nn.Module:
        return model

    def setup(self, model: nn.Module, optimizer: OptimizerSpec) -> tuple[nn.Module, Any]:
        self.module = model.to(self.dist.device)
        self.model = self._wrap(self.module)
        self.optimizer = optimizer.build(self.module)
        self.stepper = replica_stepper(self.optimizer, self.module, self.train, self.optim.clip_grad, self.dist.device)
        self.meter = torch_state_meter(self.module, self.optimizer, self.dist.device)
        return self.model, self.optimizer

    def state_layout(self) -> StateLayout:
        return StateLayout(ideal_stage=0, grads_freed=True)

    def no_sync(self):
        return contextlib.nullcontext()

    def checkpoint_state(self) -> dict[str, Any]:
        return torch_checkpoint_state(self.module, self.optimizer)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        torch_load_checkpoint_state(self.module, self.optimizer, state)

    def model_pieces(self) -> list[ModelPiece]:
        return replica_pieces(self.module.state_dict(), True)


class DataParallel(SingleDevice):
    """``torch.nn.DataParallel``: one process drives every local GPU by scattering each batch (the benchmarks'
    baseline); without GPUs it runs the module directly, DataParallel's own behaviour."""

    compiles = False  # the baseline stays as users run it; torch.compile does not trace DataParallel's scatter

    def _wrap(self, model: nn.Module) -> nn.Module:
        return _OneLoss(model)

    def state_layout(self) -> StateLayout:
        return StateLayout(ideal_stage=0, grads_freed=True, note="on GPUs, replicas of the weights are re-broadcast to "
                                                                 "every device "
                           "each forward and gradients are summed on the first one, which holds the optimizer")


class _OneLoss(nn.DataParallel):
    """DataParallel whose output holds one loss, as every other engine's does: the replicas' losses averaged (its
    gather stacks one per device)."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        out = super().forward(*inputs, **kwargs)
        if isinstance(out, dict) and torch.is_tensor(out.get("loss")) and out["loss"].dim():
            out = {**out, "loss": out["loss"].mean()}
        return out
