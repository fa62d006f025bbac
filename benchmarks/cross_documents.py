"""Documents in fonts the training never saw: models trained on one font family's documents, measured on another's,
under three recognizer recipes (issue 56).

    python -m benchmarks.cross_documents --out benchmarks/results/cross-documents-HOST-DATE
    python -m benchmarks.cross_documents --report DIR                                  # rebuild report.md

The training documents (default: .venv/real-pdfs, the LaTeX manuals of benchmarks.real_documents, set in TeX's
Computer Modern) become one set split by document, as that benchmark splits them: FreeFEM's manual trains, CamlIDL's
is held out (the training family's held-out pages). The unseen documents (default: .venv/unseen-pdfs, which
``make install`` fetches: manuals set in other families, each one's fonts listed by ``pdffonts`` in docs/data.md)
are all measured, none trained on. Stages, each one command whose line goes to ``results.jsonl`` (an interrupted
run resumes at the first without a line):

* ``train-set``, ``unseen-set``: ``scale-ocr make-dataset`` at ``--dpi``;
* per detector recipe, ``detector`` (``real``) or ``detector-D``: db_mobilenet_v3_large at the training pages'
  native scale, as benchmarks.real_documents;
* per recognizer recipe, ``recognizer-R`` (crnn_mobilenet_v3_small, ``--reco-steps`` steps whatever the recipe,
  validated on the held-out training-family crops) and ``crops-R`` (``scale-ocr evaluate`` on the unseen documents'
  crops);
* per pair, ``pages-R`` (with the ``real`` detector) or ``pages-R-det-D``: ``scale-ocr evaluate-pages`` on the
  unseen pages, whole, at their own scale.

Recognizer recipes: ``real`` (the training documents' crops alone), ``fonts`` (with synthetic words in every
installed font, half the samples: ``--train-path CROPS=0.5 synthetic=0.5``) and ``degraded`` (``fonts`` with
``--degrade``'s candidate set, :data:`~scale_ocr.data.degrade.CANDIDATE`). Detector recipes: ``real`` (the training
pages alone), ``fonts`` (with synthetic pages in every installed font, half the samples) and ``fonts-2x`` (``fonts``
for twice ``--det-steps``: the detector's recall capped page OCR at 900 steps). The report checks issue
56's targets on :data:`SHIPPED`, the pair docs/data.md recommends for real documents: page word recall on the unseen
documents >= 0.6, and exact match on their crops within 10 points of the held-out training family's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    BIN,
    REPO,
    TRAIN,
    bench_main,
    launch_command,
    parser,
    run_main,
    write_outputs,
)
from benchmarks.real_documents import (
    DETECTOR,
    REAL_PDFS,
    RECOGNIZER,
    pages_command,
    pdfs,
    run_stages,
    staged_report,
    stages_table,
)
from scale_ocr.data.degrade import CANDIDATE

MODULE = "cross_documents"
UNSEEN_PDFS = REPO / ".venv" / "unseen-pdfs"
RECIPES = {"real": lambda crops: ["--train-path", crops],
           "fonts": lambda crops: ["--train-path", f"{crops}=0.5", "synthetic=0.5", "--fonts", "installed"],
           "degraded": lambda crops: ["--train-path", f"{crops}=0.5", "synthetic=0.5", "--fonts", "installed",
                                      "--degrade", *CANDIDATE]}
# Detector recipes: the training data, and how many times --det-steps they train
DETECTORS = {"real": (lambda pages: ["--train-path", pages], 1),
             "fonts": (lambda pages: ["--train-path", f"{pages}=0.5", "synthetic=0.5", "--fonts", "installed"], 1),
             "fonts-2x": (lambda pages: ["--train-path", f"{pages}=0.5", "synthetic=0.5", "--fonts", "installed"], 2)}
TARGETS = {"word_recall": 0.6, "gap": 0.10}  # issue 56, acceptance 3
# (recognizer, detector): the record of 2026-12-07 measured fonts over degraded (the candidate degradations cost 7
# points of exact match on the unseen crops at 1,480 steps), and the detector's recall capping page OCR at 900 steps
# (0.741; 0.788 at 1,800, where the pair read 0.635 of the unseen pages' words against 0.561)
SHIPPED = ("fonts", "fonts-2x")


def det_stage(detector: str) -> str:
    return "detector" if detector == "real" else f"detector-{detector}"


def pages_stage(recipe: str, detector: str) -> str:
    return f"pages-{recipe}" if detector == "real" else f"pages-{recipe}-det-{detector}"


def commands(args: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """Each stage's command line, in order."""
    train, unseen = work / "train-set", work / "unseen-set"
    cli = str(BIN / "scale-ocr")
    common = ["--resume", "none", "--log-every", "25", "--wandb-mode", "offline"]
    out = {
        "train-set": [cli, "make-dataset", *map(str, pdfs(args.train_pdfs, REAL_PDFS, "--train-pdfs")), str(train),
                      "--dpi", str(args.dpi), "--split-by", "document", "--val-count", "1", "--seed", str(args.seed)],
        # every unseen page in the train split (make-dataset's val keeps a training document): none trains anything
        "unseen-set": [cli, "make-dataset", *map(str, pdfs(args.unseen_pdfs, UNSEEN_PDFS, "--unseen-pdfs")),
                       str(unseen), "--dpi", str(args.dpi), "--val-count", "0"],
    }
    for detector in args.detectors:
        data, times = DETECTORS[detector]
        out[det_stage(detector)] = launch_command("torchrun", args.world_size, TRAIN, [
            DETECTOR, *data(str(train / "detection" / "train")), "--page-scale", "native",
            "--input-size", args.det_input, "-b", str(args.det_batch), "--max-steps", str(args.det_steps * times),
            "--epochs", "100000", "--no-eval", "--output-dir", str(det_dir(work, detector)), *common])
    for recipe in args.recipes:
        reco = work / f"reco-{recipe}"
        out[f"recognizer-{recipe}"] = launch_command("torchrun", args.world_size, TRAIN, [
            RECOGNIZER, *RECIPES[recipe](str(train / "recognition" / "train")),
            "--val-path", str(train / "recognition" / "val"), "-b", str(args.reco_batch), "--max-steps",
            str(args.reco_steps), "--epochs", "100000", "--eval-every", str(args.reco_steps // 4),
            "--output-dir", str(reco), *common])
        out[f"crops-{recipe}"] = [cli, "evaluate", str(reco / "last_model.pt"), str(unseen / "recognition" / "train"),
                                  "--json"]
        for detector in args.detectors:
            out[pages_stage(recipe, detector)] = pages_command(det_dir(work, detector), reco,
                                                               unseen / "detection" / "train")
    return out


def det_dir(work: Path, detector: str) -> Path:
    return work / ("det" if detector == "real" else f"det-{detector}")


def result(stage: str, work: Path, stdout: str) -> dict[str, Any]:
    """What a finished stage measured: a set's documents, fonts and words; a run's metrics; an evaluation's JSON."""
    if stage.endswith("-set"):
        folder = work / stage
        summary = json.loads((folder / "summary.json").read_text())
        return {"splits": {name: {"documents": [Path(d).name for d in split["documents"]], "pages": len(split["pages"])}
                           for name, split in summary["splits"].items()}, "words": summary["words"]}
    if stage.startswith(("detector", "recognizer-")):
        kind, _, name = stage.partition("-")
        run = det_dir(work, name or "real") if kind == "detector" else work / f"reco-{name}"
        metrics = json.loads((run / "metrics.json").read_text())
        keep = ("steps", "global_batch", "samples_per_sec", "train_loss", "exact_match", "cer", "data_drawn",
                "wall_seconds")
        return {k: metrics[k] for k in keep if k in metrics}
    return json.loads(stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> None:
    run_stages(args.out, MODULE, lambda work: commands(args, work), result, args.timeout)


def rows(lines: dict[str, dict]) -> list[dict[str, Any]]:
    """Per recognizer recipe measured and detector it read pages with: the held-out training-family exact match, the
    unseen documents' exact match, their gap, and the unseen pages' detection and word recall."""
    out = []
    for recipe in RECIPES:
        reco, crops = (lines.get(f"{k}-{recipe}", {}).get("result") for k in ("recognizer", "crops"))
        if reco is None:
            continue
        base = {"recipe": recipe, "seen_exact_match": reco.get("exact_match"), "steps": reco.get("steps"),
                "unseen_exact_match": crops and crops.get("exact_match"), "unseen_cer": crops and crops.get("cer")}
        if base["seen_exact_match"] is not None and base["unseen_exact_match"] is not None:
            base["gap"] = base["seen_exact_match"] - base["unseen_exact_match"]
        read = {d: lines[pages_stage(recipe, d)]["result"] for d in DETECTORS if pages_stage(recipe, d) in lines}
        out += [{**base, "detector": d, **{k: pages[k] for k in ("recall", "precision", "word_recall",
                                                                 "word_precision")}} for d, pages in read.items()]
        out += [] if read else [{**base, "detector": None}]
    return out


def verdicts(row: dict[str, Any]) -> list[str]:
    said = []
    if row.get("word_recall") is not None:
        ok = row["word_recall"] >= TARGETS["word_recall"]
        said.append(f"page word recall on the unseen documents {row['word_recall']:.3f} (target >= "
                    f"{TARGETS['word_recall']}): {'PASS' if ok else 'FAIL'}")
    if row.get("gap") is not None:
        ok = row["gap"] <= TARGETS["gap"]
        said.append(f"exact match on the unseen crops {row['unseen_exact_match']:.3f}, {row['gap'] * 100:+.1f} points "
                    f"under the held-out training family's {row['seen_exact_match']:.3f} (target: within "
                    f"{TARGETS['gap'] * 100:.0f}): {'PASS' if ok else 'FAIL'}")
    return said


def write_report(out_dir: Path) -> Path:
    lines, md = staged_report(out_dir, MODULE, "Documents in fonts the training never saw")
    md += ["## The sets", "", "| set | split | documents | pages |", "|---|---|---|---|"]
    for name in ("train-set", "unseen-set"):
        for split, s in (lines.get(name, {}).get("result", {}).get("splits") or {}).items():
            md.append(f"| {name} | {split} | {', '.join(s['documents'])} | {s['pages']} |")
    table = rows(lines)
    md += ["", "## Recipes", "", "| recognizer | detector | steps | held-out family exact match | unseen exact match "
           "| gap (points) | unseen CER | unseen detection recall / precision | unseen page word recall |",
           "|---|---|---:|---:|---:|---:|---:|---|---:|"]

    def f(v: Any, spec: str = ".3f") -> str:
        return "-" if v is None else format(v, spec)

    for r in table:
        md.append(f"| {r['recipe']} | {r['detector'] or '-'} | {r['steps']} | {f(r['seen_exact_match'])} | "
                  f"{f(r['unseen_exact_match'])} | "
                  f"{f(r.get('gap') and r['gap'] * 100, '+.1f')} | {f(r['unseen_cer'])} | "
                  f"{f(r.get('recall'))} / {f(r.get('precision'))} | {f(r.get('word_recall'))} |")
    md += stages_table(lines)
    ship = next((r for r in table if (r["recipe"], r["detector"]) == SHIPPED), None)
    said = verdicts(ship) if ship else []
    alone = next((r for r in table if r["recipe"] == SHIPPED[0]), None)  # its crops, before its pages are read
    if ship is None and alone is not None:
        said = [f"page word recall with the detector `{SHIPPED[1]}`: not measured yet",
                *verdicts({k: v for k, v in alone.items() if k != "word_recall"})]
    if said:
        md += ["", f"## Targets (issue 56) on the shipped pair: recognizer `{SHIPPED[0]}`, detector `{SHIPPED[1]}`", "",
               *[f"- {v}" for v in said]]
    return write_outputs(out_dir, {"shipped": list(SHIPPED), "recipes": table, "verdicts": said}, md)


def main(argv: list[str] | None = None) -> int:
    p = parser(MODULE, __doc__)
    p.add_argument("--train-pdfs", nargs="+", default=None, help=f"default: {REAL_PDFS}/*.pdf")
    p.add_argument("--unseen-pdfs", nargs="+", default=None, help=f"default: {UNSEEN_PDFS}/*.pdf")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES), help="recognizer recipes")
    p.add_argument("--detectors", nargs="+", default=list(DETECTORS), choices=list(DETECTORS),
                   help="detector recipes")
    p.add_argument("--dpi", type=int, default=150)
    p.add_argument("--seed", type=int, default=4, help="the training set's split (default 4: freefem trains)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--det-input", default="256x256")
    p.add_argument("--det-batch", type=int, default=4)
    p.add_argument("--det-steps", type=int, default=900)
    p.add_argument("--reco-batch", type=int, default=32, help="recognizer crops per rank and step (default 32)")
    p.add_argument("--reco-steps", type=int, default=1480, help="every recipe's steps (default 1,480: "
                   "benchmarks.real_documents' 8 epochs of its crops)")
    p.add_argument("--timeout", type=int, default=4 * 3600, help="seconds each stage may take")
    args = p.parse_args(argv)
    return bench_main(MODULE, args, run, write_report)


if __name__ == "__main__":
    run_main(main)
