"""``zero1`` ... ``zero3_offload`` and ``deepspeed``: the DeepSpeed engine with a ZeRO JSON."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from torch import nn

from scale_ocr.errors import UserError
from scale_ocr.optim import OptimizerSpec
from scale_ocr.strategies.base import StepStats, Strategy
from scale_ocr.strategies.ds_config import load_ds_config, preset_path, resolve_ds_config


class DeepSpeed(Strategy):
    """DeepSpeed's engine; ZeRO stage, offload and buckets come from the JSON.

    Args:
        preset: name of a JSON in ``ds_configs/`` used when ``--ds-config`` is not given.

    The engine owns accumulation (it scales the loss by 1/accumulation and counts micro-steps),
    clipping (``gradient_clipping``) and fp16 loss scaling; this class maps the shared interface
    onto it so the same flags mean the same maths as under DDP or FSDP.
    """

    shards_state = True

    def __init__(self, *args, preset: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.cfg.ds_config:
            self.source = self.cfg.ds_config
        elif preset:
            self.source = str(preset_path(preset))
        else:
            raise UserError("--strategy deepspeed needs --ds-config PATH; or pick a preset such as zero2")
        self.ds_config = resolve_ds_config(
            load_ds_config(self.source), source=self.source, micro_batch=self.train.batch_size,
            grad_accum=self.train.grad_accum, world_size=self.world_size, clip_grad=self.optim.clip_grad,
            precision=self.train.precision, lr=self.optim.lr, weight_decay=self.optim.wd,
        )

    def setup(self, model: nn.Module, optimizer: OptimizerSpec) -> tuple[nn.Module, Any]:
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        model = model.to(self.dist.device)
        kwargs: dict[str, Any] = {"model": model, "config": self.ds_config, "dist_init_required": False}
        if "optimizer" in self.ds_config:
            kwargs["model_parameters"] = optimizer.groups(model)
        else:
            kwargs["optimizer"] = optimizer.build(model)
        try:
            self.engine, self.optimizer, _, _ = deepspeed.initialize(**kwargs)
        except (AssertionError, ValueError, TypeError, KeyError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"DeepSpeed rejected {self.source}: {first}") from None
        self.zero_stage = self.engine.zero_optimization_stage()
        return self.engine, self.optimizer

    def engine_config(self) -> dict[str, Any]:
        return self.ds_config

    def no_sync(self):
        # The engine decides itself which micro-steps reduce (ZeRO-2/3 reduce into partitions on
        # every micro-step to free memory); its own no_sync() refuses gradient partitioning.
        return contextlib.nullcontext()

    def backward(self, loss) -> None:
        self.engine.backward(loss)
        if not self.engine.is_gradient_accumulation_boundary():
            # engine.step() on a non-boundary micro-step only advances the engine's micro-step
            # counter, keeping its notion of the accumulation boundary aligned with the loop's.
            self.engine.step()

    def step(self) -> StepStats:
        skipped_before = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        fp16 = self.engine.fp16_enabled()
        return StepStats(
            grad_norm=float(norm) if norm is not None else float("nan"),
            skipped=self.engine.skipped_steps > skipped_before,
            loss_scale=float(self.optimizer.cur_scale) if fp16 else None,
        )

    def full_state_dict(self) -> dict[str, Any] | None:
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # collective; rank 0 gets it
        else:
            state = self.engine.module.state_dict()
        if not self.is_main or state is None:
            return None
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def teardown(self) -> None:
        if hasattr(self, "engine") and hasattr(self.engine, "destroy"):
            self.engine.destroy()
