"""Per-rank memory of every strategy before launching anything (``scale-ocr estimate-memory``, ``--strategy auto``).

Each strategy's engine is described (no process group) and the memory model (:mod:`scale_ocr.memory`) applied to
it; DeepSpeed's own estimate and one real forward's activations come beside (docs/memory.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scale_ocr.config import OptimConfig, StrategyConfig, TrainConfig
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.memory.model import deepspeed_estimate, predict, save_peak, step_peak

GB = 2**30  # DeepSpeed's estimators print GB as 2**30 bytes; we use the same unit so the numbers compare


@dataclass(frozen=True)
class ModelSize:
    """Parameter count and largest layer (parameters of one module, DeepSpeed's ``model_to_params``)."""

    params: int
    largest_layer: int


def model_size(model: nn.Module) -> ModelSize:
    """Also of a model on the meta device (no storage: told apart by identity) or partitioned by ZeRO-3."""
    from scale_ocr.models.init import full_numel

    total = sum({p.data_ptr() or id(p): full_numel(p) for p in model.parameters()}.values())  # shared weights once
    largest = max((sum(full_numel(p) for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return ModelSize(total, largest)


@dataclass(frozen=True)
class Activations:
    """Bytes autograd saves in one training forward, per rank: ``casting`` where autocast casts fp32 weights (and
    saves a 16-bit copy of each), ``sixteen_bit`` where the engine holds or gathers 16-bit weights."""

    casting: int
    sixteen_bit: int

    def under(self, layout) -> int:
        """The figure for an engine's :class:`~scale_ocr.memory.model.StateLayout`."""
        return self.casting if layout.casts_weights else self.sixteen_bit


def measure_activations(model: nn.Module, inputs: tuple[torch.Tensor, ...], precision: str) -> Activations:
    """Both figures of :class:`Activations` for ``model`` (two forwards when the run is 16-bit)."""
    from scale_ocr.precision import compute_weight_dtype

    casting = activation_bytes(model, inputs, precision)
    if compute_weight_dtype(precision, model) is None:
        return Activations(casting, casting)
    return Activations(casting, activation_bytes(model, inputs, precision, weights_16bit=True))


def activation_bytes(model: nn.Module, inputs: tuple[torch.Tensor, ...], precision: str,
                     weights_16bit: bool = False) -> int:
    """Bytes autograd saves for backward in one training forward of ``inputs`` (a task's dummy batch, per rank).

    Counted from the saved tensors themselves (distinct storages): exact on any device, whatever the allocator
    caches. ``weights_16bit``: the forward runs over a 16-bit copy of the weights, as an engine holding them does.
    """
    import copy

    from scale_ocr.precision import autocast_factory, compute_weight_dtype

    dtype = compute_weight_dtype(precision, model) if weights_16bit else None
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype)
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # Weights, and views of them (addmm saves a 16-bit weight's transpose), are model state, counted elsewhere.
        ptr = t.untyped_storage().data_ptr()
        if not isinstance(t, nn.Parameter) and ptr not in weights:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_factory(precision, inputs[0].device)():
        out = model(*inputs)
    del out
    return sum(storages.values())


def build_strategy(name: str, world: int, precision: str, ds_config: str | None, ranks_per_node: int | None = None):
    """A strategy object for its layout only: no process group, no model, nothing launched. ``ranks_per_node``
    (default: all ranks on one node) is what hybrid strategies (hsdp, zero3_hpz) shard over by default."""
    from scale_ocr.strategies import strategy_entry

    entry = strategy_entry(name)
    ranks = 1 if entry.cls.max_world_size == 1 else world
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist = DistInfo(0, ranks, 0, min(ranks_per_node or ranks, ranks), device,
                    "nccl" if device.type == "cuda" else "gloo", "estimate")
    cfg = StrategyConfig(strategy=name, ds_config=ds_config if entry.cls.reads_ds_config else None)
    return entry.cls(cfg, dist, TrainConfig(precision=precision), OptimConfig(), **entry.preset), ranks


def peaks(pred, layout, largest_layer: int, activations: float) -> tuple[float, float]:
    """A device's peak bytes at the optimizer step (``pred``'s state and gradients, and ``activations``) and while
    a checkpoint is saved, under ``layout``'s engine."""
    return (step_peak(pred.resident, pred.grads, activations, layout.grads_freed),
            save_peak(pred.resident, pred.grads, largest_layer, layout.grads_freed))


def estimate(size: ModelSize, world: int, precision: str, strategies: list[str], ds_config: str | None = None,
             activations: Activations | None = None, model: nn.Module | None = None,
             ranks_per_node: int | None = None) -> dict[str, Any]:
    """Per-strategy predictions in bytes (the ``--json`` document); ``model``, when known, lets engines adapt to it as
    they will at set-up (DeepSpeed keeps fp32 weights for BatchNorm models)."""
    rows = {}
    for name in strategies:
        strategy, ranks = build_strategy(name, world, precision, ds_config, ranks_per_node)
        if model is not None:
            strategy.configure_for(model)
        layout = strategy.state_layout()
        pred = predict(layout, size.params, ranks)
        row: dict[str, Any] = {**pred.as_dict(), "world_size": ranks, "shard_group": layout.shard_group,
                               "note": layout.note, "deepspeed": None,
                               "params_sharded": layout.params_sharded, "casts_weights": layout.casts_weights}
        # DeepSpeed ZeRO-2/3, as its estimators assume
        if layout.master_bytes and layout.ideal_stage >= 2 and layout.mixed:
            host, dev = deepspeed_estimate(layout.ideal_stage, size.params, size.largest_layer, ranks,
                                           offload_optimizer="optimizer" in layout.host + layout.disk,
                                           offload_params="params" in layout.host + layout.disk)
            row["deepspeed"] = {"device": dev, "host": host}
        row["activations"] = activations.under(layout) if activations else None
        row["resident_state"] = pred.resident
        row["grads_freed"] = layout.grads_freed
        row["step"], row["save"] = peaks(pred, layout, size.largest_layer, row["activations"] or 0)
        row["total"] = max(row["step"], row["save"])
        rows[name] = row
    return {"params": size.params, "largest_layer": size.largest_layer, "world_size": world,
            "ranks_per_node": min(ranks_per_node or world, world), "precision": precision, "strategies": rows}
