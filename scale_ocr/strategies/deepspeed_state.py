"""What a DeepSpeed rank writes to the checkpoint layout every strategy shares and reads back (only the part it
holds, straight from and into DeepSpeed's buffers), and the whole model, one parameter at a time (docs/checkpoints.md).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch

from scale_ocr.models.checkpointing import bare_name
from scale_ocr.models.init import full_shape
from scale_ocr.strategies import deepspeed_internals as internals
from scale_ocr.strategies.base import ModelPiece, replica_pieces
from scale_ocr.strategies.common import broadcast_buffers, init_optimizer_state
from scale_ocr.strategies.flat_shard import FlatShard

MOMENTS = ("exp_avg", "exp_avg_sq")


class DeepSpeedState:
    """The checkpoint and whole-model view of one DeepSpeed engine; ``client_groups`` are the optimizer's param
    groups as the client built them (their settings are checkpointed)."""

    def __init__(self, engine: Any, client_groups: list[dict[str, Any]], is_main: bool) -> None:
        self.engine, self.client_groups, self.is_main = engine, client_groups, is_main
        self.zero_stage = engine.zero_optimization_stage()

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _base_optimizer(self) -> Any:
        return internals.base_optimizer(self.engine.optimizer)

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(bare_name(n), p) for n, p in self.module.named_parameters()]

    def _buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers a state dict holds (persistent ones), by bare name."""
        params = {id(p) for p in self.module.parameters()}
        return [(bare_name(k), v) for k, v in self.module.state_dict(keep_vars=True).items() if id(v) not in params]

    def link_optimizer_state(self) -> None:
        """Make sure Adam's moments exist and DeepSpeed's per-parameter views point at them: both are built lazily at
        the first step, and a checkpoint may be read or written before it."""
        zero_opt = self.engine.optimizer
        with internals.fp32_partitions_attached(zero_opt):  # ZeRO-3 attaches partitions only to step
            init_optimizer_state(self._base_optimizer())
        internals.relink_hp_optimizer_state(zero_opt)

    def _adam_step(self) -> float:
        for st in self._base_optimizer().state.values():
            if "step" in st:
                return float(st["step"])
        return 0.0

    def _held(self, p: torch.nn.Parameter, key: str | None, to_load: bool) -> FlatShard | torch.Tensor:
        """This rank's part of ``p``'s fp32 master (``key=None``) or Adam moment ``key``: a view of DeepSpeed's own
        buffer to read into (``to_load``), else read when DCP writes it (under NVMe offload, swapped back after)."""
        shape = full_shape(p)
        n = math.prod(shape)
        if self.zero_stage == 3:
            zero_opt = self.engine.optimizer
            start, size = internals.zero3_partition_range(zero_opt, p)
            numel = max(0, min(size, n - start))  # the last ranks' partitions pad past the end

            def part() -> torch.Tensor:
                return internals.fp32_partition(zero_opt, p, key, release=not to_load)[:numel]

            return FlatShard(shape, start, numel, torch.float32, part)
        if internals.holds_fragments(p):
            found = internals.hp_fragment(p, key)
            start, numel = (found[1], found[0].numel()) if found is not None else (0, 0)
            return FlatShard(shape, start, numel, torch.float32, lambda: internals.hp_fragment(p, key)[0])
        return p.data if key is None else self._base_optimizer().state[p][key]  # stage 0 in fp32: whole

    def checkpoint_state(self, to_load: bool = False) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` in the shared layout, each rank's part of every tensor where it lies;
        ``to_load``: views of DeepSpeed's buffers to load into (see :meth:`finish_load`)."""
        broadcast_buffers(self.module)  # one set of BatchNorm statistics, rank 0's
        self.link_optimizer_state()
        step = torch.tensor(self._adam_step())
        model: dict[str, Any] = {}
        states: dict[str, Any] = {}
        for name, p in self._params():
            model[name] = self._held(p, None, to_load)
            states[name] = {"step": step.clone(), **{k: self._held(p, k, to_load) for k in MOMENTS}}
        for name, b in self._buffers():
            model[name] = b.detach()  # DCP writes rank 0's copy, and loads into every rank's in place
        names = {id(p): bare_name(n) for n, p in self.module.named_parameters()}
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [names[id(p)] for p in g["params"] if id(p) in names]}
                  for g in self.client_groups]
        return {"model": model, "optim": {"state": states, "param_groups": groups}}

    def finish_load(self, state: dict[str, Any]) -> None:
        """After DCP filled ``checkpoint_state(to_load=True)``: Adam's step count, and the 16-bit weights from the
        fp32 masters (one parameter at a time: a collective per parameter)."""
        step = next(iter(state["optim"]["state"].values()))["step"] if state["optim"]["state"] else None
        for st in self._base_optimizer().state.values():
            if "step" in st and step is not None:
                st["step"] = step.clone() if torch.is_tensor(st["step"]) else int(step)
        for _, p in self._params():
            self._set_weights_from_master(p)

    def _set_weights_from_master(self, p: torch.nn.Parameter) -> None:
        from deepspeed.utils import safe_get_full_fp32_param

        if self.zero_stage == 3:
            import deepspeed

            full = safe_get_full_fp32_param(p)  # all-gathered on every rank
            # Gather the 16-bit copy, overwrite it on rank 0, and let DeepSpeed broadcast and repartition it.
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if self.is_main:
                    p.data.copy_(full.reshape(p.shape))
        elif internals.holds_fragments(p):
            p.data.copy_(safe_get_full_fp32_param(p).to(p.dtype))  # the ranks' fragments, all-reduced

    def model_pieces(self) -> list[ModelPiece]:
        """Each parameter's fp32 master gathered whole on its own (the weights training reached, not their 16-bit
        rounding), then the buffers."""
        broadcast_buffers(self.module)
        pieces = [ModelPiece(name, full_shape(p), torch.float32, partial(self._whole_master, p))
                  for name, p in self._params()]
        pieces += replica_pieces(dict(self._buffers()), self.is_main)  # whole on every rank
        order = {k: i for i, k in enumerate(bare_name(k) for k in self.module.state_dict(keep_vars=True))}
        return sorted(pieces, key=lambda piece: order.get(piece.name, len(order)))  # the state dict's order

    def _whole_master(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        from deepspeed.utils import safe_get_full_fp32_param

        full = safe_get_full_fp32_param(p) if (self.zero_stage == 3 or internals.holds_fragments(p)) else p.detach()
        if full is None:  # a frozen parameter: DeepSpeed keeps no fp32 master of it
            full = self._gathered_weight(p)
        return full.reshape(full_shape(p)).to("cpu", torch.float32, copy=True) if self.is_main else None

    def _gathered_weight(self, p: torch.nn.Parameter) -> torch.Tensor:
        if self.zero_stage != 3:
            return p.detach()
        import deepspeed

        with deepspeed.zero.GatheredParameters([p]):
            return p.detach().clone()
