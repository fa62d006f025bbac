"""Real documents, end to end: a set made by ``scale-ocr make-dataset`` from real PDFs, a detector and a recognizer
trained on it, and page OCR on held-out pages at their own scale.

    python -m benchmarks.real_documents --out benchmarks/results/real-documents-HOST-DATE
    python -m benchmarks.real_documents --pdfs A.pdf B.pdf --det-steps 300 ...   # other documents, a shorter run
    python -m benchmarks.real_documents --report DIR                           # rebuild report.md

The PDFs (default: every PDF under .venv/real-pdfs, which ``make install`` fetches from Debian's camlidl-doc and
freefem-doc packages: two LaTeX manuals scale_ocr never trained on) become one dataset, split by document
(``--val-count`` whole documents held out, drawn by ``--seed``), so no page and no document is on both sides.
Four stages run in order, each one command whose line, wall time and result go to ``results.jsonl`` (an
interrupted run resumes at the first stage without a line):

* ``dataset``: ``scale-ocr make-dataset`` at ``--dpi``;
* ``detector``: db_mobilenet_v3_large trained from scratch on random ``--det-input`` crops of the training
  pages at their native scale (``--page-scale native``), no validation during training;
* ``recognizer``: crnn_mobilenet_v3_small trained from scratch on the training documents' word crops, validated
  on the held-out documents' crops (its exact match is the recognizer's number);
* ``pages``: ``scale-ocr evaluate-pages --det-size auto`` with both models' LAST checkpoints (nothing is chosen
  on held-out data) on the held-out pages, read whole at their own scale: detection recall / precision at IoU
  0.5 and end-to-end word recall / precision (a word counts when a box matches it and its text is equal).

The report checks issue 31's targets: detection recall and precision >= 0.8, page word recall >= 0.6.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    BIN,
    REPO,
    TRAIN,
    append_line,
    bench_main,
    command_line,
    hardware,
    job_env,
    launch_command,
    load,
    parser,
    run_main,
    versions,
    work_dir,
    write_command,
    write_outputs,
)

MODULE = "real_documents"
REAL_PDFS = REPO / ".venv" / "real-pdfs"
DETECTOR, RECOGNIZER = "db_mobilenet_v3_large", "crnn_mobilenet_v3_small"
STAGES = ("dataset", "detector", "recognizer", "pages")
TARGETS = {"recall": 0.8, "precision": 0.8, "word_recall": 0.6}  # issue 31, acceptance 4


def pdfs(given: list[str] | None, default: Path, flag: str) -> list[Path]:
    """The PDFs ``flag`` names, else every PDF under ``default``; refused in one line when there are none."""
    from scale_ocr.errors import UserError

    found = [Path(p) for p in given] if given else sorted(default.glob("*.pdf"))
    if not found:
        raise UserError(f"no PDFs: none under {default} (`make real-pdfs` fetches them) and no {flag} given")
    missing = [str(p) for p in found if not p.is_file()]
    if missing:
        raise UserError(f"{flag}: {', '.join(missing)} not found")
    return found


def _run(cmd: list[str], log: Path, timeout: int) -> tuple[int, float, str]:
    """Run ``cmd`` in the repository, its output kept in ``log``: ``(exit code, wall seconds, stdout)``."""
    env = job_env()
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = 124, str(exc.stdout or ""), f"no result within {timeout} s"
    log.write_text(f"$ {shlex.join(cmd)}\n{out}\n--- stderr ---\n{err}\n", encoding="utf-8")
    return rc, time.time() - t0, out


def commands(args: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """Each stage's command line."""
    data, det, reco = work / "set", work / "det", work / "reco"
    cli = str(BIN / "scale-ocr")
    common = ["--resume", "none", "--log-every", "25", "--wandb-mode", "offline"]
    return {
        "dataset": [cli, "make-dataset", *map(str, pdfs(args.pdfs, REAL_PDFS, "--pdfs")), str(data),
                    "--dpi", str(args.dpi), "--split-by", "document", "--val-count", str(args.val_count),
                    "--seed", str(args.seed)],
        "detector": launch_command("torchrun", args.world_size, TRAIN, [
            DETECTOR, "--train-path", str(data / "detection" / "train"), "--page-scale", "native",
            "--input-size", args.det_input, "-b", str(args.det_batch), "--max-steps", str(args.det_steps),
            "--epochs", "100000", "--no-eval", "--output-dir", str(det), *common]),
        "recognizer": launch_command("torchrun", args.world_size, TRAIN, [
            RECOGNIZER, "--train-path", str(data / "recognition" / "train"),
            "--val-path", str(data / "recognition" / "val"), "-b", str(args.reco_batch),
            "--epochs", str(args.reco_epochs), "--output-dir", str(reco), *common]),
        "pages": pages_command(det, reco, data / "detection" / "val"),
    }


def pages_command(det: Path, reco: Path, pages: Path, *more: str) -> list[str]:
    """``scale-ocr evaluate-pages`` of the last models of the runs ``det`` and ``reco`` on the folder ``pages`` (a
    set's detection split), read whole at their own scale; ``more``: its further flags."""
    return [str(BIN / "scale-ocr"), "evaluate-pages", "--det", str(det / "last_model.pt"), "--reco",
            str(reco / "last_model.pt"), "--det-size", "auto", *more, "--json", str(pages)]


def result(stage: str, work: Path, stdout: str) -> dict[str, Any]:
    """What a finished stage measured, from the files it wrote (or, for ``pages``, its JSON)."""
    if stage == "dataset":
        summary = json.loads((work / "set" / "summary.json").read_text())
        splits = {name: {"documents": [Path(d).name for d in split["documents"]], "pages": len(split["pages"])}
                  for name, split in summary["splits"].items()}
        return {"splits": splits, "words": summary["words"], "dpi": summary["options"]["dpi"]}
    if stage in ("detector", "recognizer"):
        return trained(work / ("det" if stage == "detector" else "reco"))
    return json.loads(stdout.strip().splitlines()[-1])


def trained(run: Path) -> dict[str, Any]:
    """What a training run's metrics.json and config.json say of it."""
    metrics = json.loads((run / "metrics.json").read_text())
    keep = ("steps", "epochs", "global_batch", "samples_per_sec", "train_loss", "exact_match", "cer",
            "best_exact_match", "wall_seconds")
    config = json.loads((run / "config.json").read_text())
    return {**{k: metrics[k] for k in keep if k in metrics}, "lr_plan": config.get("lr_plan")}


def run(args: argparse.Namespace) -> None:
    run_stages(args.out, MODULE, lambda work: commands(args, work), result, args.timeout)


def run_stages(out: Path, module: str, commands: Callable[[Path], dict[str, list[str]]],
               result: Callable[[str, Path, str], dict[str, Any]], timeout: int) -> None:
    """Run the stages (``commands(work folder)``, in order) not yet in ``out/results.jsonl``, each line holding its
    command, wall time and ``result(stage, work, stdout)``; stop at the first that fails."""
    from scale_ocr.errors import UserError

    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = {line["stage"] for line in load(out, f"benchmarks.{module}")} if results.is_file() else set()
    if not done:
        write_command(out, module)
    work = work_dir(out)
    work.mkdir(parents=True, exist_ok=True)
    for stage, cmd in commands(work).items():
        if stage in done:
            print(f"{module}: {stage} already measured, kept")
            continue
        print(f"{module}: {stage}: {shlex.join(cmd)}", flush=True)
        rc, wall, stdout = _run(cmd, work / f"{stage}.log", timeout)
        if rc != 0:
            raise UserError(f"{stage} failed (exit {rc}); its output is in {work / f'{stage}.log'}")
        line = {"stage": stage, "command": shlex.join(cmd).replace(str(REPO) + "/", ""), "wall_seconds": wall,
                "result": result(stage, work, stdout), "hardware": hardware(), "versions": versions()}
        append_line(results, line)
        print(f"{module}: {stage} done in {wall:.0f} s", flush=True)


def staged_report(out_dir: Path, module: str, title: str) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """A staged benchmark's lines by stage (:func:`run_stages`' ``results.jsonl``) and its report's head: the title,
    the command, the hardware and versions of its first stage."""
    lines = {line["stage"]: line for line in load(out_dir, f"benchmarks.{module}")}
    first = next(iter(lines.values()))
    hw, ver = first["hardware"], first["versions"]
    return lines, [f"# {title}", "", f"Command: `{command_line(out_dir)}`  ",
                   f"Hardware: {hw['cpu']}, {hw['cores']} cores, GPUs: {', '.join(hw['gpus']) or 'none'}  ",
                   f"Versions: torch {ver.get('torch')}, scale-ocr {ver.get('scale-ocr')} at git {ver.get('git')}", ""]


def stages_table(lines: dict[str, dict[str, Any]]) -> list[str]:
    """The report's section of every stage's wall time and command."""
    return ["", "## Stages", "", "| stage | wall time | command |", "|---|---|---|",
            *[f"| {s} | {ln['wall_seconds']:.0f} s | `{ln['command']}` |" for s, ln in lines.items()]]


def _verdicts(pages: dict[str, Any]) -> list[str]:
    return [f"{key.replace('_', ' ')} {pages[key]:.3f} (target >= {target}): "
            f"{'PASS' if pages[key] >= target else 'FAIL'}" for key, target in TARGETS.items()]


def write_report(out_dir: Path) -> Path:
    lines = {line["stage"]: line for line in load(out_dir, f"benchmarks.{MODULE}")}
    first = next(iter(lines.values()))
    hw, ver = first["hardware"], first["versions"]
    md = ["# Real documents: make-dataset, detector, recognizer and page OCR on held-out pages", "",
          f"Command: `{command_line(out_dir)}`  ", f"Hardware: {hw['cpu']}, {hw['cores']} cores, "
          f"GPUs: {', '.join(hw['gpus']) or 'none'}  ",
          f"Versions: torch {ver.get('torch')}, scale-ocr {ver.get('scale-ocr')} at git {ver.get('git')}", ""]
    summary: dict[str, Any] = {"stages": {s: lines[s]["result"] for s in STAGES if s in lines}}
    if "dataset" in lines:
        ds = lines["dataset"]["result"]
        md += ["## The set", "", "| split | documents | pages |", "|---|---|---|"]
        md += [f"| {name} | {', '.join(split['documents'])} | {split['pages']} |"
               for name, split in ds["splits"].items()]
        md += ["", f"Rendered at {ds['dpi']} dpi; words: {json.dumps(ds['words'])}", ""]
    md += ["## Stages", "", "| stage | wall time | result | command |", "|---|---|---|---|"]
    for stage in STAGES:
        if stage not in lines:
            md.append(f"| {stage} | not run | | |")
            continue
        line, r = lines[stage], lines[stage]["result"]
        if stage == "detector":
            what = f"{r['steps']} steps, global batch {r.get('global_batch')}, {r['samples_per_sec']:.1f} samples/s"
        elif stage == "recognizer":
            what = (f"{r['epochs']} epochs ({r['steps']} steps), held-out crops: exact match "
                    f"{r['exact_match']:.3f} (last), CER {r['cer']:.3f}")
        elif stage == "pages":
            what = (f"detection recall {r['recall']:.3f}, precision {r['precision']:.3f}; word recall "
                    f"{r['word_recall']:.3f}, precision {r['word_precision']:.3f}")
        else:
            what = ", ".join(f"{k} {v['pages']} pages" for k, v in r["splits"].items())
        md.append(f"| {stage} | {line['wall_seconds']:.0f} s | {what} | `{line['command']}` |")
    if "pages" in lines:
        verdicts = _verdicts(lines["pages"]["result"])
        summary["verdicts"] = verdicts
        md += ["", "## Targets (issue 31)", "", *[f"- {v}" for v in verdicts]]
    return write_outputs(out_dir, summary, md)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The set's, the detector's and the word recognizer's options (benchmarks.line_pages takes them too)."""
    p.add_argument("--pdfs", nargs="+", default=None, help=f"the documents (default: {REAL_PDFS}/*.pdf)")
    p.add_argument("--dpi", type=int, default=150)
    p.add_argument("--val-count", type=int, default=1, help="documents held out (default 1)")
    p.add_argument("--seed", type=int, default=4, help="the split's draw (default 4: freefem trains, camlidl is "
                   "held out)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--det-input", default="256x256", help="the detector's training crops, HxW (default 256x256)")
    p.add_argument("--det-batch", type=int, default=4, help="detector crops per rank and step (default 4)")
    p.add_argument("--det-steps", type=int, default=900)
    p.add_argument("--reco-batch", type=int, default=32, help="recognizer crops per rank and step (default 32)")
    p.add_argument("--reco-epochs", type=int, default=8)
    p.add_argument("--timeout", type=int, default=4 * 3600, help="seconds each stage may take")


def main(argv: list[str] | None = None) -> int:
    p = parser(MODULE, __doc__)
    add_arguments(p)
    args = p.parse_args(argv)
    return bench_main(MODULE, args, run, write_report)


if __name__ == "__main__":
    run_main(main)
