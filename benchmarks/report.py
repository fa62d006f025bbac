"""Build a benchmark report from ``results.jsonl`` alone.

    python -m benchmarks.report benchmarks/results/quick-HOST-DATE [--wandb offline]

Writes ``report.md`` and PNG plots next to ``results.jsonl``: throughput against world size per
strategy, per-rank model state stacked by kind, and ratios to the DataParallel baseline. The same
input always gives the same files.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from benchmarks.harness import load, run_main, work_dir

MIB = 2**20
KINDS = ("params", "grads", "optimizer", "other")
#: The time breakdown's parts (metrics.json's time_breakdown, docs/time-breakdown.md), in stacking order.
PARTS = {"compute": "compute", "exposed_comm": "exposed communication", "data": "data wait",
         "optimizer": "optimizer", "other": "other"}
#: The peak-memory breakdown's parts (metrics.json's memory_breakdown, docs/memory.md "At the peak"), in stacking
#: order: on CPU the peak RSS splits into the runtime, model state, engine buffers, activations and heap; on GPU the
#: peak reserved into model state, engine buffers, activations, temporaries and the allocator's cache.
MEMORY_PARTS = {"runtime": "runtime", "model_state": "model state", "engine_buffers": "engine buffers",
                "activations": "activations", "heap": "heap (freed, temporaries)", "temporaries": "temporaries",
                "allocator": "allocator cache"}


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r["metrics"][key] for r in rows if r["status"] == "ok" and r["metrics"].get(key) is not None]
    return statistics.median(vals) if vals else None


def _time(rows: list[dict[str, Any]]) -> dict[str, float | None] | None:
    """Median seconds per timed step of each part of the time breakdown over the repeats that have one."""
    found = [r["metrics"]["time_breakdown"] for r in rows if r["status"] == "ok" and r["metrics"].get("time_breakdown")]
    if not found:
        return None
    return {k: statistics.median(vals) if (vals := [b[k] for b in found if b.get(k) is not None]) else None
            for k in (*PARTS, "sum_seconds")}


def _memory(rows: list[dict[str, Any]]) -> dict[str, float | None] | None:
    """Median bytes of each part of the peak-memory breakdown over the repeats that have one."""
    found = [r["metrics"]["memory_breakdown"] for r in rows
             if r["status"] == "ok" and r["metrics"].get("memory_breakdown")]
    if not found:
        return None
    keys = [k for k in (*MEMORY_PARTS, "peak_rss", "peak_reserved") if any(k in b for b in found)]
    return {k: statistics.median(vals) if (vals := [b[k] for b in found if b.get(k) is not None]) else None
            for k in keys}


def aggregate(results: list[dict[str, Any]]) -> dict[str, dict[tuple[str, int], dict[str, Any]]]:
    """model -> (strategy, world size) -> figures, medians over repeats."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        c = r["config"]
        groups[(c["model"], c["strategy"], c["world_size"])].append(r)
    table: dict[str, dict[tuple[str, int], dict[str, Any]]] = defaultdict(dict)
    for (model, strategy, ws), rows in groups.items():
        ok = [r for r in rows if r["status"] == "ok"]
        first = (ok or rows)[0]
        state = first["metrics"].get("state_bytes") if ok else None
        table[model][(strategy, ws)] = {
            "status": "ok" if ok else rows[0]["status"], "error": None if ok else rows[0]["error"],
            "repeats": len(ok), "config": first["config"],
            "sps": _median(rows, "samples_per_sec"), "sps_p25": _median(rows, "samples_per_sec_p25"),
            "sps_p75": _median(rows, "samples_per_sec_p75"), "p50": _median(rows, "step_time_p50"),
            "p95": _median(rows, "step_time_p95"), "peak": _median(rows, "peak_memory_bytes"),
            "reserved": _median(rows, "peak_reserved_bytes"), "state": state,
            "predicted": first["metrics"].get("predicted"), "ratio": _median(rows, "measured_over_predicted"),
            "tflops": _median(rows, "achieved_tflops"), "mfu": _median(rows, "mfu"),
            "peak_flops": first["metrics"].get("peak_flops") if ok else None,  # MFU's denominator and its source
            "comm": _median(rows, "comm_share"), "time": _time(rows), "memory": _memory(rows),
        }
    return table


def _order(cells: dict[tuple[str, int], dict[str, Any]]) -> list[tuple[str, int]]:
    strategies = list(dict.fromkeys(c["config"]["strategy"] for c in cells.values()))
    return sorted(cells, key=lambda k: (strategies.index(k[0]), k[1]))


def _fmt(x: float | None, spec: str = ".1f", scale: float = 1.0) -> str:
    return "–" if x is None else format(x * scale, spec)


def _baseline(cells) -> dict[str, Any] | None:
    return next((v for (s, _), v in cells.items() if s == "dp" and v["status"] == "ok"), None)


PLOT_META = {"Software": None}  # no version stamp in the PNGs: the same results give the same bytes


def _save(fig, out_dir: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110, metadata=PLOT_META)
    plt.close(fig)
    return name


def plot_throughput(model: str, cells, out_dir: Path) -> str:
    """Samples/s against world size, one line per strategy, DataParallel as a dashed level."""
    import matplotlib.pyplot as plt

    dp = _baseline(cells)
    strategies = list(dict.fromkeys(s for s, _ in _order(cells) if s != "dp"))
    world_sizes = sorted({ws for s, ws in cells if s != "dp"})
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in strategies:
        pts = [(ws, cells[(s, ws)]["sps"]) for ws in world_sizes if (s, ws) in cells and cells[(s, ws)]["sps"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=s)
    if dp and dp["sps"]:
        ax.axhline(dp["sps"], color="black", linestyle="--", label="DataParallel (all cores/GPUs)")
    ax.set(xlabel="world size (ranks)", ylabel="training samples/s", title=f"{model}: throughput",
           xticks=world_sizes)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out_dir, f"throughput_{model}.png")


def plot_memory(model: str, cells, out_dir: Path, top: int) -> str:
    """Model state per rank at the largest world size, stacked by kind, with the memory model's prediction."""
    import matplotlib.pyplot as plt

    keys = [k for k in _order(cells) if (k[0] == "dp" or k[1] == top) and cells[k]["state"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bottom = [0.0] * len(keys)
    for kind in KINDS:
        vals = [cells[k]["state"][kind] / MIB for k in keys]
        ax.bar(range(len(keys)), vals, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    pred = [cells[k]["predicted"]["model_state"] / MIB if cells[k]["predicted"] else None for k in keys]
    ax.scatter([i for i, p in enumerate(pred) if p], [p for p in pred if p], color="black", marker="_", s=400,
               zorder=3, label="predicted model state")
    ax.set_xticks(range(len(keys)), [s for s, _ in keys], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="MiB per rank", title=f"{model}: model state per rank (world size {top}; dp: 1 process)")
    ax.set_ylim(0, 1.3 * max([*bottom, *(p for p in pred if p)], default=1))
    ax.legend(fontsize=7, ncol=5, loc="upper center")
    return _save(fig, out_dir, f"memory_{model}.png")


def plot_ratio_to_dp(model: str, cells, out_dir: Path, top: int, dp: dict[str, Any]) -> str:
    """Throughput and model state per rank of each strategy at the largest world size, over DataParallel's."""
    import matplotlib.pyplot as plt

    keys = [k for k in _order(cells) if k[0] != "dp" and k[1] == top and cells[k]["sps"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = range(len(keys))
    ax.bar([i - 0.2 for i in x], [cells[k]["sps"] / dp["sps"] for k in keys], width=0.4, label="throughput ÷ DP")
    if dp["state"]:
        ax.bar([i + 0.2 for i in x], [cells[k]["state"]["model_state"] / dp["state"]["model_state"]
                                      if cells[k]["state"] else 0 for k in keys], width=0.4,
               label="model state per rank ÷ DP")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), [s for s, _ in keys], rotation=30, ha="right", fontsize=8)
    ax.set(title=f"{model}: ratio to DataParallel (world size {top})")
    ax.legend(fontsize=7)
    return _save(fig, out_dir, f"ratio_to_dp_{model}.png")


def plot_time(model: str, cells, out_dir: Path) -> str | None:
    """Milliseconds per timed step of each strategy and world size, stacked by part, beside the measured step time."""
    import matplotlib.pyplot as plt

    keys = [k for k in _order(cells) if cells[k]["time"]]
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bottom = [0.0] * len(keys)
    for part, label in PARTS.items():
        vals = [(cells[k]["time"][part] or 0.0) * 1e3 for k in keys]
        ax.bar(range(len(keys)), vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    measured = [(i, cells[k]["p50"] * 1e3) for i, k in enumerate(keys) if cells[k]["p50"]]
    if measured:
        ax.scatter(*zip(*measured, strict=True), color="black", marker="_", s=400, zorder=3,
                   label="measured step (p50)")
    ax.set_xticks(range(len(keys)), [f"{s} ×{ws}" for s, ws in keys], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="ms per step", title=f"{model}: where a step's time goes")
    ax.set_ylim(0, 1.3 * max([*bottom, *(m for _, m in measured)], default=1))
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    return _save(fig, out_dir, f"time_{model}.png")


def time_section(model: str, cells, out_dir: Path) -> list[str]:
    """The time breakdown's table, its plot, and what limits each strategy; nothing when no job recorded one."""
    png = plot_time(model, cells, out_dir)
    if png is None:
        return []
    lines = ["Where a timed step's time went (ms, median over repeats; exposed communication from the profiled "
             "steps; how each part is measured: docs/time-breakdown.md):", "",
             "| strategy | ranks | " + " | ".join(PARTS.values()) + " | parts ÷ step p50 | limited by |",
             "| --- | ---: | " + "---: | " * len(PARTS) + "---: | --- |"]
    for key in _order(cells):
        t, c = cells[key]["time"], cells[key]
        if not t:
            continue
        known = {p: t[p] for p in PARTS if t[p] is not None}
        top = max(known, key=known.get)
        limit = PARTS[top] + (" (communication not profiled)" if t["exposed_comm"] is None else "")
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(_fmt(t[p], ".1f", 1e3) for p in PARTS)
                     + f" | {_fmt(t['sum_seconds'] / c['p50'] if c['p50'] else None, '.2f')} | {limit} |")
    return [*lines, "", f"![{png[:-4]}]({png})", ""]


def memory_section(model: str, cells, out_dir: Path, top: int) -> list[str]:
    """The peak memory of each strategy at the largest world size split like the time breakdown, as a table and
    a stacked bar; nothing when no job recorded a breakdown."""
    import matplotlib.pyplot as plt

    keys = [k for k in _order(cells) if (k[0] == "dp" or k[1] == top) and cells[k]["memory"]]
    if not keys:
        return []
    parts = [p for p in MEMORY_PARTS if any(cells[k]["memory"].get(p) is not None for k in keys)]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bottom = [0.0] * len(keys)
    for part in parts:
        vals = [max(cells[k]["memory"].get(part) or 0.0, 0.0) / MIB for k in keys]  # a negative heap: not drawn
        ax.bar(range(len(keys)), vals, bottom=bottom, label=MEMORY_PARTS[part])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(keys)), [s for s, _ in keys], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="MiB at the peak, largest rank", title=f"{model}: peak memory per rank (world size {top})")
    ax.set_ylim(0, 1.3 * max(bottom, default=1))
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    png = _save(fig, out_dir, f"memory_breakdown_{model}.png")
    lines = [f"Peak memory of the largest rank at world size {top}, split (MiB; docs/memory.md, \"At the peak\"): "
             "runtime is what the process held before any model, heap what the peak held beyond the parts "
             "counted (freed memory kept by the allocator, temporaries, loader buffers):", "",
             "| strategy | " + " | ".join(MEMORY_PARTS[p] for p in parts) + " | peak | largest part |",
             "| --- | " + "---: | " * len(parts) + "---: | --- |"]
    for key in keys:
        m = cells[key]["memory"]
        peak = m.get("peak_reserved") or m.get("peak_rss")
        largest = max((p for p in parts if p != "runtime" and m.get(p) is not None), key=lambda p: m[p])
        lines.append(f"| {key[0]} | " + " | ".join(_fmt(m.get(p), ".0f", 1 / MIB) for p in parts)
                     + f" | {_fmt(peak, '.0f', 1 / MIB)} | {MEMORY_PARTS[largest]} |")
    return [*lines, "", f"![{png[:-4]}]({png})", ""]


def largest_world(cells, with_dp: bool = False) -> int:
    """The largest world size among the cells; DataParallel's (its one process) only ``with_dp``."""
    return max((ws for s, ws in cells if with_dp or s != "dp"), default=1)


def plot(model: str, cells, out_dir: Path) -> list[str]:
    """The three PNGs for one model (the ratio plot only with a DataParallel baseline); returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    dp = _baseline(cells)
    top = largest_world(cells)
    names = [plot_throughput(model, cells, out_dir), plot_memory(model, cells, out_dir, top)]
    if dp and dp["sps"]:
        names.append(plot_ratio_to_dp(model, cells, out_dir, top, dp))
    return names


def model_section(model: str, cells, out_dir: Path) -> list[str]:
    configs = [c["config"] for c in cells.values()]
    any_cfg = next((c for c in configs if c["strategy"] != "dp"), configs[0])
    dp = _baseline(cells)
    single = {s: v for (s, ws), v in cells.items() if ws == 1}
    lines = [f"## {model} ({any_cfg['params'] / 1e6:.1f}M parameters, {any_cfg['precision']}, "
             f"batch {any_cfg['batch_size']} per rank)", ""]
    pngs = plot(model, cells, out_dir)
    lines += [f"![{p[:-4]}]({p})" for p in pngs[:1]] + [""]
    lines += ["| strategy | ranks | samples/s (p25–p75) | × DP | scaling eff. | step p50 / p95 ms | "
              "peak mem MiB | × DP | comm | TFLOP/s | MFU |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in _order(cells):
        c = cells[key]
        s, ws = key
        if c["status"] != "ok":
            lines.append(f"| {s} | {ws} | **{c['status']}** | | | | | | | | |")
            continue
        one = single.get(s)
        eff = c["sps"] / (ws * one["sps"]) if one and one["sps"] and ws > 1 else None
        lines.append(
            f"| {s} | {ws} | {_fmt(c['sps'])} ({_fmt(c['sps_p25'])}–{_fmt(c['sps_p75'])}) | "
            f"{_fmt(c['sps'] / dp['sps'] if dp else None, '.2f')} | {_fmt(eff, '.0%')} | "
            f"{_fmt(c['p50'], '.0f', 1e3)} / {_fmt(c['p95'], '.0f', 1e3)} | {_fmt(c['peak'], '.0f', 1 / MIB)} | "
            f"{_fmt(c['peak'] / dp['peak'] if dp and c['peak'] else None, '.2f')} | {_fmt(c['comm'], '.0%')} | "
            f"{_fmt(c['tflops'], '.3f')} | "
            f"{_fmt(c['mfu'], '.1%')} |")
    sources = sorted({c["peak_flops"]["source"] for c in cells.values() if c.get("peak_flops")})
    lines += ["", f"MFU: counted FLOPs per sample x samples/s over the ranks' peak ({'; '.join(sources)}; "
              "docs/mfu.md)."] if sources else []
    top = largest_world(cells, with_dp=True)
    ddp = cells.get(("ddp", top))
    lines += ["", f"Model state per rank at world size {top} (DataParallel: its one process), counted from the "
              "tensors at the optimizer step, against the memory model (`scale-ocr estimate-memory`):", "",
              "| strategy | params | grads | optimizer | other | model state MiB | predicted | measured ÷ predicted "
              "| ÷ DDP | ZeRO ideal |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for key in _order(cells):
        c = cells[key]
        if not (key[0] == "dp" or key[1] == top) or not c["state"]:
            continue
        st, pr = c["state"], c["predicted"]
        lines.append(
            f"| {key[0]} | " + " | ".join(_fmt(st[k], ".1f", 1 / MIB) for k in KINDS)
            + f" | {_fmt(st['model_state'], '.1f', 1 / MIB)} | {_fmt(pr['model_state'], '.1f', 1 / MIB)} | "
            f"{_fmt(c['ratio'], '.3f')} | "
            f"{_fmt(st['model_state'] / ddp['state']['model_state'] if ddp and ddp['state'] else None, '.0%')} | "
            f"{_fmt(pr['ideal'], '.1f', 1 / MIB)} |")
    lines += [""] + [f"![{p[:-4]}]({p})" for p in pngs[1:]] + [""]
    return lines + time_section(model, cells, out_dir) + memory_section(model, cells, out_dir, largest_world(cells))


def _gits(results: list[dict]) -> str:
    """The commit the jobs ran at; a suite resumed (``--resume``) after new commits names each, with its job count."""
    counts = Counter(r["metrics"]["versions"]["git"] for r in results)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{g}: {n} jobs" for g, n in counts.items()) + "; resumed with --resume"


def _precisions(results: list[dict]) -> str:
    """The suite's precision, or each model's where they differ."""
    models: dict[str, dict[str, None]] = {}  # precision -> its models, in order
    for r in results:
        models.setdefault(r["config"]["precision"], {})[r["config"]["model"]] = None
    if len(models) == 1:
        return next(iter(models))
    return ", ".join(f"{p} ({', '.join(ms)})" for p, ms in models.items())


def build_report(out_dir: Path) -> Path:
    """Write ``report.md`` and the plots for ``out_dir/results.jsonl``; returns the report's path."""
    results = load(out_dir)
    table = aggregate(results)
    first = results[0]
    hw, ver = first["metrics"]["hardware"], first["metrics"]["versions"]
    cfg = first["config"]
    lines = [f"# Scaling benchmark: {cfg.get('preset') or 'custom'} preset", "",
             f"- Hardware: {hw['cpu']}, {hw['cores']} cores, {_fmt(hw['memory_bytes'], '.0f', 2**-30)} GiB RAM"
             + (f", GPUs: {', '.join(hw['gpus'])}" if hw["gpus"] else ", no GPU (gloo on CPU)") + f" ({hw['host']})",
             f"- Software: torch {ver['torch']}, deepspeed {ver['deepspeed']}, fairscale {ver['fairscale']}, "
             f"python {ver['python']}, scale-ocr {ver['scale-ocr']} (git {_gits(results)})",
             f"- {len(results)} jobs, {cfg['warmup']} warm-up + {cfg['steps']} timed steps each, precision "
             f"{_precisions(results)}; samples/s is the median over timed steps (p25–p75 in brackets), "
             "then over repeats.",
             "- DataParallel baseline: one process driving every device (on CPU: every core, the largest world "
             "size's global batch); an N-rank job gets cores ÷ (largest world size) threads per rank at every "
             "world size, so the largest world uses the same cores as the baseline. Scaling efficiency = "
             "samples/s ÷ (N × samples/s at world size 1).",
             "- comm: share of profiled time (2 steps after the timed ones, torch.profiler) with a collective in "
             "flight on the busiest rank, overlapped or not; an upper bound on what communication costs.",
             "- Peak memory: peak RSS per rank on CPU (allocator caches and set-up copies included), CUDA max "
             "allocated on GPU. Model state is counted from the tensors each rank holds and is what the "
             "memory model predicts.",
             f"- Rebuild: `python -m benchmarks.report {out_dir.name}`; rerun: "
             f"`python -m benchmarks.scaling --preset {cfg.get('preset') or '...'}`.", ""]
    for model, cells in table.items():
        lines += model_section(model, cells, out_dir)
    bad = [r for r in results if r["status"] != "ok"]
    if bad:
        lines += ["## Jobs without a measurement", ""]
        lines += [f"- `{r['config']['key']}`: **{r['status']}**: {r['error']}" for r in bad] + [""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def log_to_wandb(out_dir: Path, mode: str = "offline") -> str | None:
    """One summary run in the suite's W&B group (the jobs logged their own runs there): the results
    as a table and the plots as images. Returns the run's directory, None when W&B is unavailable."""
    try:
        import wandb
    except ImportError:
        print("bench: wandb is not installed; summary not logged", file=sys.stderr)
        return None
    results = load(out_dir)
    work = work_dir(out_dir)
    work.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project="scale-ocr", group=out_dir.name, job_type="bench-summary", name=f"{out_dir.name}-summary",
                     mode=mode, dir=str(work), reinit="finish_previous", config={"results_dir": out_dir.name})
    cols = ["key", "model", "strategy", "world_size", "status", "samples_per_sec", "step_time_p50", "step_time_p95",
            "peak_memory_bytes", "model_state_bytes", "predicted_model_state_bytes", "measured_over_predicted"]
    rows = []
    for r in results:
        m, c = r["metrics"], r["config"]
        rows.append([c["key"], c["model"], c["strategy"], c["world_size"], r["status"], m.get("samples_per_sec"),
                     m.get("step_time_p50"), m.get("step_time_p95"), m.get("peak_memory_bytes"),
                     (m.get("state_bytes") or {}).get("model_state"), (m.get("predicted") or {}).get("model_state"),
                     m.get("measured_over_predicted")])
    run.log({"results": wandb.Table(columns=cols, data=rows),
             **{p.stem: wandb.Image(str(p)) for p in sorted(out_dir.glob("*.png"))}})
    run_dir = run.dir
    run.finish()
    # finish() can return while W&B's service process still holds the offline log's last block; shutting the
    # service down closes the file, so whoever reads or syncs it next sees the whole run.
    wandb.teardown()
    return run_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description="Rebuild a benchmark report.")
    p.add_argument("dir", type=Path, help="results directory holding results.jsonl")
    p.add_argument("--wandb", choices=["offline", "online"], help="also log the summary run to W&B")
    args = p.parse_args(argv)
    out = args.dir if args.dir.is_dir() or args.dir.is_absolute() else Path("benchmarks/results") / args.dir
    print(build_report(out))
    if args.wandb:
        log_to_wandb(out, args.wandb)
    return 0


if __name__ == "__main__":
    run_main(main)
