"""What a training step costs in one process under each input layout and with torch.compile.

    python -m benchmarks.compute --out benchmarks/results/compute-HOST-DATE
    python -m benchmarks.compute --models crnn_mobilenet_v3_small --variants nchw,channels-last-images --compile ...
    python -m benchmarks.compute --report DIR     # rebuild report.md from results.jsonl

Each model (``ARCH:HxW:BATCH``) is built through its task at that input size and trained on one random batch
(``task.dummy_inputs``): forward, the task's loss, backward and a fused AdamW step. Every variant of the model
is built with the same seed and the variants are interleaved step by step (round 1: each variant one step, round
2: again, ...), so the host's drift falls on all of them; the report gives each variant's median step time over
``--steps`` rounds after ``--warmup`` untimed steps, and its change against NCHW eager. The variants:

- ``nchw``: eager, weights and images in torch's default (NCHW) layout;
- ``channels-last``: weights and images channels-last (NHWC);
- ``channels-last-images``: only the images channels-last, as scale_ocr's trainer feeds CNNs by default (a
  forward pre-hook; DeepSpeed flattens parameters, so weights cannot stay NHWC under every engine);
- ``compiled``: ``channels-last`` through ``torch.compile`` (``--compile-backend``, inductor by default);
- ``compiled-nchw``: ``nchw`` through ``torch.compile``.

``--compile`` adds ``compiled`` to ``--variants``. The warm-up's seconds are recorded too: for a compiled
variant they are the compilation. One process with ``--threads`` threads (default 1: one rank of a 2-rank job
on a 2-core host) measures the step alone: no data loading, no communication.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    append_line,
    bench_main,
    command_line,
    hardware,
    load,
    parser,
    run_main,
    versions,
    write_command,
    write_outputs,
)

VARIANTS = ("nchw", "channels-last", "channels-last-images", "compiled", "compiled-nchw")
MODELS = "crnn_mobilenet_v3_small:32x128:32,crnn_vgg16_bn:32x128:32,db_mobilenet_v3_large:256x256:4"


def model_spec(text: str) -> tuple[str, str | None, int]:
    """``ARCH[:HxW[:BATCH]]`` as (arch, input size or None for the model's own, batch; default 32)."""
    arch, size, batch = (text.split(":") + [None, None])[:3]
    return arch, size or None, int(batch or 32)


def build(arch: str, size: str | None, variant: str, backend: str):
    """The model of one variant, its fused AdamW, and whether its images go channels-last."""
    import torch

    from scale_ocr.cli.args import parse_config
    from scale_ocr.tasks import create_task

    task = create_task(parse_config([arch, *(["--input-size", size] if size else []),
                                     "--output-dir", "/tmp/unused"]).model)
    torch.manual_seed(0)
    model = task.create_model()  # bare: no channels-last hook, each variant converts explicitly
    if variant in ("channels-last", "compiled"):
        model = model.to(memory_format=torch.channels_last)
    if variant.startswith("compiled"):
        model.compile(backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return task, model, optimizer, variant != "nchw" and variant != "compiled-nchw"


def step(model, optimizer, inputs: tuple, images_last: bool) -> float:
    """One training step; its seconds."""
    import torch

    t0 = time.perf_counter()
    args = list(inputs)
    if images_last:
        args[0] = args[0].contiguous(memory_format=torch.channels_last)
    model(*args)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - t0


def measure_model(spec: str, variants: tuple[str, ...], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant of one model, interleaved step by step: one result line per variant."""
    arch, size, batch = model_spec(spec)
    built = {v: build(arch, size, v, args.compile_backend) for v in variants}
    inputs = next(iter(built.values()))[0].dummy_inputs(batch)
    warm = {}
    for v, (_, model, optimizer, last) in built.items():
        warm[v] = sum(step(model, optimizer, inputs, last) for _ in range(args.warmup))
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.steps):
        for v, (_, model, optimizer, last) in built.items():
            times[v].append(step(model, optimizer, inputs, last))
    task = next(iter(built.values()))[0]
    h, w = task.input_size
    return [{"model": arch, "input_size": f"{h}x{w}", "batch_size": batch, "variant": v, "threads": args.threads,
             "warmup": args.warmup, "steps": args.steps, "warmup_seconds": round(warm[v], 3),
             "median_ms": 1000 * statistics.median(times[v]), "min_ms": 1000 * min(times[v]),
             "step_ms": [round(1000 * t, 2) for t in times[v]],
             "compile_backend": args.compile_backend if v.startswith("compiled") else None} for v in variants]


def run(args: argparse.Namespace) -> Path:
    """Each model's variants into ``args.out/results.jsonl``."""
    import torch

    torch.set_num_threads(args.threads)
    hw, ver = hardware(), versions()
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    results.unlink(missing_ok=True)
    for spec in args.models:
        for line in measure_model(spec, args.variants, args):
            append_line(results, {**line, "versions": ver, "hardware": hw})
            print(f"compute {line['model']} b{line['batch_size']} {line['variant']}: median "
                  f"{line['median_ms']:.1f} ms (warm-up {line['warmup_seconds']:.1f} s)", flush=True)
    write_command(args.out, "compute")
    return results


def summarize(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model and variant: the median step and its change against the same model's NCHW eager step."""
    base = {x["model"]: x["median_ms"] for x in lines if x["variant"] == "nchw"}
    return [{"model": x["model"], "input_size": x["input_size"], "batch_size": x["batch_size"],
             "variant": x["variant"], "median_ms": x["median_ms"], "min_ms": x["min_ms"],
             "warmup_seconds": x["warmup_seconds"],
             "vs_nchw": x["median_ms"] / base[x["model"]] - 1 if x["model"] in base else None} for x in lines]


def write_report(out_dir: Path) -> Path:
    lines = load(out_dir, "benchmarks.compute")
    rows = summarize(lines)
    first = lines[0]
    hw, ver = first["hardware"], first["versions"]
    md = [f"# Compute: one training step in one process, {first['threads']} thread(s), variants interleaved", "",
          f"Command: `{command_line(out_dir)}`  ",
          f"Host: {hw['cpu']} ({hw['cores']} cores), {', '.join(hw['gpus']) or 'no GPU'}; git {ver.get('git')}, "
          f"torch {ver.get('torch')}", "",
          f"Forward, loss, backward and fused AdamW on one random batch; median over {first['steps']} interleaved "
          f"rounds after {first['warmup']} untimed steps per variant (their seconds: the warm-up column, for a "
          "compiled variant its compilation).", "",
          "| model | input, batch | variant | median step ms | min ms | vs NCHW eager | warm-up s |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        change = f"{r['vs_nchw']:+.0%}" if r["vs_nchw"] is not None and r["variant"] != "nchw" else "-"
        md.append(f"| {r['model']} | {r['input_size']}, b {r['batch_size']} | {r['variant']} | {r['median_ms']:.1f} | "
                  f"{r['min_ms']:.1f} | {change} | {r['warmup_seconds']:.1f} |")
    return write_outputs(out_dir, rows, md)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("compute", __doc__)
    p.add_argument("--models", default=MODELS, help="comma-separated ARCH[:HxW[:BATCH]] (default %(default)s)")
    p.add_argument("--variants", default="nchw,channels-last,channels-last-images",
                   help="comma-separated, from " + ",".join(VARIANTS))
    p.add_argument("--compile", action="store_true", help="add the compiled variant (channels-last, torch.compile)")
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--threads", type=int, default=1, help="torch threads of the one process")
    p.add_argument("--steps", type=int, default=20, help="timed rounds (each variant one step per round)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    args = p.parse_args(argv)
    args.models = tuple(m for m in args.models.split(",") if m)
    args.variants = tuple(dict.fromkeys([v for v in args.variants.split(",") if v] + (["compiled"] if args.compile
                                                                                        else [])))
    return args


def check(args: argparse.Namespace) -> None:
    from scale_ocr.errors import UserError
    from scale_ocr.models import list_models

    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        raise UserError(f"--variants: {', '.join(unknown)} is not a variant; choose from {', '.join(VARIANTS)}")
    for spec in args.models:
        try:
            arch, _, batch = model_spec(spec)
        except ValueError:
            raise UserError(f"--models {spec!r}: give ARCH[:HxW[:BATCH]], e.g. crnn_vgg16_bn:32x128:32") from None
        if arch not in list_models() or batch < 1:
            raise UserError(f"--models {spec!r}: unknown model or batch below 1; models: {', '.join(list_models())}")
    if args.steps < 1 or args.warmup < 1 or args.threads < 1:
        raise UserError("--steps, --warmup and --threads must be at least 1")


def main(argv: list[str] | None = None) -> int:
    return bench_main("compute", parse(argv), run, write_report, check)


if __name__ == "__main__":
    run_main(main)
