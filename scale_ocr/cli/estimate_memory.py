"""``scale-ocr estimate-memory``: per-rank memory of each strategy for a model, before launching.

The planner itself is :mod:`scale_ocr.planning.estimate`; this module is its command line and table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

import torch

from scale_ocr.cli.estimate_time import add_time_args, format_time, time_document, wants_time
from scale_ocr.config import MODEL_SIZE_FIELDS
from scale_ocr.errors import UserError
from scale_ocr.planning.estimate import GB, ModelSize, estimate, measure_activations, model_size


def format_table(doc: dict[str, Any]) -> str:
    def gb(x):
        return "-" if x is None else f"{x / GB:.3f}"

    lines = [f"{doc['params'] / 1e6:.2f}M parameters (largest layer {doc['largest_layer'] / 1e6:.2f}M), "
             f"world size {doc['world_size']}, {doc['precision']}; GB (2^30 bytes) per rank",
             f"{'strategy':<14}{'params':>8}{'grads':>8}{'optim':>8}{'other':>8}{'state':>8}{'ideal':>8}"
             f"{'on host':>9}{'on disk':>9}{'activ.':>8}{'save':>8}{'device':>8}{'DS est.':>9}"]
    for name, r in doc["strategies"].items():
        ds = r["deepspeed"]["device"] if r["deepspeed"] else None
        lines.append(f"{name:<14}{gb(r['params']):>8}{gb(r['grads']):>8}{gb(r['optimizer']):>8}{gb(r['other']):>8}"
                     f"{gb(r['model_state']):>8}{gb(r['ideal']):>8}{gb(r['host']):>9}{gb(r['disk']):>9}{gb(r['activations']):>8}"
                     f"{gb(r['save']):>8}{gb(r['total']):>8}{gb(ds):>9}")
    lines.append("state = params+grads+optim at the optimizer step; device = the larger of the step's peak (state + "
                 "other"
                 " - on host - on disk + staged + activations) and a save's (what stays between steps + the one tensor"
                 " a checkpoint or model file is written with: the largest layer, fp32, twice); ideal = ZeRO paper;"
                 " DS est. = DeepSpeed's estimator (device)")
    for name, r in doc["strategies"].items():
        if r["note"]:
            lines.append(f"  {name}: {r['note']}")
    for name, why in doc.get("skipped", {}).items():
        lines.append(f"  {name}: not estimated: {why}")
    return "\n".join(lines)


def _unbuildable(names: list[str], args: argparse.Namespace) -> dict[str, str]:
    """Of every registered strategy, those that cannot run at this world size (zero3_hpz on one rank per node),
    removed from ``names``, with the reason the table prints."""
    from scale_ocr.planning.estimate import build_strategy

    skipped = {}
    for name in list(names):
        try:
            build_strategy(name, args.world_size, args.precision, args.ds_config, args.shard_size)
        except UserError as exc:
            skipped[name] = str(exc)
            names.remove(name)
    return skipped


def _strategy_names(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The strategies to estimate, and of every registered one (no --strategies) those these sizes rule out."""
    from scale_ocr.strategies import list_strategies

    if args.world_size < 1:
        raise UserError("--world-size must be at least 1")
    if args.shard_size is not None and (args.shard_size < 1 or args.world_size % args.shard_size):
        raise UserError(f"--shard-size {args.shard_size} does not divide --world-size {args.world_size}; give a "
                        "divisor")
    if args.strategies:
        return args.strategies.split(","), {}
    names = [n for n in list_strategies() if n != "deepspeed" or args.ds_config]
    return names, _unbuildable(names, args)


def main(argv: list[str] | None = None) -> int:
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
    p.add_argument("--shard-size", type=int, default=None, metavar="N",
                   help="ranks per node, which hsdp and zero3_hpz shard within (default: the world size, one node)")
    p.add_argument("--activations", action="store_true",
                   help="add activations measured from one real forward at --batch-size and --input-size")
    p.add_argument("--batch-size", type=int, default=32, help="per-device batch for --activations and --time")
    p.add_argument("--input-size", default=None, help="HxW for --model and --activations (default: the model's task's)")
    p.add_argument("--model-width", type=int, default=None, help="with --model: override a scalable model's width")
    p.add_argument("--model-depth", type=int, default=None, help="with --model: override its depth (blocks)")
    p.add_argument("--model-heads", type=int, default=None, help="with --model: override its attention heads")
    p.add_argument("--mlp-ratio", type=float, default=None, help="with --model: override its MLP ratio")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="with --activations: measure them with activation checkpointing on")
    p.add_argument("--json", action="store_true", help="machine-readable output (bytes, seconds)")
    add_time_args(p)
    args = p.parse_args(argv)
    if args.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    # Engines' own import-time lines (DeepSpeed logs to stdout) go to stderr, so that --json prints JSON alone.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        doc, task, size = _document(args)
        if wants_time(args):
            doc["time"] = time_document(args, task, size, list(doc["strategies"]))
    text = format_table(doc) + ("\n\n" + format_time(doc["time"]) if "time" in doc else "")
    print(json.dumps(doc, indent=2) if args.json else text)
    return 0


def _document(args: argparse.Namespace) -> tuple[dict[str, Any], Any, ModelSize]:
    """The estimate for parsed ``args``: :func:`~scale_ocr.planning.estimate.estimate`'s document, the model's task
    (None with ``--params``) and its size."""
    names, skipped = _strategy_names(args)
    try:
        size_hw = tuple(int(v) for v in args.input_size.lower().split("x")) if args.input_size else None
        if size_hw is not None and len(size_hw) != 2:
            raise ValueError
    except ValueError:
        raise UserError(f"--input-size {args.input_size!r}: expected HxW such as 32x128") from None
    acts, model, task = None, None, None
    if args.model:
        from scale_ocr.config import ModelConfig
        from scale_ocr.tasks import create_task

        sizes = {f: getattr(args, f) for f in MODEL_SIZE_FIELDS}
        task = create_task(ModelConfig(arch=args.model, input_size=size_hw, **sizes,
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
    doc = estimate(size, args.world_size, args.precision, names, args.ds_config, acts, model, args.shard_size)
    return {**doc, "model": args.model, "skipped": skipped}, task, size


if __name__ == "__main__":
    sys.exit(main())
