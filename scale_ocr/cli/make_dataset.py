"""``scale-ocr make-dataset PDF... OUT``: born-digital PDFs into docTR recognition and detection folders.

Also ``python -m scale_ocr.cli.make_dataset``. What is kept, dropped and written: :mod:`scale_ocr.data.make_dataset`
and ``docs/make-dataset.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from scale_ocr.errors import UserError, on_interrupt, report_user_errors, say, shown, stop_on_sigterm


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in [0, 1)")
    return value


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build_parser() -> argparse.ArgumentParser:
    from scale_ocr.data.make_dataset import DPI_RANGE

    p = argparse.ArgumentParser(
        prog="scale-ocr make-dataset",
        description="Render born-digital PDFs and label their words from the text layer: OUT/recognition/{train,val} "
        "(word crops), OUT/detection/{train,val} (whole pages; labels carry each polygon's word, so "
        "`scale-ocr evaluate-pages` reads them too) and OUT/summary.json. OUT must not exist or be empty.")
    p.add_argument("inputs", nargs="+", metavar="PDF", help="PDF files, or folders searched recursively for *.pdf")
    p.add_argument("out", metavar="OUT", help="the dataset folder to create")
    p.add_argument("--dpi", type=int, default=150, help=f"rendering resolution, {DPI_RANGE[0]}..{DPI_RANGE[1]} "
                   "(default 150); pages are written at this native scale")
    p.add_argument("--vocab", default="latin", help="vocabulary NAME or its characters (default latin): words with "
                   "other characters stay out of the recognition set; their boxes stay in detection")
    p.add_argument("--vocab-file", default=None, metavar="FILE", help="the vocabulary's characters from a UTF-8 file")
    p.add_argument("--reco-width", type=int, default=128, metavar="W",
                   help="the recognizer's input width (default 128, the models' default): words needing more CTC "
                   "frames than it gives (W/4: a character each, one between repeated letters) stay out of the "
                   "recognition set, their boxes in detection; 0 keeps every word")
    p.add_argument("--split-by", choices=("document", "page"), default="document",
                   help="what goes to train or val whole (default document: no document on both sides)")
    val = p.add_mutually_exclusive_group()
    val.add_argument("--val-fraction", type=_fraction, default=None, metavar="F",
                     help="share of documents (or pages) in val (default 0.1, at least one when above 0)")
    val.add_argument("--val-count", type=int, default=None, metavar="N", help="exactly N documents (or pages) in val")
    p.add_argument("--seed", type=int, default=0, help="the split's draw (default 0)")
    p.add_argument("--jobs", type=int, default=_cores(), help="pages read in parallel (default: the usable cores)")
    return p


def _print_summary(summary: dict, out: Path) -> None:
    from scale_ocr.errors import PATH_LIMIT

    pages, words = summary["pages"], summary["words"]
    skipped = ", ".join(f"{n} {r}" for r, n in sorted(pages["skipped"].items())) or "none"
    say(f"scale-ocr: wrote {shown(out)}: {len(summary['documents'])} documents, {pages['written']} of "
        f"{pages['in_documents']} pages (skipped: {skipped})")
    say(f"  words in the text layer {words['in_text_layer']}, in detection labels {words['detection']}, "
        f"word crops {words['recognition']}, line crops {words['lines']}")
    for key, what in (("left_out", "left out everywhere"), ("left_out_of_recognition", "boxed, not cropped")):
        if words[key]:
            say(f"  {what}: " + ", ".join(f"{n} {r}" for r, n in sorted(words[key].items())))
    for name, split in summary["splits"].items():
        say(f"  {name}: {len(split['documents'])} documents, {len(split['pages'])} pages, "
            f"{split['recognition_words']} word crops, {split['lines']} line crops")
    if summary["repeated_documents"]:
        names = ", ".join(shown(p, PATH_LIMIT) for p in summary["repeated_documents"])
        say(f"  repeated documents, read once: {names}")


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from scale_ocr.data.make_dataset import Options, find_pdfs, make_dataset
    from scale_ocr.vocab import resolve_vocab

    args = build_parser().parse_args(argv)
    if args.jobs < 1:
        raise UserError(f"--jobs {args.jobs} is below 1; pass how many pages to read at once, e.g. --jobs 4")
    if args.reco_width < 0:
        raise UserError(f"--reco-width {args.reco_width} is negative; pass the recognizer's input width, or 0")
    if args.val_count is not None and args.val_count < 0:
        raise UserError(f"--val-count {args.val_count} is negative; pass 0 for no val set")
    fraction = 0.1 if args.val_fraction is None and args.val_count is None else args.val_fraction
    opts = Options(dpi=args.dpi, vocab=resolve_vocab(args.vocab, args.vocab_file), split_by=args.split_by,
                   val_fraction=fraction, val_count=args.val_count, seed=args.seed, jobs=args.jobs,
                   reco_width=args.reco_width)
    out = Path(args.out)
    pdfs = find_pdfs(args.inputs)

    def progress(items, total):
        return tqdm(items, total=total, desc="pages", unit="page", file=sys.stderr, disable=None)

    def left() -> str:  # asked when the interrupt is reported: it may land after OUT is renamed into place
        if (out / "summary.json").is_file():  # OUT had to be empty or missing, so this is the run's own
            return f"{shown(str(out))} was already written whole (its summary.json says what it holds)"
        return f"nothing was written: {shown(str(out))} is written whole at the end, and the partial folder was removed"

    on_interrupt(left)
    with stop_on_sigterm():
        summary = make_dataset(pdfs, out, opts, progress)
    _print_summary(summary, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
