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

from scale_ocr.cli.args import _OneLineParser
from scale_ocr.cli.estimate_time import add_time_args, format_time, row, time_document, wants_time
from scale_ocr.config import MODEL_SIZE_FIELDS
from scale_ocr.errors import UserError, report_user_errors, say, shown
from scale_ocr.planning.estimate import GB, ModelSize, estimate, measure_activations, model_size


def format_table(doc: dict[str, Any]) -> str:
    def gb(x):
        return "-" if x is None else f"{x / GB:.3f}" if abs(x / GB) < 1e5 else f"{x / GB:.3g}"

    widths = [8, 8, 8, 8, 8, 8, 9, 9, 8, 8, 8, 9]
    def millions(n):
        return f"{n / 1e6:.2f}M" if n < 1e11 else f"{n / 1e6:.3g}M"

    lines = [f"{millions(doc['params'])} parameters (largest layer {millions(doc['largest_layer'])}), "
             f"world size {doc['world_size']}, {doc['precision']}; GB (2^30 bytes) per rank",
             row("strategy", ["params", "grads", "optim", "other", "state", "ideal", "on host", "on disk", "activ.",
                              "save", "device", "DS est."], widths)]
    for name, r in doc["strategies"].items():
        ds = r["deepspeed"]["device"] if r["deepspeed"] else None
        keys = ("params", "grads", "optimizer", "other", "model_state", "ideal", "host", "disk", "activations", "save",
                "total")
        lines.append(row(name, [gb(r[k]) for k in keys] + [gb(ds)], widths))
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

    if args.shard_size is not None and (args.shard_size < 1 or args.world_size % args.shard_size):
        raise UserError(f"--shard-size {args.shard_size} does not divide --world-size {args.world_size}; give a "
                        "divisor")
    if args.strategies:
        return args.strategies.split(","), {}
    names = [n for n in list_strategies() if n != "deepspeed" or args.ds_config]
    return names, _unbuildable(names, args)


MAX_PARAMS = 1e15  # a thousand times the largest models trained: a bigger count is a typo
MAX_RANKS = 10**9
MAX_FLOPS_PER_SAMPLE = 1e24


def _in_range(args: argparse.Namespace, flag: str, low: float, high: float, low_open: bool, example: str) -> None:
    """``--flag``'s value (when given) a finite number in [low, high] ((low, high] with ``low_open``), else one
    line; NaN fails every comparison, so it is refused too."""
    value = getattr(args, flag.replace("-", "_"))
    if value is None or (low < value if low_open else low <= value) and value <= high:
        return
    bound = f"above {low:g} and at most {high:g}" if low_open else f"from {low:g} to {high:g}"
    text = f"{value:g}" if isinstance(value, float) else shown(value)  # an int may be past any float
    raise UserError(f"--{flag} {text} is not a number {bound}; give e.g. --{flag} {example}")


def check_numbers(args: argparse.Namespace) -> None:
    """Every number estimate-memory takes, in range before anything is built or predicted: a negative or NaN size
    would give negative or NaN gigabytes and milliseconds, with exit 0."""
    if args.world_size < 1:
        raise UserError("--world-size must be at least 1")
    if args.batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    _in_range(args, "params", 1, MAX_PARAMS, False, "85e6")
    _in_range(args, "largest-layer", 0, args.params if args.params is not None else MAX_PARAMS, False,
              "1e6 (at most --params)")
    for flag in ("world-size", "batch-size", "per-node", "shard-size", "model-width", "model-depth", "model-heads"):
        _in_range(args, flag, 1, MAX_RANKS, False, "8")
    _in_range(args, "mlp-ratio", 0, 64, True, "4")
    _in_range(args, "mfu", 0, 1, True, "0.4")
    _in_range(args, "flops-per-sample", 0, MAX_FLOPS_PER_SAMPLE, True, "3e9")


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    p = _OneLineParser(prog="scale-ocr estimate-memory",
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
    check_numbers(args)
    # Engines' own import-time lines (DeepSpeed logs to stdout) go to stderr, so that --json prints JSON alone.
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        doc, task, size = _document(args)
        if wants_time(args):
            doc["time"] = time_document(args, task, size, list(doc["strategies"]))
    text = format_table(doc) + ("\n\n" + format_time(doc["time"]) if "time" in doc else "")
    say(json.dumps(doc, indent=2) if args.json else text)
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
