"""max_model's report: report.md and fits.png from a results folder's search.json, results.jsonl and
predictions.json (``python -m benchmarks.max_model`` writes them; ``--repredict`` the last)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

GIB = 2**30
DEFAULT_LR = 1e-4  # Search.lr, for a search.json that predates the field


def key(strategy: str, checkpointing: bool, depth: int | None = None) -> str:
    return f"{strategy}{'+ac' if checkpointing else ''}" + ("" if depth is None else f"@{depth}")


def load_probes(out: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The probes, with predictions from ``predictions.json`` when :func:`repredict` wrote one; and its commit."""
    probes = probes_of(out / "results.jsonl")
    path = out / "predictions.json"
    if not path.exists():
        return probes, None
    doc = json.loads(path.read_text())
    for p in probes:
        p["metrics"]["predicted"] = {**p["metrics"].get("predicted", {}),
                                     "need": doc["need"][key(p["strategy"], p["checkpointing"], p["depth"])],
                                     "largest_depth": doc["largest"][key(p["strategy"], p["checkpointing"])]}
    return probes, doc["git"]


def summarize(probes: list[dict[str, Any]], params_at: Callable[[int], int]) -> list[dict[str, Any]]:
    """Per (strategy, checkpointing): the largest depth that trained, its size and speed, and the prediction
    (``params_at``: the parameters of the model at a depth)."""
    rows: dict[tuple[str, bool], dict[str, Any]] = {}
    for p in probes:
        row = rows.setdefault((p["strategy"], p["checkpointing"]), {
            "strategy": p["strategy"], "checkpointing": p["checkpointing"], "depth": 0, "params": 0,
            "samples_per_sec": None, "peak_memory_bytes": None, "failed": [],
            "predicted_depth": p["metrics"]["predicted"]["largest_depth"], "probes": 0})
        row["probes"] += 1
        if p["status"] == "ok" and p["depth"] > row["depth"]:
            row.update(depth=p["depth"], params=p["params"], samples_per_sec=p["metrics"].get("samples_per_sec"),
                       peak_memory_bytes=p["metrics"].get("peak_memory_bytes"))
        if p["status"] not in ("ok", "oom"):
            row["failed"].append(f"depth {p['depth']}: {p['status']} ({p['error']})")
    for row in rows.values():
        ddp = rows.get(("ddp", row["checkpointing"]), {}).get("params")
        row["over_ddp"] = row["params"] / ddp if ddp else None
        depth = row["predicted_depth"]
        row["predicted_params"] = params_at(depth) if depth >= 1 else 0
        row["measured_over_predicted"] = row["params"] / row["predicted_params"] if row["predicted_params"] else None
    return list(rows.values())


def write_report(out: Path, params_at: Callable[[dict[str, Any], int], int]) -> Path:
    """report.md and fits.png from results.jsonl and search.json (``params_at(search, depth)``: the parameters of the
    searched model at a depth)."""
    header = json.loads((out / "search.json").read_text())
    s = header["search"]
    probes, repredicted = load_probes(out)
    rows = summarize(probes, lambda depth: params_at(s, depth))
    lines = [f"# Largest model per strategy: {s['arch']} at width {s['width']}, world size {s['world_size']}, "
             f"{s['budget_gb']} GiB per rank, {s['precision']}, batch {s['batch_size']} per rank",
             "", f"Command: `python -m benchmarks.max_model --arch {s['arch']} --width {s['width']} --world-size "
             f"{s['world_size']} --budget-gb {s['budget_gb']} --batch-size {s['batch_size']} --precision "
             f"{s['precision']} --steps {s['steps']} --max-depth {s['max_depth']} "
             f"--strategies {','.join(s['strategies'])} "
             f"--checkpointing {checkpointing_flag(s['checkpointing'])} --lr {s.get('lr', DEFAULT_LR)}"
             + (f" --samples {s['samples']}" if s.get("samples") else "")
             + (f" --depths {','.join(map(str, s['depths']))}" if s.get("depths") else "") + "`  ",
             f"Host: {header['hardware']['cpu']} ({header['hardware']['cores']} cores); git {header['versions']['git']}"
             + (f"; probes ran with MALLOC_MMAP_THRESHOLD_={header['malloc_mmap_threshold']}"
                if header.get("malloc_mmap_threshold") else ""),
             *([f"Every probe saves as a user's run does: a checkpoint at step {max(1, s['steps'] - 1)}, then the "
                "final checkpoint and last_model.pt; its peak is the whole run's."] if s.get("saves") else []),
             *([f"Predictions: the memory model at git {repredicted}, made again after the probes ran "
                "(`python -m benchmarks.max_model --repredict --out DIR`); the probes themselves are unchanged."]
               if repredicted else []),
             *[f"Re-measured at git {u['git']} (`--update --strategies {','.join(u['strategies'])} --checkpointing "
               f"{checkpointing_flag(u['checkpointing'])}`): those probes replace the first run's."
               for u in header.get("updates", [])],
             "", "| strategy | act. ckpt | largest depth | parameters | ÷ DDP | predicted depth | measured ÷ predicted "
             "| samples/s | peak/rank | probes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["checkpointing"], s["strategies"].index(r["strategy"]))):
        fmt = lambda v, f: f.format(v) if v is not None else "-"  # noqa: E731
        lines.append(f"| {r['strategy']} | {'on' if r['checkpointing'] else 'off'} | {r['depth']} | "
                     f"{r['params'] / 1e6:.0f}M | {fmt(r['over_ddp'], '{:.2f}')} | {r['predicted_depth']} | "
                     f"{fmt(r['measured_over_predicted'], '{:.2f}')} | {fmt(r['samples_per_sec'], '{:.2f}')} | "
                     f"{fmt(r['peak_memory_bytes'] and r['peak_memory_bytes'] / GIB, '{:.2f} GiB')} | {r['probes']} |")
        lines += [f"  - {f}" for f in r["failed"]]
    lines += ["", "Every probe (peak: resident memory, the largest rank's and the mean over ranks; loss per step):", "",
              "| strategy | act. ckpt | depth | parameters | status | predicted need/rank | peak/rank max (mean) "
              "| samples/s | losses |", "|---|---|---|---|---|---|---|---|---|"]
    for p in probes:
        m = p["metrics"]
        peak = (f"{m['peak_memory_bytes'] / GIB:.2f} ({(m.get('peak_mean_bytes') or 0) / GIB:.2f}) GiB"
                if m.get("peak_memory_bytes") else "-")
        losses = " → ".join(f"{v:.3f}" for v in m.get("losses", [])) or (p["error"] or "-")
        speed = f"{m['samples_per_sec']:.2f}" if m.get("samples_per_sec") else "-"
        lines.append(f"| {p['strategy']} | {'on' if p['checkpointing'] else 'off'} | {p['depth']} | "
                     f"{p['params'] / 1e6:.0f}M | {p['status']} | {m['predicted']['need'] / GIB:.2f} GiB | {peak} | "
                     f"{speed} | {losses} |")
    (out / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _plot(rows, s, out / "fits.png")
    return out / "report.md"


def probes_of(results: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in results.read_text().splitlines() if ln.strip()]


def checkpointing_flag(settings: list[bool]) -> str:
    return "both" if len(settings) == 2 else "on" if settings[0] else "off"


def _plot(rows: list[dict], s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(s["strategies"])
    for i, ac in enumerate(sorted({r["checkpointing"] for r in rows})):
        by = {r["strategy"]: r["params"] / 1e6 for r in rows if r["checkpointing"] == ac}
        ax.bar([n + i * 0.4 for n in range(len(names))], [by.get(n, 0) for n in names], width=0.4,
               label="activation checkpointing" if ac else "plain")
    ax.set_xticks([n + 0.2 for n in range(len(names))], names)
    ax.set_ylabel("parameters that fit (M)")
    ax.set_title(f"{s['budget_gb']} GiB per rank, world size {s['world_size']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
