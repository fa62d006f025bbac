"""``scale-ocr estimate-memory``: per-rank memory of every strategy before launching anything.

Prints, per strategy, the engine model's parameters / gradients / optimizer state / engine buffers,
the ZeRO paper's ideal, DeepSpeed's own estimate for the DeepSpeed strategies, and optionally the
activations of one real forward at the given batch and input size.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scale_ocr.config import MODEL_SIZE_FIELDS, OptimConfig, StrategyConfig, TrainConfig
from scale_ocr.distributed import DistInfo
from scale_ocr.errors import UserError
from scale_ocr.memory.model import deepspeed_estimate, predict, step_peak

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
    """Bytes autograd saves in one training forward, per rank: ``casting`` where autocast multiplies fp32
    weights (and saves a 16-bit copy of each for the backward), ``sixteen_bit`` where the engine holds or
    gathers its weights in 16 bits (DeepSpeed bf16/fp16, FSDP's mixed-precision policy). Equal in fp32 runs."""

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

    Counted from the saved tensors themselves (distinct storages), so it is exact on any device and
    independent of allocator caching. ``weights_16bit``: the forward runs over a 16-bit copy of the weights,
    as an engine holding them so computes (:func:`scale_ocr.precision.compute_weight_dtype`).
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


def build_strategy(name: str, world: int, precision: str, ds_config: str | None):
    """A strategy object for its layout only: no process group, no model, nothing launched."""
    from scale_ocr.strategies import strategy_entry

    entry = strategy_entry(name)
    ranks = 1 if entry.cls.max_world_size == 1 else world
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist = DistInfo(0, ranks, 0, ranks, device, "nccl" if device.type == "cuda" else "gloo", "estimate")
    cfg = StrategyConfig(strategy=name, ds_config=ds_config if "preset" in entry.preset else None)
    return entry.cls(cfg, dist, TrainConfig(precision=precision), OptimConfig(), **entry.preset), ranks


def estimate(size: ModelSize, world: int, precision: str, strategies: list[str], ds_config: str | None = None,
             activations: Activations | None = None, model: nn.Module | None = None) -> dict[str, Any]:
    """Per-strategy predictions in bytes (the ``--json`` document); ``model``, when known, lets engines
    adapt to it as they will at set-up (DeepSpeed keeps fp32 weights for BatchNorm models). Each row's
    activations are the figure for its engine's weights (:meth:`Activations.under`)."""
    rows = {}
    for name in strategies:
        strategy, ranks = build_strategy(name, world, precision, ds_config)
        if model is not None:
            strategy.configure_for(model)
        layout = strategy.state_layout()
        pred = predict(layout, size.params, ranks)
        row: dict[str, Any] = {**pred.as_dict(), "world_size": ranks, "note": layout.note, "deepspeed": None,
                               "params_sharded": layout.params_sharded, "casts_weights": layout.casts_weights}
        if layout.master_bytes and layout.ideal_stage >= 2 and layout.mixed:  # DeepSpeed ZeRO-2/3, as its estimators assume
            host, dev = deepspeed_estimate(layout.ideal_stage, size.params, size.largest_layer, ranks,
                                           offload_optimizer="optimizer" in layout.host + layout.disk,
                                           offload_params="params" in layout.host + layout.disk)
            row["deepspeed"] = {"device": dev, "host": host}
        row["activations"] = activations.under(layout) if activations else None
        row["resident_state"] = pred.model_state + pred.other - pred.host - pred.disk
        row["grads_freed"] = layout.grads_freed
        row["total"] = step_peak(row["resident_state"], pred.grads, row["activations"] or 0, layout.grads_freed)
        rows[name] = row
    return {"params": size.params, "largest_layer": size.largest_layer, "world_size": world,
            "precision": precision, "strategies": rows}


def format_table(doc: dict[str, Any]) -> str:
    def gb(x):
        return "-" if x is None else f"{x / GB:.3f}"

    lines = [f"{doc['params'] / 1e6:.2f}M parameters (largest layer {doc['largest_layer'] / 1e6:.2f}M), "
             f"world size {doc['world_size']}, {doc['precision']}; GB (2^30 bytes) per rank",
             f"{'strategy':<14}{'params':>8}{'grads':>8}{'optim':>8}{'other':>8}{'state':>8}{'ideal':>8}"
             f"{'on host':>9}{'on disk':>9}{'activ.':>8}{'device':>8}{'DS est.':>9}"]
    for name, r in doc["strategies"].items():
        ds = r["deepspeed"]["device"] if r["deepspeed"] else None
        lines.append(f"{name:<14}{gb(r['params']):>8}{gb(r['grads']):>8}{gb(r['optimizer']):>8}{gb(r['other']):>8}"
                     f"{gb(r['model_state']):>8}{gb(r['ideal']):>8}{gb(r['host']):>9}{gb(r['disk']):>9}{gb(r['activations']):>8}"
                     f"{gb(r['total']):>8}{gb(ds):>9}")
    lines.append("state = params+grads+optim at the optimizer step; device = state + other - on host - on disk"
                 " + activations;"
                 " ideal = ZeRO paper; DS est. = DeepSpeed's estimator (device)")
    for name, r in doc["strategies"].items():
        if r["note"]:
            lines.append(f"  {name}: {r['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from scale_ocr.strategies import list_strategies

    p = argparse.ArgumentParser(prog="scale-ocr estimate-memory",
                                description="Per-rank memory of each strategy for a model, before launching.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="registered model name (built with random weights to count parameters)")
    what.add_argument("--params", type=float, help="parameter count, e.g. 85e6")
    p.add_argument("--largest-layer", type=float, default=0, help="with --params: largest layer's parameters")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--strategies", default=None, help="comma-separated (default: every registered strategy)")
    p.add_argument("--ds-config", default=None, help="DeepSpeed JSON for --strategy deepspeed")
    p.add_argument("--activations", action="store_true",
                   help="add activations measured from one real forward at --batch-size and --input-size")
    p.add_argument("--batch-size", type=int, default=32, help="per-device batch for --activations")
    p.add_argument("--input-size", default=None, help="HxW for --model and --activations (default: the model's task's)")
    p.add_argument("--model-width", type=int, default=None, help="with --model: override a scalable model's width")
    p.add_argument("--model-depth", type=int, default=None, help="with --model: override its depth (blocks)")
    p.add_argument("--model-heads", type=int, default=None, help="with --model: override its attention heads")
    p.add_argument("--mlp-ratio", type=float, default=None, help="with --model: override its MLP ratio")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="with --activations: measure them with activation checkpointing on")
    p.add_argument("--json", action="store_true", help="machine-readable output (bytes)")
    args = p.parse_args(argv)
    if args.world_size < 1:
        raise UserError("--world-size must be at least 1")
    names = args.strategies.split(",") if args.strategies else [
        n for n in list_strategies() if n != "deepspeed" or args.ds_config]
    try:
        size_hw = tuple(int(v) for v in args.input_size.lower().split("x")) if args.input_size else None
        if size_hw is not None and len(size_hw) != 2:
            raise ValueError
    except ValueError:
        raise UserError(f"--input-size {args.input_size!r}: expected HxW such as 32x128") from None
    acts, model = None, None
    if args.model:
        from scale_ocr.config import ModelConfig
        from scale_ocr.tasks import create_task

        task = create_task(ModelConfig(arch=args.model, input_size=size_hw, **{f: getattr(args, f) for f in MODEL_SIZE_FIELDS},
                                       activation_checkpointing=args.activation_checkpointing))
        # Counting needs no memory: on the meta device any size builds at once. A forward needs real weights.
        with torch.device("cpu" if args.activations else "meta"):
            model = task.build_model()
        size = model_size(model)
        if args.activations:
            acts = measure_activations(model, task.dummy_inputs(args.batch_size), args.precision)
    else:
        if args.activations:
            raise UserError("--activations needs --model (it runs one forward)")
        given = [f for f in MODEL_SIZE_FIELDS if getattr(args, f) is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} needs --model (it changes a registered model's size)")
        size = ModelSize(int(args.params), int(args.largest_layer))
    doc = estimate(size, args.world_size, args.precision, names, args.ds_config, acts, model)
    doc["model"] = args.model
    print(json.dumps(doc, indent=2) if args.json else format_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
