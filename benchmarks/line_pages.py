"""Page OCR by lines against page OCR by words, on the real-document benchmark's documents (issue 57).

    python -m benchmarks.line_pages --out benchmarks/results/line-pages-HOST-DATE
    python -m benchmarks.line_pages --report DIR                                  # rebuild report.md

benchmarks.real_documents' stages (its set, split by document: FreeFEM's manual trains, CamlIDL's is held out; its
detector; its word recognizer), and a line recognizer: the same crnn_mobilenet_v3_small trained on the training
pages' line crops at their own width (``--max-width``), mixed with synthetic text lines in every installed font
(``--line-synthetic``), validated on the held-out lines. Both pipelines then read
the held-out pages with the same detector (``scale-ocr evaluate-pages --read words`` and ``--read lines``): word
recall and precision, the CER per line, and the seconds per page. Each stage is one command whose line goes to
``results.jsonl`` (an interrupted run resumes at the first without a line).

The report checks issue 57's target: the line pipeline's page word recall >= the word pipeline's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks import real_documents
from benchmarks.harness import TRAIN, bench_main, launch_command, parser, run_main, write_outputs

MODULE = "line_pages"


def commands(args: argparse.Namespace, work: Path) -> dict[str, list[str]]:
    """Each stage's command line, in order: real_documents' set, detector and word recognizer, the line recognizer,
    then each pipeline on the held-out pages."""
    words = real_documents.commands(args, work)
    data, det, lines = work / "set", work / "det", work / "reco-lines"
    held_out = data / "detection" / "val"
    del words["pages"]  # read by both pipelines below
    return {
        **words,
        "line-recognizer": launch_command("torchrun", args.world_size, TRAIN, [
            real_documents.RECOGNIZER, *line_sources(args, data / "lines" / "train"),
            "--val-path", str(data / "lines" / "val"), "--max-width", str(args.max_width),
            "-b", str(args.line_batch), "--max-steps", str(args.line_steps), "--epochs", "100000",
            "--eval-every", str(max(1, args.line_steps // 4)), "--output-dir", str(lines),
            "--resume", "none", "--log-every", "25", "--wandb-mode", "offline"]),
        "pages-words": real_documents.pages_command(det, work / "reco", held_out, "--read", "words"),
        "pages-lines": real_documents.pages_command(det, lines, held_out, "--read", "lines"),
    }


def line_sources(args: argparse.Namespace, lines: Path) -> list[str]:
    """The line recognizer's training data: the training pages' lines, mixed with synthetic text lines in every
    installed font at ``--line-synthetic``'s share (0: the lines alone)."""
    share = args.line_synthetic
    if not share:
        return ["--train-path", str(lines)]
    return ["--train-path", f"{lines}={1 - share:g}", f"synthetic={share:g}", "--synthetic-words", "text", "--fonts",
            "installed", "--min-chars", "1", "--max-chars", "80", "--train-samples", str(args.line_synthetic_samples)]


def result(stage: str, work: Path, stdout: str) -> dict[str, Any]:
    if stage == "line-recognizer":
        return real_documents.trained(work / "reco-lines")
    return real_documents.result("pages" if stage.startswith("pages-") else stage, work, stdout)


def run(args: argparse.Namespace) -> None:
    real_documents.run_stages(args.out, MODULE, lambda work: commands(args, work), result, args.timeout)


def write_report(out_dir: Path) -> Path:
    lines, md = real_documents.staged_report(out_dir, MODULE, "Page OCR by lines against by words: real documents' "
                                             "held-out pages")
    md += ["## Recognizers (held-out crops of their kind)", "",
          "| recognizer | steps | global batch | exact match | CER |", "|---|---:|---:|---:|---:|"]
    for stage in ("recognizer", "line-recognizer"):
        if stage in lines:
            r = lines[stage]["result"]
            md.append(f"| {stage} | {r['steps']} | {r.get('global_batch')} | {r['exact_match']:.3f} | {r['cer']:.3f} |")
    md += ["", "## Pipelines on the held-out pages", "", "| read by | word recall | word precision | line CER | "
           "detection recall / precision | seconds per page |", "|---|---:|---:|---:|---|---:|"]
    pages = {s.split("-", 1)[1]: lines[s]["result"] for s in ("pages-words", "pages-lines") if s in lines}
    for name, r in pages.items():
        md.append(f"| {name} | {r['word_recall']:.3f} | {r['word_precision']:.3f} | {r['line_cer']:.3f} | "
                  f"{r['recall']:.3f} / {r['precision']:.3f} | {r['seconds_per_page']:.2f} |")
    md += real_documents.stages_table(lines)
    verdicts = []
    if len(pages) == 2:
        w, ln = pages["words"]["word_recall"], pages["lines"]["word_recall"]
        verdicts.append(f"page word recall by lines {ln:.3f} >= by words {w:.3f}: {'PASS' if ln >= w else 'FAIL'}")
        md += ["", "## Target (issue 57)", "", *[f"- {v}" for v in verdicts]]
    return write_outputs(out_dir, {"pipelines": pages, "verdicts": verdicts}, md)


def main(argv: list[str] | None = None) -> int:
    p = parser(MODULE, __doc__)
    real_documents.add_arguments(p)
    p.add_argument("--max-width", type=int, default=1536, help="the line recognizer's widest input at height 32 "
                   "(default 1,536: the held-out manual's longest line, 113 characters, is 1,493 px)")
    p.add_argument("--line-batch", type=int, default=8, help="line crops per rank and step (default 8)")
    p.add_argument("--line-steps", type=int, default=2000, help="the line recognizer's steps (default 2,000: about "
                   "as many pixels as the word recognizer's 8 epochs, twice over)")
    p.add_argument("--line-synthetic", type=float, default=0.5, help="the share of synthetic text lines (every "
                   "installed font) mixed with the training pages' lines (default 0.5; 0: the lines alone: 500 steps "
                   "of them alone read 0.3%% of the held-out lines, CER 0.57)")
    p.add_argument("--line-synthetic-samples", type=int, default=8192, help="synthetic text lines an epoch draws from")
    args = p.parse_args(argv)
    return bench_main(MODULE, args, run, write_report)


if __name__ == "__main__":
    run_main(main)
