"""``fairscale``: OSS (sharded optimizer state) with ShardedDataParallel (sharded gradient reduction)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scale_ocr.memory.model import StateLayout
from scale_ocr.models.checkpointing import bare_name
from scale_ocr.optim import OptimizerSpec
from scale_ocr.strategies.base import ModelPiece, Strategy, replica_pieces
from scale_ocr.strategies.common import StepperMixin, TorchStepper, init_optimizer_state, torch_state_meter
from scale_ocr.strategies.deepspeed_internals import ddp_bucket_buffers


class Fairscale(StepperMixin, Strategy):
    """fairscale's ZeRO-2 analogue: each rank owns a shard of the optimizer state, and gradients are
    reduced to their owner only; updated parameters are broadcast back after each step."""

    shards_state = True

    def setup(self, model: nn.Module, optimizer: OptimizerSpec) -> tuple[nn.Module, Any]:
        from fairscale.nn.data_parallel import ShardedDataParallel
        from fairscale.optim import OSS

        self.module = model.to(self.dist.device)
        groups = optimizer.groups(self.module)
        self.optimizer = OSS(groups, optim=optimizer.cls, **optimizer.options(groups))
        self.model = ShardedDataParallel(self.module, self.optimizer)
        scaler = None
        if self.train.precision == "fp16":
            from fairscale.optim.grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler()
        self.stepper = TorchStepper(self.optimizer, self.train.grad_accum, self.optim.clip_grad,
                                    self._grad_norm, self._clip, scaler, zero_grad=self._zero_grad)
        self.meter = torch_state_meter(self.module, self.optimizer, self.dist.device, stepping=self.optimizer.optim,
                                       other=lambda: ddp_bucket_buffers(self.model))
        return self.model, self.optimizer

    def state_layout(self) -> StateLayout:
        return StateLayout(ideal_stage=2, optim_sharded=True,
                           note="ShardedDataParallel reduces each gradient to its owner, but every rank keeps "
                           "full-size .grad tensors: gradients are not sharded in memory")

    def _zero_grad(self) -> None:
        # Bucketed gradients are views into ShardedDataParallel's reduce buckets: clearing only the
        # optimizer's .grad leaves the buckets holding the last step, which then leaks into the next.
        self.model.zero_grad(set_to_none=False)

    def _grad_norm(self) -> torch.Tensor:
        # OSS computes the norm over the gradients each rank owns and all-reduces it; with an
        # infinite threshold it measures without scaling anything.
        return self.optimizer.clip_grad_norm(float("inf"))

    def _clip(self, max_norm: float, total_norm: torch.Tensor) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)

    def _names(self) -> dict[int, str]:
        return {id(p): bare_name(n) for n, p in self.module.named_parameters()}

    def checkpoint_state(self) -> dict[str, Any]:
        # OSS keeps a plain torch optimizer over the parameters this rank owns; its state is saved
        # under the parameter names, so each rank writes its own shard and any layout can read it.
        local = self.optimizer.optim
        init_optimizer_state(local)
        names = self._names()
        state = {names[id(p)]: dict(local.state[p]) for g in local.param_groups for p in g["params"]
                 if p in local.state}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        return {"model": self.module.state_dict(), "optim": {"state": state, "param_groups": groups}}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        local, names, saved = self.optimizer.optim, self._names(), state["optim"]["state"]
        for g in local.param_groups:
            for p in g["params"]:
                if names[id(p)] in saved:
                    local.state[p] = {k: v.to(p.device) if k != "step" else v for k, v in saved[names[id(p)]].items()}

    def model_pieces(self) -> list[ModelPiece]:
        # Parameters are replicated (OSS broadcasts them after every step); only the state is sharded.
        return replica_pieces(self.module.state_dict(), self.is_main)
