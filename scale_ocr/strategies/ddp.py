"""``ddp``: DistributedDataParallel, gradients all-reduced in buckets during backward."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scale_ocr.memory.model import StateLayout
from scale_ocr.optim import OptimizerSpec
from scale_ocr.strategies.base import ModelPiece, Strategy, replica_pieces
from scale_ocr.strategies.common import (
    StepperMixin,
    broadcast_buffers,
    replica_stepper,
    torch_checkpoint_state,
    torch_load_checkpoint_state,
    torch_state_meter,
)


class DDP(StepperMixin, Strategy):
    """Replicated model, bucketed gradient all-reduce overlapped with backward; ``.grad`` tensors are views of the
    reducer's buckets (``gradient_as_bucket_view``), not a second gradient-sized copy."""

    compiles = True
    tunes_reducer = True

    def setup(self, model: nn.Module, optimizer: OptimizerSpec) -> tuple[nn.Module, Any]:
        # Channels-last images give convolutions channels-last weight gradients, which the reducer copies into its
        # contiguous buckets after warning once about exactly that: the warning tells a user nothing they can act on.
        warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
        device = self.dist.device
        self.module = model.to(device)
        self.model = DistributedDataParallel(
            self.module,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            bucket_cap_mb=self.cfg.bucket_mb,
            static_graph=self.cfg.static_graph,
        )
        self.optimizer = optimizer.build(self.module)
        self.stepper = replica_stepper(self.optimizer, self.module, self.train, self.optim.clip_grad, device)
        self.meter = torch_state_meter(self.module, self.optimizer, device)
        return self.model, self.optimizer

    def state_layout(self) -> StateLayout:
        return StateLayout(ideal_stage=0, note="gradient_as_bucket_view=True: gradients are views of the reducer's "
                           "buckets; without it DDP keeps a second gradient-sized copy")

    def checkpoint_state(self) -> dict[str, Any]:
        # DDP broadcasts rank 0's buffers before each forward, but the forward then updates every rank's
        # BatchNorm statistics on its own batch; DCP saves one rank's copy of a replicated tensor, not
        # necessarily rank 0's. Giving every rank rank 0's now makes the checkpoint the model rank 0 holds,
        # so a resumed run continues bitwise whichever rank the copy came from.
        self.sync_buffers()
        return torch_checkpoint_state(self.module, self.optimizer)

    def sync_buffers(self) -> None:
        broadcast_buffers(self.module)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        torch_load_checkpoint_state(self.module, self.optimizer, state)

    def model_pieces(self) -> list[ModelPiece]:
        return replica_pieces(self.module.state_dict(), self.is_main)
