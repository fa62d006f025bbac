"""The largest model each strategy can train under a per-rank memory budget.

    python -m benchmarks.max_model --world-size 2 --budget-gb 9 --out benchmarks/results/max-model-HOST-DATE
    scale-ocr max-model ...                                        # the same flags
    python -m benchmarks.max_model --width 2048 --depths 15 ...    # probe given depths only: does this size fit?

For each strategy, with activation checkpointing off and on, a binary search finds the deepest ViTSTR (at a
fixed ``--width``) that completes ``--steps`` real training steps when each rank may use ``--budget-gb``.
Every probe is a real job through the strategy's launcher, built by the scaling suite (same commands, the
same pre-rendered word cache, and on CPU the same per-process cap, RLIMIT_DATA; on GPU each rank caps its
device memory, ``--gpu-memory-cap-gb``); running out of memory is a
result, not an error. The search starts where the memory model predicts the largest fit (model state from
``scale_ocr.memory``, activations measured at depths 1 and 2 and extended linearly, a runtime margin), so
the report can say how far that prediction was from what fitted. ``--depths`` probes the depths given instead of
searching (e.g. one model too large for DDP, under every strategy).

On CPU the probes run with glibc's mmap threshold at 64 KiB (``MALLOC_MMAP_THRESHOLD_``, unless you set one), so
a rank's address space, which RLIMIT_DATA caps, follows its live tensors as a GPU budget follows the caching
allocator: ZeRO-3's per-parameter partitions (590 KB for a width-768 matrix on 2 ranks) otherwise fragment the
heap below scale_ocr's training default of 1 MiB (measured, ZeRO-3 at depth 39: peak 3.79 -> 3.50 GiB, same
tensors). The default stays 1 MiB for training because 64-512 KiB costs a CNN ~25% of its CPU throughput.

Writes ``results.jsonl`` (every probe), ``report.md`` (largest depth and parameters per strategy and
setting, ÷ DDP's, predicted largest, measured ÷ predicted, samples/s at the largest) and ``fits.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import max_model_report
from benchmarks.harness import (
    TRAIN,
    Config,
    hardware,
    launcher_for,
    measure,
    run_job,
    run_main,
    step_command,
    task_data,
    versions,
    work_dir,
    write_command,
)
from benchmarks.max_model_report import DEFAULT_LR, GIB, key, probes_of

PROBE_MMAP_THRESHOLD = 64 << 10  # bytes; see the module docstring
DEFAULT_STRATEGIES = ("ddp", "fsdp", "zero3")


@dataclass(frozen=True)
class Search:
    """One search's fixed settings; the depth is what varies."""

    arch: str = "vitstr_large"
    width: int = 1024
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    world_size: int = 2
    budget_gb: float = 9.0
    batch_size: int = 8
    steps: int = 3
    precision: str = "bf16"
    max_depth: int = 64
    checkpointing: tuple[bool, ...] = (False, True)
    timeout: int = 1800
    depths: tuple[int, ...] = ()  # probe exactly these depths instead of searching
    lr: float = DEFAULT_LR  # 1e-4: a 0.75B ViT at a global batch of 4 diverges at the trainer's default 1e-3
    samples: int | None = None  # words the probes train on (default: a fresh batch per step); fewer repeat
    saves: bool = True  # probes save as users' runs do (searches before issue 58's fix did not: their search.json
    # has no such key, and reads as False)


@dataclass
class Probe:
    """One job of a search: a line of results.jsonl."""

    strategy: str
    checkpointing: bool
    depth: int
    params: int
    status: str  # ok | oom | failed | timeout
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def search_largest(fits: Callable[[int], str], lo: int, hi: int, start: int) -> tuple[int, list[int]]:
    """Largest ``d`` in ``[lo, hi]`` with ``fits(d) == "ok"``, 0 if none; and the depths tried.

    ``fits`` is assumed monotone (a deeper model needs more memory). The search starts at ``start`` (the memory
    model's prediction) and moves away from it by a seventh of it, then by steps that double while the answer
    stays the same, then bisects: a prediction within 15% costs at most five probes, a wrong one a few more. \
A status other than ok or oom (a crash, a timeout) stops the search: the answer is then the largest
    depth known to fit.
    """
    good, bad, tried = lo - 1, hi + 1, []
    depth = min(max(start, lo), hi)
    stride, moves = max(1, round(depth / 7)), 0
    while bad - good > 1:
        tried.append(depth)
        status = fits(depth)
        if status == "ok":
            good = depth
        elif status == "oom":
            bad = depth
        else:
            break
        if bad > hi or good < lo:  # nothing too large (too small) yet: step up (down)
            depth = min(hi, good + stride) if bad > hi else max(lo, bad - stride)
            moves += 1
            stride *= 2 if moves > 1 else 1
        else:
            depth = (good + bad) // 2
    return max(good, 0), tried


def _task(s: Search, depth: int, checkpointing: bool):
    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    return create_task(ModelConfig(arch=s.arch, model_width=s.width, model_depth=depth,
                                   activation_checkpointing=checkpointing))


def _meta_size(s: Search, depth: int):
    import torch

    from scale_ocr.planning.estimate import model_size

    with torch.device("meta"):
        model = _task(s, depth, False).build_model()
    return model, model_size(model)


def activation_line(s: Search, checkpointing: bool) -> dict[bool, tuple[float, float]]:
    """Activations per rank as ``a + b * depth``, measured at depths 1 and 2 from real forwards; keyed by
    whether the engine's autocast casts fp32 weights (:class:`scale_ocr.planning.estimate.Activations`).

    With checkpointing, a unit's own activations come back during its backward: one block's worth (the
    difference without checkpointing) is added on top of the inputs checkpointing keeps.
    """
    import torch

    from scale_ocr.planning.estimate import measure_activations

    def measure_at(depth: int, ac: bool):
        task = _task(s, depth, ac)
        torch.manual_seed(0)
        return measure_activations(task.build_model(), task.dummy_inputs(s.batch_size), s.precision)

    plain1, plain2 = measure_at(1, False), measure_at(2, False)
    kept1, kept2 = (measure_at(1, True), measure_at(2, True)) if checkpointing else (plain1, plain2)
    lines = {}
    for casting, figure in ((True, "casting"), (False, "sixteen_bit")):
        p1, p2, k1, k2 = (getattr(m, figure) for m in (plain1, plain2, kept1, kept2))
        lines[casting] = (k1 - (k2 - k1) + (p2 - p1 if checkpointing else 0), k2 - k1)
    return lines


def predicted_need(s: Search, strategy: str, depth: int, acts: dict[bool, tuple[float, float]]) -> dict[str, float]:
    """Bytes a rank needs at ``depth``: the memory model's state + activations + a unit in flight + margin,
    as ``--strategy auto`` counts them (:func:`scale_ocr.planning.auto.rank_need`)."""
    from scale_ocr.planning.auto import rank_need
    from scale_ocr.planning.estimate import estimate

    model, size = _meta_size(s, depth)
    row = estimate(size, s.world_size, s.precision, [strategy], model=model)["strategies"][strategy]
    a, b = acts[row["casts_weights"]]
    need = rank_need(row, size.largest_layer, _on_gpu(), a + b * depth)
    return {"need": need, "model_state": row["model_state"], "params": size.params}


def predicted_largest(s: Search, strategy: str, acts: dict[bool, tuple[float, float]]) -> int:
    """Deepest model the memory model says fits the budget (0: not even one block)."""
    budget = s.budget_gb * GIB
    return search_largest(lambda d: "ok" if predicted_need(s, strategy, d, acts)["need"] <= budget else "oom",
                          1, s.max_depth, 1)[0]


def run_probe(s: Search, strategy: str, checkpointing: bool, depth: int, data_args: list[str], work: Path,
              wandb_mode: str) -> Probe:
    """One real training job at ``depth``; its status and measurements."""
    key = f"{strategy}{'-ac' if checkpointing else ''}-d{depth}"
    cfg = Config(s.arch, strategy, s.world_size, s.batch_size, 0, max(1, (os.cpu_count() or 1) // s.world_size),
                 launcher_for(strategy), s.precision)
    on_gpu = _on_gpu()
    flags = ["--model-width", str(s.width), "--model-depth", str(depth), "--lr", str(s.lr)]
    # What users run: a checkpoint mid-run, and at the end the final one and last_model.pt, all in the peak.
    flags += ["--save-every", str(max(1, s.steps - 1)), "--keep-last", "1"] if s.saves else ["--no-save-model"]
    flags += ["--activation-checkpointing"] if checkpointing else []
    flags += ["--gpu-memory-cap-gb", str(s.budget_gb)] if on_gpu else []  # on CPU: the runner caps each process
    run_dir = work / "runs" / key
    cmd = step_command(cfg, s.steps, data_args, flags, run_dir, "max-model", wandb_mode, profile_steps=0)
    status, error, wall = run_job(cmd, cfg.threads_per_rank, s.timeout, None if on_gpu else s.budget_gb)
    metrics: dict[str, Any] = {"wall_seconds": wall, "run_dir": str(run_dir),
                               "command": " ".join(cmd[cmd.index(str(TRAIN)):])}
    if status == "ok":
        try:
            metrics.update(measure(run_dir, 0, s.steps))
            records = _records(run_dir)
            metrics["losses"] = [r["train/loss"] for r in records if "train/loss" in r]
            metrics["peak_mean_bytes"] = records[-1].get("memory/peak_bytes_mean")  # over ranks, whole run
        except (OSError, ValueError, KeyError) as exc:
            status, error = "failed", f"unreadable metrics: {exc}"
    # Measured: what the probe saved is scratch (a 0.76B model's checkpoint and model file are 12 GB).
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    for model_file in run_dir.glob("*_model.pt"):
        model_file.unlink()
    return Probe(strategy, checkpointing, depth, _meta_size(s, depth)[1].params, status, error, metrics)


def _on_gpu() -> bool:
    """Whether probes run on GPUs: the budget is then each rank's device memory, capped by the job itself."""
    import torch

    return torch.cuda.is_available()


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def run_search(s: Search, out: Path, wandb_mode: str = "disabled", log=print, update: bool = False) -> Path:
    """Every strategy and checkpointing setting of ``s``; returns results.jsonl.

    ``update``: ``out`` holds a finished search with the same settings; only ``s.strategies`` x ``s.checkpointing``
    are searched again (after a fix that concerns them), their earlier probes replaced and the others kept, and
    search.json records the commit the update ran at.
    """
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    work = work_dir(out)
    data_args = task_data(_task(s, 1, False), work, s.samples or s.batch_size * s.world_size * s.steps, log)
    if not _on_gpu():
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(PROBE_MMAP_THRESHOLD))  # inherited by every probe
    ver = versions()
    if update:
        header = json.loads((out / "search.json").read_text())
        redo = {(st, ac) for st in s.strategies for ac in s.checkpointing}
        kept = [p for p in probes_of(results) if (p["strategy"], p["checkpointing"]) not in redo]
        results.write_text("".join(json.dumps(p) + "\n" for p in kept), encoding="utf-8")
        header.setdefault("updates", []).append({"strategies": list(s.strategies),
                                                 "checkpointing": list(s.checkpointing), "git": ver["git"]})
    else:
        if results.exists():
            results.unlink()
        header = {"search": asdict(s), "hardware": hardware(), "versions": ver,
                  "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
    (out / "search.json").write_text(json.dumps(header, indent=2) + "\n", encoding="utf-8")
    for checkpointing in s.checkpointing:
        acts = activation_line(s, checkpointing)
        for strategy in s.strategies:
            start = predicted_largest(s, strategy, acts)

            def fits(depth: int, strategy=strategy, checkpointing=checkpointing, start=start, acts=acts) -> str:
                probe = run_probe(s, strategy, checkpointing, depth, data_args, work, wandb_mode)
                probe.metrics["predicted"] = {**predicted_need(s, strategy, depth, acts), "largest_depth": start}
                with results.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(asdict(probe)) + "\n")
                log(f"max-model {strategy}{' +ac' if checkpointing else ''} depth {depth} "
                    f"({probe.params / 1e6:.0f}M): {probe.status}" + (f" ({probe.error})" if probe.error else ""))
                return probe.status

            if s.depths:
                largest, tried = max([d for d in s.depths if fits(d) == "ok"], default=0), list(s.depths)
            else:
                largest, tried = search_largest(fits, 1, s.max_depth, max(start, 1))
            log(f"max-model {strategy}{' +ac' if checkpointing else ''}: largest depth {largest} "
                f"(predicted {start}; tried {tried})")
    return results


def repredict(out: Path) -> Path:
    """Every prediction of a finished search, made again with this checkout's memory model (``predictions.json``;
    the report then shows these and says at which commit), so a corrected model is checked against probes that
    already ran instead of by running them again."""
    s = _search(json.loads((out / "search.json").read_text())["search"])
    probes = probes_of(out / "results.jsonl")
    doc: dict[str, Any] = {"git": versions()["git"], "largest": {}, "need": {}}
    for checkpointing in s.checkpointing:
        acts = activation_line(s, checkpointing)
        for strategy in s.strategies:
            doc["largest"][key(strategy, checkpointing)] = predicted_largest(s, strategy, acts)
        for p in probes:
            if p["checkpointing"] == checkpointing:
                need = predicted_need(s, p["strategy"], p["depth"], acts)["need"]
                doc["need"][key(p["strategy"], checkpointing, p["depth"])] = need
    path = out / "predictions.json"
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return path


def _search(fields: dict[str, Any]) -> Search:
    fields = {"saves": False, **fields}  # recorded before probes saved
    return Search(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def write_report(out: Path) -> Path:
    """report.md and fits.png of the finished search in ``out`` (:mod:`benchmarks.max_model_report`)."""
    return max_model_report.write_report(out, lambda fields, depth: _meta_size(_search(fields), depth)[1].params)


def parse(argv: list[str] | None) -> argparse.Namespace:
    d = Search()
    p = argparse.ArgumentParser(prog="python -m benchmarks.max_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default=d.arch, help="a model whose depth can be set (default %(default)s)")
    p.add_argument("--width", type=int, default=d.width, help="its width, fixed during the search")
    p.add_argument("--strategies", default=",".join(d.strategies), help="comma-separated")
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--budget-gb", type=float, default=d.budget_gb, help="memory per rank (CPU: a per-process cap; GPU: "
                   "each rank's device memory, --gpu-memory-cap-gb)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per-rank micro-batch")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps a probe must complete")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=d.precision)
    p.add_argument("--max-depth", type=int, default=d.max_depth)
    p.add_argument("--checkpointing", choices=["off", "on", "both"], default="both",
                   help="search without activation checkpointing, with it, or both (default)")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate of the probes (default %(default)s)")
    p.add_argument("--samples", type=int, default=None,
                   help="words the probes train on (default: a fresh batch for every step); one global batch makes "
                        "every step fit the same words, so the loss shows the updates work")
    p.add_argument("--depths", default="", help="comma-separated depths to probe instead of searching (e.g. 15)")
    p.add_argument("--timeout", type=int, default=d.timeout, help="seconds per probe before it counts as a timeout")
    p.add_argument("--out", type=Path, required=True, help="results directory")
    p.add_argument("--wandb-mode", default="disabled", choices=["offline", "online", "disabled"])
    p.add_argument("--repredict", action="store_true", help="run no probe: predict a finished search's sizes again "
                   "with this checkout's memory model and rewrite its report")
    p.add_argument("--update", action="store_true", help="search only --strategies and --checkpointing of the finished "
                   "search in --out again (after a fix that concerns them), with its other settings, keeping the rest")
    return p.parse_args(argv)


def search_from(args: argparse.Namespace) -> Search:
    """The search the flags ask for, checked (a :class:`UserError` names the flag); with ``--update``, the finished
    search in ``--out`` narrowed to the strategies and checkpointing settings given."""
    import torch

    from scale_ocr.errors import UserError
    from scale_ocr.models import accepts
    from scale_ocr.strategies import strategy_entry

    if torch.cuda.is_available() and args.world_size > torch.cuda.device_count():
        raise UserError(f"--world-size {args.world_size} needs as many GPUs; this host has {torch.cuda.device_count()}")
    if not accepts(args.arch, "depth"):
        raise UserError(f"--arch {args.arch}: its depth cannot be set; use a ViTSTR (vitstr_tiny ... vitstr_large)")
    strategies = tuple(args.strategies.split(","))
    for name in strategies:
        if strategy_entry(name).cls.max_world_size == 1 and args.world_size > 1:
            raise UserError(f"--strategies {name} runs in one process; leave it out for --world-size {args.world_size}")
    try:
        depths = tuple(int(d) for d in args.depths.split(",") if d.strip())
    except ValueError:
        raise UserError(f"--depths {args.depths!r}: give comma-separated whole numbers, e.g. --depths 12,15") from None
    if min(args.world_size, args.steps, args.max_depth, args.batch_size, *depths, args.samples or 1) < 1 \
            or args.budget_gb <= 0:
        raise UserError("--world-size, --steps, --max-depth, --batch-size, --samples and --depths must be at least 1, "
                        "--budget-gb positive")
    checkpointing = {"off": (False,), "on": (True,), "both": (False, True)}[args.checkpointing]
    if not args.update:
        return Search(args.arch, args.width, strategies, args.world_size, args.budget_gb, args.batch_size, args.steps,
                      args.precision, args.max_depth, checkpointing, args.timeout, depths, args.lr, args.samples)
    if not (args.out / "search.json").exists():
        raise UserError(f"--update: {args.out} holds no finished search (search.json); give its --out")
    first = _search(json.loads((args.out / "search.json").read_text())["search"])
    if set(strategies) - set(first.strategies) or not set(checkpointing) <= set(first.checkpointing):
        raise UserError(f"--update: --strategies {args.strategies} --checkpointing {args.checkpointing} is not part "
                        f"of the search in {args.out}; update a part of it")
    return dataclasses.replace(first, strategies=strategies, checkpointing=checkpointing, timeout=args.timeout)


def main(argv: list[str] | None = None) -> int:
    from scale_ocr.errors import UserError

    args = parse(argv)
    if args.repredict:
        if not (args.out / "results.jsonl").exists():
            raise UserError(f"--repredict: {args.out} holds no finished search (results.jsonl); give its --out")
        repredict(args.out)
    else:
        run_search(search_from(args), args.out, args.wandb_mode, update=args.update)
        if not args.update:
            write_command(args.out, "max_model")
        if args.update and (args.out / "predictions.json").exists():
            repredict(args.out)  # the re-measured probes need predictions from the model the others have
    print(f"max-model: report {write_report(args.out)}")
    return 0


if __name__ == "__main__":
    run_main(main)
