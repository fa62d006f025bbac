"""``scale-ocr evaluate MODEL DIR...``: a trained model measured on labelled folders or a shard set, as its run's
validation measures it (a recognizer: exact match, exact match ignoring case, CER; a detector: box recall,
precision and mean IoU at its own page scale), without training anything."""

from __future__ import annotations

import argparse
import contextlib
import json

from scale_ocr.config import BAD_SAMPLE_POLICIES
from scale_ocr.errors import UserError, say


def evaluate(model_path: str, paths: list[str], batch_size: int = 64, on_bad_sample: str = "error") -> dict:
    """The model's metrics on ``paths`` (its task's folders or one shard set), with the samples measured and
    skipped."""
    import torch
    from torch.utils.data import DataLoader

    from scale_ocr.checkpoint.export import load_any
    from scale_ocr.data.loader import EvalShard

    loaded = load_any(model_path)
    data, collate = loaded.task.eval_set(tuple(paths), on_bad_sample)
    loader = DataLoader(EvalShard(data, 0, 1), batch_size=batch_size, collate_fn=collate)
    device = next(loaded.model.parameters()).device
    with torch.no_grad():
        result = loaded.task.evaluate(loaded.model, loader, device, contextlib.nullcontext)
    report = getattr(data, "report", None)
    return {"model": str(model_path), "arch": loaded.arch, "samples": len(data),
            "skipped": dict(report.skipped) if report else {}, **result.metrics}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="scale-ocr evaluate", description=__doc__.split("``:", 1)[1].strip())
    p.add_argument("model", metavar="MODEL", help="a checkpoint or run folder, a .safetensors export, or a run's "
                   "best_model.pt / last_model.pt")
    p.add_argument("paths", nargs="+", metavar="DIR", help="docTR folders of the model's task, or one shard set")
    p.add_argument("-b", "--batch-size", type=int, default=64)
    p.add_argument("--on-bad-sample", choices=BAD_SAMPLE_POLICIES, default="error",
                   help="a bad labelled sample stops it (error) or is skipped and counted (skip)")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    args = p.parse_args(argv)
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: use at least 1")
    m = evaluate(args.model, args.paths, args.batch_size, args.on_bad_sample)
    if args.json:
        say(json.dumps(m))
        return 0
    for key, value in m.items():
        say(f"{key:<22} {value:.4f}" if isinstance(value, float) else f"{key:<22} {value}")
    return 0
