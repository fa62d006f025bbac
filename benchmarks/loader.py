"""Does the input pipeline keep up? Samples/s the loader delivers alone against what training consumes.

    python -m benchmarks.loader --out benchmarks/results/loader-HOST-DATE

One process plays rank 0 of a ``--world-size`` job on this host (its share of the data, ``cores / world size``
torch threads). For each data source the trainer reads, built by the task exactly as ``train.py`` builds it
(``task.build_data``), and each ``--workers`` setting, it times ``--batches`` batches of the training loader
after the first (workers starting, the first decode), over two passes where a source keeps what it rendered:

- ``synthetic``: words rendered on the fly with the default augmentations (the default recipe);
- ``synthetic-plain``: the same with ``--no-augment``, whose rendered words are kept (second pass: the memo);
- ``folder``: a docTR recognition folder (PNG files) with the default augmentations;
- ``folder-plain``: the same folder with ``--no-augment``;
- ``cache``: a ``--data-cache`` file of pre-rendered words (what the other benchmarks train on);
- ``shards``: the same folder written as a shard set (``scale-ocr make-shards``, 1000 words a shard), read by the
  shard reader (each worker reads its own shards whole, then decodes in order).

Rates are given per rank and per worker (``rank / max(workers, 1)``: with 0 workers the rank decodes itself).
This host has no GPU, and no ``benchmarks/gpu_check.sh`` report is committed, so what a GPU rank would consume is
an estimate with its basis stated: the model's training FLOPs per sample, 3x the forward's (the usual rule: the
backward costs twice the forward; torch's ``FlopCounterMode`` counts the forward on the measured batch, its count of
depthwise convolutions' backward is far too high to use), against an assumed sustained :data:`GPU_TFLOPS` (a
2-million-parameter CRNN of depthwise convolutions and a small LSTM at batch 32 runs far from any GPU's peak: 1
TFLOP/s is about 1.5% of an H100's fp32 peak). The report says how many loader workers of each source would feed
that rate; scale it by your GPU's measured rate (``benchmarks/gpu_check.sh``).

Training's consumption is measured in the same process: forward, CTC loss, backward and AdamW step of the
model on one fixed batch, with the same threads, i.e. what one rank would consume if it never waited and never
communicated (so the headroom reported is a lower bound). ``headroom = loader / training``: above 1 with
workers, loading hides behind training; with 0 workers loading runs between steps, and ``share`` is the part
of each step it takes, ``(1/loader) / (1/loader + 1/training)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.harness import (
    RECORD_FONTS,
    bench_main,
    hardware,
    parser,
    run_main,
    task_data,
    versions,
    work_dir,
    write_folder,
)

SOURCES = ("synthetic", "synthetic-plain", "folder", "folder-plain", "cache", "shards")
GPU_TFLOPS = 1.0  # assumed sustained training throughput of one GPU rank on this model (see the docstring)


def data_flags(source: str, folder: Path, cache: str, samples: int, shards: Path | None = None) -> list[str]:
    plain = ["--no-augment"] if source.endswith("-plain") else []
    if source == "shards":
        return ["--train-path", str(shards), "--val-path", str(shards)]
    if source.startswith("synthetic"):
        return ["--train-samples", str(samples), "--val-samples", "8", *RECORD_FONTS, *plain]
    if source.startswith("folder"):
        return ["--train-path", str(folder), "--val-path", str(folder), *plain]
    return ["--data-cache", cache]


def loader_rate(cfg, task, dist, batches: int, passes: int) -> list[float]:
    """Samples/s of each pass over ``batches`` batches (after one untimed batch in the first pass)."""
    data = task.build_data(cfg.data, cfg.train.batch_size, cfg.train.seed, dist)
    rates = []
    for epoch in range(passes):
        data.position.set_epoch(0)  # the same words again: a second pass sees what a source kept
        it = iter(data.train_loader)
        if epoch == 0:
            next(it)
        t0 = time.perf_counter()
        n = 0
        for _ in range(batches):
            n += len(next(it).words)
        rates.append(n / (time.perf_counter() - t0))
        del it
    return rates


def training_rate(cfg, task, dist, steps: int) -> tuple[float, float]:
    """Samples/s one rank's forward, loss, backward and fused AdamW step process on one batch of ``cfg``'s data, and
    the training FLOPs per sample: 3x the forward's, as torch counts them on that batch."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from scale_ocr.optim import build_optimizer_spec

    torch.manual_seed(0)
    model = task.build_model()
    opt = build_optimizer_spec(cfg.optim).build(model)
    batch = next(iter(task.build_data(cfg.data, cfg.train.batch_size, cfg.train.seed, dist).train_loader))
    inputs, batch_size = batch.inputs, len(batch.words)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        model(*inputs)["loss"].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    return batch_size / statistics.median(times), 3 * counter.get_total_flops() / batch_size


def run(args: argparse.Namespace) -> Path:
    """Training's rate, then each source's at each worker count, into ``args.out/results.json``."""
    import torch

    from scale_ocr.cli.args import parse_config
    from scale_ocr.distributed.process_group import DistInfo
    from scale_ocr.tasks import create_task

    hw = hardware()
    threads = max(1, (hw["cores"] or 1) // args.world_size)
    torch.set_num_threads(threads)
    args.out.mkdir(parents=True, exist_ok=True)
    work = work_dir(args.out)
    samples = args.batch_size * args.world_size * (args.batches + 1)
    dist = DistInfo(0, args.world_size, 0, args.world_size, torch.device("cpu"), "gloo", "python")
    base = [args.arch, "-b", str(args.batch_size), "--output-dir", str(work / "unused")]
    task = create_task(parse_config(base).model)
    folder = write_folder(work / f"folder-{samples}", samples, task.vocab.chars)
    shards = work / f"shards-{samples}"
    if "shards" in args.sources and not (shards / "shards.json").is_file():
        from scale_ocr.cli.make_shards import make_shards

        make_shards([folder], shards, "recognition", 1000, seed=0, on_bad="error")
    cache = task_data(task, work, samples)[1]
    train_sps, flops = training_rate(parse_config([*base, "--data-cache", cache]), task, dist, args.train_steps)
    gpu_sps = GPU_TFLOPS * 1e12 / flops
    print(f"loader: training consumes {train_sps:.1f} samples/s per rank ({threads} threads); {flops / 1e9:.3f} "
          f"GFLOP a sample, so about {gpu_sps:.0f} samples/s on a GPU rank at {GPU_TFLOPS:g} TFLOP/s", flush=True)
    rows = []
    for source in args.sources:
        for workers in args.workers:
            cfg = parse_config([*base, *data_flags(source, folder, cache, samples, shards), "--workers", str(workers)])
            rates = loader_rate(cfg, task, dist, args.batches, args.passes)
            rows.append({"source": source, "workers": workers, "loader_sps": rates, "train_sps": train_sps,
                         "per_worker_sps": [r / max(workers, 1) for r in rates],
                         "workers_for_gpu": gpu_sps / (max(rates) / max(workers, 1)),
                         "headroom": [r / train_sps for r in rates],
                         "serial_share": [(1 / r) / (1 / r + 1 / train_sps) for r in rates]})
            print(f"loader: {source}, {workers} workers: "
                  + ", ".join(f"pass {i + 1} {r:.1f}" for i, r in enumerate(rates))
                  + f" samples/s (headroom {max(rates) / train_sps:.2f})", flush=True)
    doc = {"arch": args.arch, "batch_size": args.batch_size, "world_size": args.world_size, "threads": threads,
           "flops_per_sample": flops, "gpu_tflops_assumed": GPU_TFLOPS, "gpu_sps_estimate": gpu_sps,
           "batches": args.batches, "hardware": hw, "versions": versions(), "rows": rows,
           "command": " ".join(["python -m benchmarks.loader", *sys.argv[1:]])}
    results = args.out / "results.json"
    results.write_text(json.dumps(doc, indent=1) + "\n")
    return results


def write_report(out_dir: Path) -> Path:
    doc = json.loads((out_dir / "results.json").read_text())
    hw, ver = doc["hardware"], doc["versions"]
    passes = len(doc["rows"][0]["loader_sps"]) if doc["rows"] else 0
    md = [f"# Input pipeline: {doc['arch']}, batch {doc['batch_size']} per rank, rank 0 of {doc['world_size']}, "
          f"{doc['threads']} torch threads", "",
          f"Command: `{doc['command']}`  ",
          f"Host: {hw['cpu']} ({hw['cores']} cores); git {ver.get('git')}, torch {ver.get('torch')}", "",
          f"Training consumes {doc['rows'][0]['train_sps']:.1f} samples/s per rank (forward, loss, backward, step on "
          "one fixed batch: no waiting, no communication). Headroom = loader samples/s / training samples/s; with 0 "
          "workers loading runs between steps and takes the step share given. Pass 2 reads the same words again "
          "(synthetic-plain: from the memo of rendered words).", ""]
    gpu = doc.get("gpu_sps_estimate")
    if gpu:
        md += [f"A GPU rank would consume about {gpu:.0f} samples/s: an estimate, not a measurement (no GPU here, no "
               f"gpu_check report committed): {doc['flops_per_sample'] / 1e9:.3f} GFLOP a training sample (3x the "
               f"forward torch's FlopCounterMode counts) at an assumed sustained {doc['gpu_tflops_assumed']:g} TFLOP/s "
               "(the basis: benchmarks/loader.py's docstring). "
               "'Workers for a GPU rank' divides it by the best pass's rate per worker.", ""]
    md += ["| source | workers | " + " | ".join(f"loader samples/s, pass {i + 1}" for i in range(passes))
           + " | per worker (best pass) | headroom (best pass) | share of a step if serial (pass 1 / last) "
           "| workers for a GPU rank |",
           "|---|---|" + "---|" * passes + "---|---|---|---|"]
    for r in doc["rows"]:
        per = max(r["per_worker_sps"]) if "per_worker_sps" in r else max(r["loader_sps"]) / max(r["workers"], 1)
        need = f"{r['workers_for_gpu']:.1f}" if "workers_for_gpu" in r else "–"
        md.append(f"| {r['source']} | {r['workers']} | " + " | ".join(f"{v:.1f}" for v in r["loader_sps"])
                  + f" | {per:.1f} | {max(r['headroom']):.2f} | {r['serial_share'][0]:.1%} / "
                  f"{r['serial_share'][-1]:.1%} | {need} |")
    report = out_dir / "report.md"
    report.write_text("\n".join(md) + "\n")
    return report


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("loader", __doc__, results="results.json")
    p.add_argument("--arch", default="crnn_mobilenet_v3_small")
    p.add_argument("--sources", default=",".join(SOURCES), help="comma-separated, from " + ",".join(SOURCES))
    p.add_argument("--workers", default="0,1", help="comma-separated loader worker counts")
    p.add_argument("--world-size", type=int, default=2, help="the job whose rank 0 is played")
    p.add_argument("-b", "--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--batches", type=int, default=20, help="timed batches per pass")
    p.add_argument("--passes", type=int, default=2, help="passes over the same words")
    p.add_argument("--train-steps", type=int, default=10, help="timed training steps")
    args = p.parse_args(argv)
    args.sources = tuple(s for s in args.sources.split(",") if s)
    args.workers = tuple(int(w) for w in args.workers.split(",") if w)
    return args


def check(args: argparse.Namespace) -> None:
    from scale_ocr.errors import UserError

    unknown = sorted(set(args.sources) - set(SOURCES))
    if unknown:
        raise UserError(f"--sources: {', '.join(unknown)} is not a source; choose from {', '.join(SOURCES)}")
    if args.batches < 1 or args.passes < 1 or args.world_size < 1 or any(w < 0 for w in args.workers):
        raise UserError("--batches, --passes and --world-size must be at least 1, --workers at least 0")


def main(argv: list[str] | None = None) -> int:
    return bench_main("loader", parse(argv), run, write_report, check)


if __name__ == "__main__":
    run_main(main)
