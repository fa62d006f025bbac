"""The time model against a scaling record: predicted step time per strategy beside the measured one.

    python -m benchmarks.time_check benchmarks/results/quick-vm-DATE --out benchmarks/results/time-model-vm-DATE

For every model of the record, at its largest world size, ``scale-ocr estimate-memory --time --device host`` runs
with the record's precision, per-rank batch and input size (the host's probes and each engine's one-rank step, as
a user would run it, right after the record so the host is the same) and its prediction is set beside the
record's measured step time (p50) and time breakdown. The report gives predicted / measured per model and
strategy and says which are within the tolerance (25%: issue 33). Run it right after the scaling suite, on the
same quiet host: the probes measure the host as it is.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    append_line,
    bench_main,
    command_line,
    hardware,
    load,
    parser,
    refuse_written,
    run_main,
    versions,
    write_command,
    write_outputs,
)

TOLERANCE = 0.25
PARTS = (("compute", "compute_s", ("compute",)), ("communication", "exposed_comm_s", ("exposed_comm",)),
         ("optimizer", "optimizer_s", ("optimizer",)), ("other", "other_s", ("other", "data")))


def targets(record: list[dict[str, Any]], strategies: list[str]) -> dict[str, dict[str, Any]]:
    """Per model: the largest world size with a measured step for every one of ``strategies``, its lines, and the
    settings the estimate needs (precision, per-rank batch, input size)."""
    out: dict[str, dict[str, Any]] = {}
    ok = [ln for ln in record if ln["status"] == "ok" and ln["config"]["strategy"] in strategies
          and ln["metrics"].get("step_time_p50")]
    by_size: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}  # model -> world size -> strategy -> line
    for ln in ok:
        cfg = ln["config"]
        if cfg["world_size"] > 1:
            by_size.setdefault(cfg["model"], {}).setdefault(cfg["world_size"], {})[cfg["strategy"]] = ln
    for model in sorted(by_size):
        sizes = sorted(ws for ws, lines in by_size[model].items() if set(strategies) <= set(lines))
        if not sizes:
            continue
        lines = by_size[model][sizes[-1]]
        cfg = next(iter(lines.values()))["config"]
        cmd = shlex.split(cfg["command"])
        size = cmd[cmd.index("--input-size") + 1] if "--input-size" in cmd else None
        out[model] = {"world_size": sizes[-1], "precision": cfg["precision"], "batch": cfg["batch_size"],
                      "input_size": size, "lines": lines}
    return out


def estimate(model: str, target: dict[str, Any], strategies: list[str]) -> dict[str, Any]:
    """``scale-ocr estimate-memory --time --device host``'s JSON for ``model`` at the record's settings."""
    cmd = [sys.executable, "-m", "scale_ocr.cli.main", "estimate-memory", "--model", model, "--world-size",
           str(target["world_size"]), "--time", "--device", "host", "--batch-size", str(target["batch"]),
           "--precision", target["precision"], "--strategies", ",".join(strategies), "--json"]
    if target["input_size"]:
        cmd += ["--input-size", target["input_size"]]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        from scale_ocr.errors import UserError

        raise UserError(f"estimate-memory for {model} failed (exit {done.returncode}): "
                        f"{(done.stderr.strip().splitlines() or ['?'])[-1][:300]}")
    return {"command": shlex.join(["scale-ocr", *cmd[3:]]), **json.loads(done.stdout)["time"]}


def run(args: argparse.Namespace) -> None:
    strategies = args.strategies.split(",")
    record = load(args.record)
    plan = targets(record, strategies)
    if not plan:
        from scale_ocr.errors import UserError

        raise UserError(f"{args.record} has no world size above 1 measured for every one of {args.strategies}; "
                        "run the scaling suite with those strategies first")
    args.out.mkdir(parents=True, exist_ok=True)
    write_command(args.out, "time_check")
    ver, hw = versions(), hardware()
    for model, target in plan.items():
        doc = estimate(model, target, strategies)
        ratios = []
        for name in strategies:
            measured = target["lines"][name]["metrics"]
            predicted = doc["strategies"][name]
            ratios.append(f"{name} {predicted['step_s'] / measured['step_time_p50']:.2f}")
            append_line(args.out / "results.jsonl", {
                "model": model, "strategy": name, "world_size": target["world_size"],
                "precision": target["precision"], "batch_per_rank": target["batch"], "record": str(args.record),
                "predicted": predicted, "engine_one_rank": doc.get("engines_one_rank", {}).get(name),
                "source": doc["source"], "estimate_command": doc["command"],
                "measured": {"step_time_p50": measured["step_time_p50"],
                             "time_breakdown": measured.get("time_breakdown")},
                "ratio": predicted["step_s"] / measured["step_time_p50"], "versions": ver, "hardware": hw})
        print(f"time_check: {model}: " + ", ".join(ratios), flush=True)


def _parts_row(line: dict[str, Any]) -> str:
    tb = line["measured"].get("time_breakdown") or {}
    cells = []
    for _, key, measured_keys in PARTS:
        got = sum(tb.get(k) or 0.0 for k in measured_keys)
        cells.append(f"{line['predicted'][key] * 1e3:.0f} / {got * 1e3:.0f}")
    return (f"| {line['model']} | {line['strategy']} | " + " | ".join(cells)
            + f" | {line['predicted']['step_s'] * 1e3:.0f} / {line['measured']['step_time_p50'] * 1e3:.0f} |")


def write_report(out_dir: Path) -> Path:
    lines = load(out_dir, "benchmarks.time_check")
    models = list(dict.fromkeys(ln["model"] for ln in lines))
    strategies = list(dict.fromkeys(ln["strategy"] for ln in lines))
    ratio = {(ln["model"], ln["strategy"]): ln["ratio"] for ln in lines}
    within = [k for k, r in ratio.items() if abs(r - 1) <= TOLERANCE]
    md = ["# The time model against measurement", "", f"Command: `{command_line(out_dir)}`", "",
          f"Record: `{lines[0]['record']}` (its command: `{command_line(Path(lines[0]['record']))}`), world size "
          f"{lines[0]['world_size']}, the record's per-rank batch and precision. Estimates: "
          f"`{lines[0]['estimate_command']}` and the same for each model.", "",
          "## Predicted / measured step time", "",
          "| model | " + " | ".join(strategies) + " |", "| --- |" + " ---: |" * len(strategies)]
    for m in models:
        md.append(f"| {m} | " + " | ".join(f"{ratio[(m, s)]:.2f}" if (m, s) in ratio else "-" for s in strategies)
                  + " |")
    md += ["", f"**{len(within)} of {len(ratio)} within {TOLERANCE:.0%}**"
           + ("." if len(within) == len(ratio) else ": outside, " + ", ".join(
               f"{m} {s} ({r:.2f})" for (m, s), r in ratio.items() if (m, s) not in within) + "."), "",
           "## Parts, predicted / measured (ms)", "",
           "Measured parts are the record's time breakdown (other includes the data wait); predicted communication is",
           "all of it on a CPU host (nothing overlaps there).", "",
           "| model | strategy | " + " | ".join(p for p, _, _ in PARTS) + " | step |", "| --- | --- |" + " ---: |" * 5]
    md += [_parts_row(ln) for ln in lines]
    md += ["", "## Where the host figures came from", ""]
    md += [f"- {m}: {next(ln['source'] for ln in lines if ln['model'] == m)}" for m in models]
    return write_outputs(out_dir, {"ratios": {f"{m}/{s}": r for (m, s), r in ratio.items()},
                                   "within": len(within), "of": len(ratio), "tolerance": TOLERANCE}, md)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("time_check", __doc__)
    p.add_argument("record", type=Path, nargs="?", help="a scaling results folder (python -m benchmarks.scaling)")
    p.add_argument("--strategies", default="ddp,fsdp,zero2,zero3",
                   help="comma-separated (default ddp,fsdp,zero2,zero3)")
    return p.parse_args(argv)


def check(args: argparse.Namespace) -> None:
    from scale_ocr.errors import UserError

    if args.record is None:
        raise UserError("give the scaling record to check against, e.g. benchmarks/results/quick-vm-20261204")
    refuse_written(args.out)


def main(argv: list[str] | None = None) -> int:
    return bench_main("time_check", parse(argv), run, write_report, check)


if __name__ == "__main__":
    run_main(main)
