"""The strategy interface: the only thing the training loop knows about distribution.

The loop asks a strategy for capabilities, never for its name (docs/strategies.md).
"""

from __future__ import annotations

import math
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from scale_ocr.config import OptimConfig, StrategyConfig, TrainConfig
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.errors import UserError, say
from scale_ocr.memory.meter import StateBytes, StateMeter
from scale_ocr.memory.model import StateLayout
from scale_ocr.models.checkpointing import bare_name
from scale_ocr.models.init import ModelFactory, init_weights
from scale_ocr.optim import OptimizerSpec


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would run on a CPU host, if there is one."""
    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    return next((found for name in names if (found := shutil.which(name))), None)


def tensor_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``tensors`` together in fp32; DTensor shards are reduced over their mesh."""
    if not tensors:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(tensors, norm_type=2.0)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def hook_tensors(tensors, on_grad: Callable[[torch.Tensor], None]) -> list:
    """Tensor hooks calling ``on_grad`` with the gradient of each trainable tensor of ``tensors`` in each backward
    (before it is accumulated into ``.grad`` or handed to an engine's own hooks); returns their handles."""
    return [t.register_hook(on_grad) for t in tensors if t.requires_grad]


def saved_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The floating buffers a state dict of ``module`` holds (BatchNorm's running statistics): whole on every rank
    under every engine (none shards buffers), and saved with the weights, so they count as weights do."""
    return [b for m in module.modules() for name, b in m._buffers.items()
            if b is not None and b.is_floating_point() and name not in m._non_persistent_buffers_set]


def with_buffers(norm: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """The L2 norm of the weights whose norm is ``norm`` together with ``module``'s saved floating buffers (fp32;
    NaN when either holds a NaN). Buffers are each rank's own: ranks whose statistics differ may differ here, and
    the loop's agreement (any rank's bad weights make the step bad) decides for all."""
    buffers = tensor_norm(saved_buffers(module)).to(norm.device)
    return torch.linalg.vector_norm(torch.stack([norm.float().reshape(()), buffers.float().reshape(())]))


def shard_size(flag: int | None, world: int, local_world: int, what: str) -> int:
    """Ranks per shard group of the hybrid strategies (hsdp, zero3_hpz): ``--shard-size`` (``flag``) or the
    launcher's ranks per node, which must divide the world size; ``what`` names the strategy or file in the message.
    Launchers number ranks node by node, so a group of consecutive ranks is a node, where links are fast.
    """
    size = flag or local_world
    if size < 1 or world % size:
        source = f"--shard-size {flag}" if flag else f"the launcher's {local_world} ranks per node"
        divisors = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        raise UserError(f"{what}: shard groups of {size} ranks ({source}) do not divide the {world} "
                        f"ranks of this job; pass --shard-size with one of {divisors}")
    return size


def single_group_notice(strategy: str, size: int, world: int, plain: str) -> str | None:
    """A line for rank 0 when the groups make ``strategy`` the same as ``plain`` (one group spans every rank)."""
    if size != world:
        return None
    return (f"scale-ocr: --strategy {strategy}: one shard group spans all {world} rank{'s' * (world > 1)}, so it "
            f"runs as {plain} "
            f"(launch on more nodes, or pass --shard-size N with N dividing {world}, to shard within groups)")


class ModelPiece(NamedTuple):
    """One tensor of the whole model, as :meth:`Strategy.model_pieces` lists it: its key in the bare model's state
    dict, whole shape, written dtype (:func:`written_dtype`), and ``fetch``, a collective that returns the whole
    tensor on the CPU on rank 0, None on the other ranks."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fetch: Callable[[], torch.Tensor | None]


def written_dtype(tensor: torch.Tensor) -> torch.dtype:
    """What a whole-model file holds a tensor as: fp32 if it is floating-point (weights are exported in full
    precision whatever the engine computes in), else its own dtype (integer counters)."""
    return torch.float32 if tensor.is_floating_point() else tensor.dtype


def replica_pieces(state: dict[str, torch.Tensor], is_main: bool) -> list[ModelPiece]:
    """The pieces of a state dict every rank holds whole (single, DDP, fairscale): rank 0 copies each in turn."""

    def fetch(t: torch.Tensor) -> torch.Tensor | None:
        return t.detach().to("cpu", written_dtype(t), copy=True) if is_main else None

    return [ModelPiece(bare_name(k), tuple(t.shape), written_dtype(t), partial(fetch, t)) for k, t in state.items()]


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step reports: the global pre-clip gradient norm (inf when fp16 overflowed; a 0-d tensor may
    stay on the device until the loop logs it), whether the step was skipped (fp16 overflow, or a NaN/inf norm), and
    the fp16 loss scale (None without loss scaling)."""

    grad_norm: float | torch.Tensor
    skipped: bool = False
    loss_scale: float | None = None

    @property
    def norm_ok(self) -> bool:
        """Whether the step's gradient norm is fine: under fp16 loss scaling an infinite norm is an overflow the
        scaler handles (it lowers the scale and skips the step); only unscaled NaN/inf gradients are a bad step."""
        return self.loss_scale is not None or math.isfinite(float(self.grad_norm))


class Strategy(ABC):
    """Base of every strategy; ``run_dir`` is where an engine may keep scratch files (NVMe offload's swap files),
    None when the strategy is only described (memory estimates)."""

    #: At most this many ranks make sense (1 for single-process strategies such as DataParallel).
    max_world_size: int | None = None
    #: Parameters, gradients or optimizer state are split across ranks.
    shards_state: bool = False
    #: ``--compile`` works: :meth:`compile` can torch.compile the module :meth:`setup` returns.
    compiles: bool = False
    #: ``--bucket-mb`` and ``--static-graph`` set its gradient reducer (DDP's).
    tunes_reducer: bool = False
    #: ``--ds-config`` (a DeepSpeed JSON) configures it.
    reads_ds_config: bool = False
    #: :meth:`set_accumulation` can change the micro-batches per optimizer step mid-run (``--batch-ramp``).
    changes_accumulation: bool = False

    @classmethod
    def takes_shard_size(cls, cfg: StrategyConfig, **preset: Any) -> bool:
        """Whether ``--shard-size`` sets this strategy's shard groups (hsdp, zero3_hpz) with these preset arguments;
        a flag that would be ignored is refused before launching."""
        return False

    def __init__(self, cfg: StrategyConfig, dist: DistInfo, train: TrainConfig, optim: OptimConfig,
                 run_dir: Path | None = None) -> None:
        self.cfg, self.dist, self.train, self.optim, self.run_dir = cfg, dist, train, optim, run_dir
        self.meter: StateMeter | None = None  # set by setup(): counts model-state bytes at each step

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def world_size(self) -> int:
        return self.dist.world_size

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def build_model(self, factory: ModelFactory, seed: int) -> nn.Module:
        """The model ``factory`` builds, with its initial weights, the same on every rank and under every strategy.

        A model with a per-parameter rule (``init_param``) is initialised from ``(seed, name)``, which a sharding
        engine can reproduce shard by shard; others from the global RNG; with ``--init-from`` it is built whole and
        then set from the file.
        """
        model = factory.meta_with_rule()
        if model is None:
            torch.manual_seed(seed)
            model = factory.build()
            if factory.load_weights is not None:  # every rank reads the same file into the whole model
                loaded = factory.load_weights(model)
                if self.is_main:
                    say(f"scale-ocr: {loaded}")
            return model
        init_weights(model.to_empty(device="cpu"), seed)  # each weight initialised once, by its rule
        return model

    @abstractmethod
    def setup(self, model: nn.Module, optimizer: OptimizerSpec) -> tuple[nn.Module, Any]:
        """Move, wrap and shard ``model``; build the optimizer over the result. Returns the module to call in the loop
        and an object with ``param_groups`` whose ``lr`` the learning-rate schedule sets."""

    def compile(self, model: nn.Module) -> None:
        """torch.compile ``model`` (what :meth:`setup` returned) in place with ``--compile``'s backend.

        In place (``nn.Module.compile``), so parameter and state-dict names do not change and checkpoints stay
        portable; engines' hooks stay outside the compiled graphs, where dynamo puts them.
        """
        if self.cfg.compile == "inductor" and self.dist.device.type == "cpu" and not cpp_compiler():
            raise UserError("--compile on CPU generates C++, but no compiler was found ($CXX, g++, c++ or clang++ on "
                            "PATH): install one (apt-get install g++), or use --compile aot_eager")
        model.compile(backend=self.cfg.compile)

    @abstractmethod
    def no_sync(self) -> AbstractContextManager:
        """Context for accumulation micro-steps whose gradients need no cross-rank sync yet."""

    @abstractmethod
    def backward(self, loss: Any) -> None:
        """Backward of one micro-batch's mean loss; scaling for accumulation and fp16 included."""

    @abstractmethod
    def step(self) -> StepStats:
        """Clip to ``optim.clip_grad`` (if > 0), step the optimizer, and zero the gradients."""

    def tap_gradients(self, on_grad: Callable[[torch.Tensor], None]) -> list:
        """Have ``on_grad`` called with each trainable tensor's gradient from each backward on this rank, before the
        engine reduces or partitions it: the rank's micro-batch gradient, times :meth:`gradient_scale`. Returns the
        handles to remove (the gradient noise scale's reading, :mod:`scale_ocr.run.noise_scale`).

        This default hooks the parameters of the module :meth:`setup` returned, which is right for engines whose
        forward uses those tensors (whole, or gathered into them in place); an engine that swaps in other tensors
        for the forward hooks those.
        """
        return hook_tensors(self.model.parameters(), on_grad)

    def set_accumulation(self, micro_batches: int) -> None:
        """Accumulate ``micro_batches`` micro-batches per optimizer step from the next step on (the global batch grows
        with it), where :attr:`changes_accumulation` says the engine can; called between steps on every rank."""
        raise UserError(f"--strategy {self.cfg.strategy} cannot change its gradient accumulation during a run, which "
                        "--batch-ramp needs: drop --batch-ramp, or pick a strategy that can (docs/strategies.md)")

    def gradient_scale(self) -> float:
        """What this engine's backward multiplies a micro-batch's mean-loss gradient by: ``1 / grad_accum`` (the
        accumulated gradient is the mean over the step's micro-batches), times the fp16 loss scale if there is one.
        Read after a step's backward and before its optimizer step."""
        return 1.0 / self.train.grad_accum

    def weight_norm(self) -> torch.Tensor | None:
        """Global L2 norm of what a checkpoint saves of the model as the last step left it: the trainable weights
        and the floating buffers (BatchNorm statistics, :func:`with_buffers`); a 0-d tensor (perhaps on the device),
        NaN/inf when some value is. A collective: every rank calls it.

        The loop checks it after each step, so it must cost about one read of the local weights. This default reads
        ``self.model``'s parameters: whole replicas, or FSDP2's DTensor shards (:func:`tensor_norm`), and its
        buffers. None: this engine cannot tell now.
        """
        return with_buffers(tensor_norm([p for p in self.model.parameters() if p.requires_grad]), self.model)

    @abstractmethod
    def model_pieces(self) -> list[ModelPiece]:
        """The whole model's state dict, one tensor at a time: each piece's name (no wrapper prefixes, so the
        result loads into the bare model), shape and written dtype, and how to fetch it.

        Every rank calls every piece's ``fetch`` in order; writing the whole model then needs its largest tensor in
        memory, never all of them.
        """

    @abstractmethod
    def checkpoint_state(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` keyed by parameter names, as torch.distributed.checkpoint saves it.

        The layout is the same for every strategy (the one ``get_state_dict`` gives for a plain module
        and a torch optimizer), so a checkpoint written under one strategy and world size loads under
        any other; sharded tensors stay sharded and are resharded on load. A collective.
        """

    def checkpoint_load_target(self) -> dict[str, Any]:
        """The state a checkpoint is read into (the :meth:`checkpoint_state` layout), then given to
        :meth:`load_checkpoint_state`. Engines whose layout holds views of their own buffers are read into in place."""
        return self.checkpoint_state()

    @abstractmethod
    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Apply a state of the :meth:`checkpoint_state` layout, filled in place by the checkpoint reader."""

    def sync_buffers(self) -> None:  # noqa: B027 - optional hook: one process, or an engine that syncs itself
        """Give every rank rank 0's buffers (BatchNorm running statistics) before the model is evaluated or saved.

        Engines that do not replicate buffers (FSDP2, DeepSpeed) let each rank update its own copy; a training
        forward never reads them, so syncing only when the model is observed avoids a collective at every step.
        """

    def configure_for(self, model: nn.Module) -> None:  # noqa: B027 - optional hook
        """Adjust engine settings that depend on the model (called by ``setup``, and by memory estimates)."""

    @abstractmethod
    def state_layout(self) -> StateLayout:
        """How this engine stores parameters, gradients and optimizer state (the memory model's input);
        needs no process group, so memory can be estimated before launching."""

    def memory_report(self) -> StateBytes | None:
        """Bytes of parameters, gradients, optimizer state and engine buffers this rank held at its
        largest optimizer step, counted from the tensors (None before the first step)."""
        return self.meter.peak if self.meter is not None else None

    def engine_config(self) -> dict[str, Any] | None:
        """The engine's resolved configuration (the DeepSpeed JSON actually used), if any."""
        return None

    def teardown(self) -> None:  # noqa: B027 - optional hook, most engines need nothing
        """Release engine resources (the process group is torn down by the caller)."""
