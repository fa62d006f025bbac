"""``fsdp`` / ``fsdp_grad_op``: FSDP2 (``fully_shard``), each block sharded, then the root."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from scale_ocr.errors import say
from scale_ocr.memory.model import StateLayout
from scale_ocr.models.checkpointing import bare_name
from scale_ocr.models.init import ModelFactory, init_weights
from scale_ocr.models.registry import capable
from scale_ocr.optim import OptimizerSpec
from scale_ocr.precision import compute_weight_dtype
from scale_ocr.strategies.base import (
    ModelPiece,
    Strategy,
    hook_tensors,
    shard_size,
    single_group_notice,
    written_dtype,
)
from scale_ocr.strategies.common import (
    StepperMixin,
    TorchStepper,
    broadcast_buffers,
    dense_clip,
    dense_grad_norm,
    make_scaler,
    torch_checkpoint_state,
    torch_load_checkpoint_state,
    torch_state_meter,
)


def apply_fsdp(model: nn.Module, mesh, reshard_after_forward: bool, precision: str) -> nn.Module:
    """Shard ``model.sharding_units()`` (or its direct children) one by one, then the root.

    Per-unit sharding is what bounds memory: each unit's parameters are gathered just before its
    forward/backward and freed after, instead of the whole model at once. In a 16-bit run they are
    gathered as 16-bit copies of the fp32 shards (torchtitan's mixed-precision policy, gradients reduced in
    fp32): half the all-gather bytes, and autocast then keeps no unsharded 16-bit copy of every weight until the
    backward. Models with BatchNorm gather fp32 weights, as every engine keeps them (:func:`compute_weight_dtype`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtype = compute_weight_dtype(precision, model)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
    units = model.sharding_units() if capable(model, "sharding_units") else list(model.children())
    for unit in units:
        if any(p.requires_grad for p in unit.parameters()):
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


class FSDP(StepperMixin, Strategy):
    """Fully sharded data parallel: parameters, gradients and optimizer state split across ranks;
    ``reshard_after_forward=False`` keeps gathered parameters until backward ends (ZeRO-2-like)."""

    shards_state = True
    compiles = True

    def __init__(self, *args, reshard_after_forward: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reshard_after_forward = reshard_after_forward
        self._mesh = None

    def mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None:
            self._mesh = init_device_mesh(self.dist.device.type, (self.world_size,))
        return self._mesh

    def build_model(self, factory: ModelFactory, seed: int) -> nn.Module:
        """Built on the meta device when the model has a per-parameter init rule (no rank ever holds it whole),
        sharded there, then only this rank's shards filled; others are built whole and sharded by ``setup``."""
        model = factory.meta_with_rule()
        if model is None:
            return super().build_model(factory, seed)
        sharded = apply_fsdp(model, self.mesh(), self.reshard_after_forward, self.train.precision)
        init_weights(sharded.to_empty(device=self.dist.device), seed)
        return sharded

    def setup(self, model: nn.Module, optimizer: OptimizerSpec) -> tuple[nn.Module, Any]:
        if isinstance(model, FSDPModule):  # build_model sharded it already
            self.model = model
        else:
            self.model = apply_fsdp(model.to(self.dist.device), self.mesh(), self.reshard_after_forward,
                                    self.train.precision)
        self.optimizer = optimizer.build(self.model)  # over the sharded (DTensor) parameters
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.stepper = TorchStepper(self.optimizer, self.train.grad_accum, self.optim.clip_grad,
                                    dense_grad_norm(self.params), dense_clip(self.params),
                                    make_scaler(self.train.precision, self.dist.device, sharded=True))
        self.meter = torch_state_meter(self.model, self.optimizer, self.dist.device)
        return self.model, self.optimizer

    def state_layout(self) -> StateLayout:
        note = ("each unit's parameters are gathered for its forward and backward only" if self.reshard_after_forward
                else "gathered parameters stay from forward until backward ends (not at the step)")
        return StateLayout(ideal_stage=3 if self.reshard_after_forward else 2, params_sharded=True,
                           grads_sharded=True, optim_sharded=True, gathers_16bit=self.train.precision != "fp32",
                           grads_freed=True, gathers_per="unit",
                           note=note)

    def tap_gradients(self, on_grad):
        """The module's parameters are this rank's shards (DTensors); each unit's forward runs on whole tensors that
        FSDP gathers into and registers just before it. A forward pre-hook on each unit, after FSDP's own, hooks
        those the first time it sees them (FSDP keeps the same tensors from step to step, refilling their storage),
        so each backward hands ``on_grad`` the rank's gradient before the reduce-scatter."""
        hooked: dict[int, weakref.ref] = {}  # by id, checked by identity: a tensor FSDP replaced may reuse its id
        handles: list = []

        def hook_gathered(module: nn.Module, args: Any) -> None:
            fresh = [p for p in module.parameters()
                     if not isinstance(p, DTensor) and (id(p) not in hooked or hooked[id(p)]() is not p)]
            hooked.update((id(p), weakref.ref(p)) for p in fresh)
            handles.extend(hook_tensors(fresh, on_grad))

        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        handles.extend(unit.register_forward_pre_hook(hook_gathered) for unit in units)
        return handles  # the tensor hooks join it as they are placed

    @contextlib.contextmanager
    def no_sync(self):
        # Skip the reduce-scatter on accumulation micro-steps; gradients accumulate unsharded.
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def sync_buffers(self) -> None:
        broadcast_buffers(self.model)  # FSDP keeps each rank's BatchNorm statistics; DDP replicates rank 0's

    def checkpoint_state(self) -> dict[str, Any]:
        self.sync_buffers()
        return torch_checkpoint_state(self.model, self.optimizer)

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        torch_load_checkpoint_state(self.model, self.optimizer, state)

    def model_pieces(self) -> list[ModelPiece]:
        """Each sharded tensor all-gathered on its own (``full_tensor``), then copied to the CPU on rank 0."""
        self.sync_buffers()

        def fetch(t: torch.Tensor) -> torch.Tensor | None:
            whole = t.full_tensor() if isinstance(t, DTensor) else t  # a collective over the tensor's mesh
            return whole.detach().to("cpu", written_dtype(t), copy=True) if self.is_main else None

        return [ModelPiece(bare_name(k), tuple(t.shape), written_dtype(t), partial(fetch, t))
                for k, t in self.model.state_dict().items()]


class HSDP(FSDP):
    """Hybrid sharded data parallel: FSDP2 over a 2-D mesh, sharded within groups of ``--shard-size`` ranks (a
    node by default) and replicated across the groups; only the reduced gradient shards cross groups, once a step."""

    @classmethod
    def takes_shard_size(cls, cfg, **preset) -> bool:
        return True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shard = shard_size(self.cfg.shard_size, self.world_size, self.dist.local_world_size,
                                f"--strategy {self.cfg.strategy}")

    def mesh(self):
        from torch.distributed.device_mesh import init_device_mesh

        if self._mesh is None:
            line = single_group_notice(self.cfg.strategy, self.shard, self.world_size, "fsdp")
            if line and self.is_main:
                say(line)
            self._mesh = init_device_mesh(self.dist.device.type, (self.world_size // self.shard, self.shard),
                                          mesh_dim_names=("replicate", "shard"))
        return self._mesh

    def state_layout(self) -> StateLayout:
        layout = super().state_layout()
        note = (f"sharded within groups of {self.shard} ranks, replicated across {self.world_size // self.shard}; "
                + layout.note)
        return dataclasses.replace(layout, shard_group=self.shard, note=note)
