"""Helpers the torch-native strategies share: loss scaling, backward and step."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from scale_ocr.memory.meter import StateMeter, module_tensors, optimizer_tensors
from scale_ocr.strategies.base import StepStats, tensor_norm


class TorchStepper:
    """Backward and optimizer step for engines that expose plain torch gradients.

    Each backward is scaled by ``1 / grad_accum``, so the accumulated gradient is the mean over the global batch;
    ``max_norm`` 0 clips nothing (the norm is still reported). ``zero_grad`` defaults to the optimizer's; engines
    that keep gradients in their own buckets (fairscale's ShardedDataParallel) must clear those too.
    """

    def __init__(self, optimizer: Any, grad_accum: int, max_norm: float,
                 grad_norm: Callable[[], torch.Tensor], clip: Callable[[float, torch.Tensor], None], scaler=None,
                 zero_grad: Callable[[], None] | None = None) -> None:
        self.optimizer, self.grad_accum, self.max_norm = optimizer, grad_accum, max_norm
        self.grad_norm, self.clip, self.scaler = grad_norm, clip, scaler
        self.zero_grad = zero_grad or (lambda: optimizer.zero_grad(set_to_none=True))

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss / self.grad_accum
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def gradient_scale(self) -> float:
        """``1 / grad_accum`` times the loss scale (fp16): what :meth:`backward` multiplies gradients by."""
        return (float(self.scaler.get_scale()) if self.scaler is not None else 1.0) / self.grad_accum

    def step(self) -> StepStats:
        scale = None
        if self.scaler is not None:
            scale = float(self.scaler.get_scale())
            self.scaler.unscale_(self.optimizer)
        norm = self.grad_norm()
        if self.scaler is None and not math.isfinite(float(norm)):
            # NaN/inf gradients would poison the weights and Adam's moments for good. The norm is
            # global, so every rank takes this branch together (DeepSpeed's engines do the same).
            self.zero_grad()
            return StepStats(grad_norm=norm, skipped=True, loss_scale=None)
        if self.max_norm > 0:
            # A non-finite norm (fp16 overflow) zeroes nothing useful: the scaler skips that step.
            self.clip(self.max_norm, norm)
        skipped = False
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = float(self.scaler.get_scale()) < scale
        else:
            self.optimizer.step()
        self.zero_grad()
        return StepStats(grad_norm=norm, skipped=skipped, loss_scale=scale)


class StepperMixin:
    """``backward`` and ``step`` for strategies whose ``setup`` sets ``self.stepper`` (a :class:`TorchStepper`), and
    ``no_sync`` as their wrapper's own (DDP, ShardedDataParallel); strategies without one override ``no_sync``."""

    changes_accumulation = True  # the stepper divides each backward by its count, read at every backward

    def set_accumulation(self, micro_batches: int) -> None:
        self.stepper.grad_accum = micro_batches

    def no_sync(self):
        return self.model.no_sync()

    def backward(self, loss) -> None:
        self.stepper.backward(loss)

    def step(self) -> StepStats:
        return self.stepper.step()

    def gradient_scale(self) -> float:
        return self.stepper.gradient_scale()


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Give every rank rank ``src``'s buffers (BatchNorm running statistics), as DDP does before each forward, so
    evaluation, checkpoints and resumes see one model, not one per rank."""
    import torch.distributed as tdist

    if not tdist.is_initialized() or tdist.get_world_size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in module.buffers():
        by_dtype.setdefault(b.dtype, []).append(b)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        group = by_dtype[dtype]
        flat = torch.cat([b.detach().reshape(-1) for b in group])  # one broadcast per dtype
        tdist.broadcast(flat, src)
        for b, value in zip(group, flat.split([b.numel() for b in group]), strict=True):
            b.detach().copy_(value.view_as(b))


def dense_grad_norm(params) -> Callable[[], torch.Tensor]:
    """Global norm of the gradients of ``params``: replicated (DDP, DataParallel, single), or FSDP2's DTensor shards,
    whose norm :func:`~scale_ocr.strategies.base.tensor_norm` reduces over the ranks."""
    params = list(params)
    return lambda: tensor_norm([p.grad for p in params if p.grad is not None])


def dense_clip(params) -> Callable[[float, torch.Tensor], None]:
    params = list(params)

    def fn(max_norm: float, total_norm: torch.Tensor) -> None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)

    return fn


def replica_stepper(optimizer, module: torch.nn.Module, train, clip_grad: float, device: torch.device) -> TorchStepper:
    """A :class:`TorchStepper` over ``module``'s replicated gradients (single, DataParallel, DDP)."""
    params = list(module.parameters())
    return TorchStepper(optimizer, train.grad_accum, clip_grad, dense_grad_norm(params), dense_clip(params),
                        make_scaler(train.precision, device))


def make_scaler(precision: str, device: torch.device, sharded: bool = False):
    """A loss scaler for fp16 (None otherwise); the sharded one agrees on overflow across ranks."""
    if precision != "fp16":
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type)
    return torch.amp.GradScaler(device.type)


def torch_checkpoint_state(module, optimizer) -> dict[str, Any]:
    """Model and optimizer state of a plain, DDP-wrapped or FSDP2-sharded module, by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)  # initialises a fresh optimizer's state
    return {"model": model_sd, "optim": optim_sd}


def torch_load_checkpoint_state(module, optimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def init_optimizer_state(optimizer) -> None:
    """Create a fresh optimizer's lazily built state (zero moments) with a zero-gradient, zero-lr step,
    so a checkpoint reader has tensors of the right shapes to load into."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]  # DeepSpeed's flat partitions need no grad flag
    lrs = [g["lr"] for g in optimizer.param_groups]
    grads = [p.grad for p in params]  # engines may keep buffer views here; put them back after
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p, grad in zip(params, grads, strict=True):
        p.grad = grad


def torch_state_meter(module: torch.nn.Module, optimizer, device: torch.device, stepping=None,
                      other: Callable[[], list[torch.Tensor]] = list) -> StateMeter:
    """A :class:`StateMeter` for plain (or DTensor) parameters, their gradients and a torch optimizer's state;
    ``stepping``: the optimizer that steps, if ``optimizer`` wraps one (fairscale's OSS); ``other``: engine buffers."""
    inner = stepping or optimizer

    def collect() -> dict[str, list]:
        return {**module_tensors(module), "optimizer": optimizer_tensors(inner), "other": other()}

    return StateMeter(inner, collect, device)
