"""Born-digital PDFs into training data: which pages and words are kept, the train/val split, and the folders written.

Stages, each replaceable on its own (docs/make-dataset.md): a survey of every document, :func:`assign_splits`,
:func:`page_samples` per page (in parallel), and a writer (:class:`FolderWriter`) that receives them in page order.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from scale_ocr.boxes.crop import MIN_SIDE, crop_words
from scale_ocr.data import pdf_text
from scale_ocr.data.dataset_out import FolderWriter, publish, staging_dir, write_json
from scale_ocr.data.files import PAGE_LIMITS
from scale_ocr.data.page_pool import parallel_map
from scale_ocr.data.text_lines import text_lines
from scale_ocr.disk import disk_fault, kind_of
from scale_ocr.errors import UserError, shown

DPI_RANGE = (50, 600)  # below 50 dpi body text is a few pixels high; above 600 a page is ~5000 px a side for nothing
MIN_LINE_HEIGHT = 6.0  # pixels from a font's ascent to descent: text set smaller is nothing a recognizer reads
PNG_LEVEL = 6  # zlib level: deterministic for a given zlib, and the usual size/speed balance
SPLITS = ("train", "val")
# A box thinner than this (pixels) is no area: the detection folders' start-up check refuses a polygon under
# 0.01 px² (scale_ocr.data.detection.MIN_AREA), and a page with one such box would be refused whole.
MIN_BOX_SIDE = 0.25

# Why a word is left out. The first three leave a word out everywhere (nothing of it is drawn on the page); the
# others only leave the recognition set: its box stays in the detection labels, or visible text would be trained
# as background.
EVERYWHERE = {"invisible": "drawn with an invisible render mode (an OCR layer, clipping text)",
              "degenerate_box": f"a glyph box under {MIN_BOX_SIDE:g} px across",
              "off_page": "entirely outside the page"}
RECOGNITION_ONLY = {"out_of_vocab": "characters outside the vocabulary",
                    "slanted": "a baseline neither horizontal nor vertical",
                    "cut_by_page_edge": "partly outside the page",
                    "too_small": f"set on lines under {MIN_LINE_HEIGHT:g} px at this dpi",
                    "too_thin": f"a box under {MIN_SIDE:g} px wide or high (a rule, a bar): nothing page OCR reads",
                    "too_long": "more characters than the recognizer's CTC frames hold (--reco-width)"}
PAGE_SKIPS = {"no_text_layer": "no word in the text layer (scanned, or drawn as images or paths)",
              "invisible_text_layer": "only invisible text: an OCR layer over a scan, another engine's reading",
              "repeated_page": "the same text layer as another page read (a copy in another file): read once"}


@dataclass(frozen=True)
class Document:
    """One input PDF: ``pages`` holds each page's size in points after ``/Rotate`` and whether it has text;
    ``texts`` each page's text layer as a hash of its words ("" without text), which finds the same page in two
    files (a copy inside another PDF, a re-saved file)."""

    path: str
    sha256: str
    pages: tuple[tuple[float, float, bool], ...]
    texts: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        """The prefix of every file made from it: its content, not its name, so a renamed copy names the same."""
        return self.sha256[:16]


@dataclass
class PageJob:
    """What one worker needs to turn a page into samples."""

    path: str
    doc_id: str
    index: int
    split: str
    dpi: int
    vocab: str


@dataclass
class PageSamples:
    """A page's samples, encoded: its detection image and label, its word crops and what was left out."""

    split: str
    page_name: str
    page_png: bytes | None  # None when the page was skipped whole
    page_label: dict
    crops: list[tuple[str, bytes, str]]  # (file name, PNG, word)
    lines: list[tuple[str, bytes, str]] = field(default_factory=list)  # (file name, PNG, its words joined by " ")
    words_in_layer: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> words
    skipped: str | None = None  # the page-skip reason


def find_pdfs(args: Sequence[str]) -> list[Path]:
    """The PDFs named: files as given, folders searched recursively for ``*.pdf`` (any case), sorted; anything else
    named (a named pipe, a device) is refused by what it is."""
    found: list[Path] = []
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            # Not only regular files: a named pipe or a broken link called .pdf is refused by name when read.
            inside = sorted(p for p in path.rglob("*") if p.suffix.lower() == ".pdf" and not p.is_dir())
            if not inside:
                raise UserError(f"{shown(arg)} holds no *.pdf file; pass PDF files or folders that hold them")
            found += inside
        elif path.is_file():
            found.append(path)
        elif os.path.lexists(path):
            try:
                what = kind_of(path.stat().st_mode)
            except OSError:
                what = "a broken symbolic link"
            raise UserError(f"{shown(arg)} is {what}, not a PDF file or a folder; pass PDF files or folders that "
                            "hold them")
        else:
            raise UserError(f"{shown(arg)} does not exist; pass PDF files or folders that hold them")
    return found


def _text_hash(text: str) -> str:
    words = " ".join(text.split())
    return hashlib.sha256(words.encode("utf-8", "surrogatepass")).hexdigest() if words else ""


def _survey_one(path: str) -> Document:
    f = pdf_text.open_file(path)  # the bytes hashed are the bytes read: one open
    digest = hashlib.sha256()
    try:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
        f.seek(0)
    except BaseException:
        f.close()
        raise
    document = pdf_text.load(path, f)
    try:
        pages, texts = [], []
        for i in range(len(document)):
            with pdf_text.page_errors(path, i):
                page = document[i]
                texts.append(_text_hash(page.get_textpage().get_text_range()))
                pages.append((page.get_width(), page.get_height(), bool(texts[-1])))
        return Document(path, digest.hexdigest(), tuple(pages), tuple(texts))
    finally:
        document.close()


def check_dpi(dpi: int) -> None:
    if not DPI_RANGE[0] <= dpi <= DPI_RANGE[1]:
        raise UserError(f"--dpi {dpi} is outside {DPI_RANGE[0]}..{DPI_RANGE[1]}; 150 (the default) suits body text, "
                        "300 small print")


def check_sizes(documents: Sequence[Document], dpi: int) -> None:
    """Refuse, before any rendering, a page larger at ``dpi`` than a page image may be."""
    scale = dpi / pdf_text.POINTS_PER_INCH
    for doc in documents:
        for i, (w, h, _) in enumerate(doc.pages):
            pw, ph = int(np.ceil(w * scale)), int(np.ceil(h * scale))
            if max(pw, ph) > PAGE_LIMITS.max_side or pw * ph > PAGE_LIMITS.max_pixels:
                area = max(w * h, 1e-9)  # a page 0 pt wide has no area but may be too tall
                fits = int(min(PAGE_LIMITS.max_side / max(w, h), (PAGE_LIMITS.max_pixels / area) ** 0.5) * 72) - 1
                fix = (f"pass --dpi {fits} or lower, or leave this document out" if fits >= DPI_RANGE[0] else
                       f"it is too large even at the lowest --dpi {DPI_RANGE[0]}: leave this document out (or crop "
                       "or scale its pages to a paper size first)")
                raise UserError(f"{shown(doc.path)} page {i + 1} ({w:.0f}x{h:.0f} pt) is {pw}x{ph} px at --dpi {dpi}, "
                                f"larger than {PAGE_LIMITS.kind} can be ({PAGE_LIMITS}); {fix}")


def _draw(seed: int, unit: str) -> str:
    return hashlib.sha256(f"{seed}:{unit}".encode()).hexdigest()


def val_size(units: int, fraction: float | None, count: int | None, what: str) -> int:
    """How many of ``units`` go to val, or one line when the request cannot be met."""
    if count is not None:
        k = count
    elif fraction is not None:
        k = 0 if fraction == 0 else max(1, round(fraction * units))
    else:
        k = 0
    if k and k >= units:
        hint = " or --split-by page" if what == "documents" else ""
        raise UserError(f"val would take {k} of the {units} {what} with text and leave train none; lower "
                        f"--val-fraction / --val-count, add {what}{hint}")
    return k


def repeated_pages(documents: Sequence[Document]) -> set[tuple[str, int]]:
    """``(sha256, page index)`` of each page whose text layer an earlier page already has (in content-hash order,
    so whatever the names): read once, as a copy would put one page on both sides of the split."""
    seen: set[str] = set()
    repeats = set()
    for doc in sorted(documents, key=lambda d: d.sha256):
        for i, text in enumerate(doc.texts):
            if text and text in seen:
                repeats.add((doc.sha256, i))
            seen.add(text)
    return repeats


def assign_splits(documents: Sequence[Document], by: str, seed: int, fraction: float | None,
                  count: int | None) -> dict[tuple[str, int], str]:
    """``(sha256, page index) -> split`` for every page with text that no other page repeats (see
    :func:`repeated_pages`): a seeded draw over documents or pages.

    The draw ranks each unit by a hash of the seed and the unit's content hash, so it does not depend on file
    names, argument order or ``--jobs``, and a unit keeps its rank when others are added.
    """
    repeats = repeated_pages(documents)
    pages = [(d.sha256, i) for d in documents for i, p in enumerate(d.pages) if p[2] and (d.sha256, i) not in repeats]
    units = sorted({sha for sha, _ in pages}) if by == "document" else [f"{sha}:{i}" for sha, i in pages]
    k = val_size(len(units), fraction, count, "documents" if by == "document" else "pages")
    val = set(sorted(units, key=lambda u: _draw(seed, u))[:k])
    return {(sha, i): "val" if (sha if by == "document" else f"{sha}:{i}") in val else "train" for sha, i in pages}


def _png(image: Image.Image) -> bytes:
    """PNG bytes, grey when the RGB image is grey (a third of the size; every reader decodes it back to the same
    RGB). No text chunks and no time: the same pixels give the same bytes."""
    pixels = np.asarray(image)
    if (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 1] == pixels[..., 2]).all():
        image = Image.fromarray(np.ascontiguousarray(pixels[..., 0]))  # 2-D uint8: mode L
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=PNG_LEVEL)
    return buf.getvalue()


def _rounded(box: Sequence[float]) -> list[list[float]]:
    x0, y0, x1, y1 = (round(float(v), 2) for v in box)
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1]]


def _place(word: pdf_text.PdfWord, size: tuple[int, int]) -> tuple[str | None, tuple[float, ...] | None]:
    """``(reason left out everywhere or None, box clipped to the page)``."""
    if word.invisible:
        return "invisible", None
    x0, y0, x1, y1 = word.box
    if x1 - x0 <= 0 or y1 - y0 <= 0:
        return "degenerate_box", None
    clipped = (max(x0, 0.0), max(y0, 0.0), min(x1, float(size[0])), min(y1, float(size[1])))
    if clipped[2] - clipped[0] <= 0 or clipped[3] - clipped[1] <= 0:
        return "off_page", None
    if min(clipped[2] - clipped[0], clipped[3] - clipped[1]) < MIN_BOX_SIDE:
        return "degenerate_box", None
    return None, clipped


def _readable(word: pdf_text.PdfWord, box: tuple[float, ...], vocab: frozenset[str]) -> str | None:
    """Why a word on the page stays out of the recognition set, or None."""
    if not vocab.issuperset(word.text):
        return "out_of_vocab"
    if word.turn is None:
        return "slanted"
    if tuple(box) != tuple(word.box):
        return "cut_by_page_edge"
    return "too_small" if word.line_height < MIN_LINE_HEIGHT else None


# Clockwise quarter turns as PIL transposes (PIL's ROTATE_* turn counter-clockwise).
_UPRIGHT = {1: Image.Transpose.ROTATE_270, 2: Image.Transpose.ROTATE_180, 3: Image.Transpose.ROTATE_90}


def page_samples(page: pdf_text.PdfPage, job: PageJob) -> PageSamples:
    """Filter a page's words and encode its samples; a page without a visible word is skipped whole."""
    name = f"{job.doc_id}_p{job.index + 1:04d}"
    out = PageSamples(job.split, f"{name}.png", None, {}, [], words_in_layer=len(page.words))
    vocab = frozenset(job.vocab)  # a set, not scale_ocr.vocab.Vocab: a worker should not spend 2 s importing torch
    polygons, texts, readable, drawn = [], [], [], set()
    for k, word in enumerate(page.words):
        reason, box = _place(word, page.image.size)
        if reason:
            out.dropped[reason] += 1
            continue
        drawn.add(k)
        polygons.append(_rounded(box))
        texts.append(word.text)
        why = _readable(word, box, vocab)
        if why:
            out.dropped[why] += 1
        else:
            readable.append((k, word, box))
    if not polygons:
        out.skipped = "invisible_text_layer" if out.dropped.get("invisible") else "no_text_layer"
        return out
    out.page_png = _png(page.image)
    w, h = page.image.size
    out.page_label = {"img_dimensions": [h, w], "img_hash": hashlib.sha256(out.page_png).hexdigest(),
                      "polygons": polygons, "words": texts}
    crops = crop_words(page.image, np.array([_rounded(b) for _, _, b in readable]).reshape(-1, 4, 2))
    kept = []
    for (k, word, box), crop in zip(readable, crops, strict=True):
        if crop is None:  # under crop_words' MIN_SIDE: page OCR would not read it either
            out.dropped["too_thin"] += 1
            continue
        if word.turn:
            crop = crop.transpose(_UPRIGHT[word.turn])
        out.crops.append((f"{name}_w{k:05d}.png", _png(crop), word.text))
        kept.append((k, word, box))
    out.lines = line_samples(page.image, name, kept, drawn - {k for k, _, _ in kept})
    return out


def line_samples(image: Image.Image, name: str, words: Sequence[tuple[int, pdf_text.PdfWord, tuple[float, ...]]],
                 breaks: set[int]) -> list[tuple[str, bytes, str]]:
    """A page's line crops (:func:`text_lines`): each line's box around its words, cut with page OCR's padding and
    turned upright, labelled with its words joined by single spaces; named by its first word's index."""
    groups = text_lines(words, breaks)
    boxes = [[min(words[i][2][0] for i in g), min(words[i][2][1] for i in g), max(words[i][2][2] for i in g),
              max(words[i][2][3] for i in g)] for g in groups]
    out = []
    for group, crop in zip(groups, crop_words(image, np.array([_rounded(b) for b in boxes]).reshape(-1, 4, 2)),
                           strict=True):
        first, word, _ = words[group[0]]
        if crop is None:
            continue
        if word.turn:
            crop = crop.transpose(_UPRIGHT[word.turn])
        out.append((f"{name}_l{first:05d}.png", _png(crop), " ".join(words[i][1].text for i in group)))
    return out


def drop_long_words(samples: PageSamples, width: int) -> None:
    """Leave out of the recognition set the words a ``width``-pixel-wide recognizer cannot align (training's own
    start-up check would refuse them). Here, in the parent: the CTC rule lives beside torch, which workers skip."""
    if not width:
        return
    from scale_ocr.models.recognition.ctc import ctc_frames, ctc_frames_needed

    frames = ctc_frames((32, width))
    kept = [c for c in samples.crops if ctc_frames_needed(c[2]) <= frames]
    if len(kept) < len(samples.crops):
        samples.dropped["too_long"] += len(samples.crops) - len(kept)
        samples.crops = kept


_OPEN: dict[str, object] = {}  # a worker's open document: its pages arrive together (jobs are in page order)


def close_documents() -> None:
    """Close the document :func:`run_page` keeps open in this process."""
    for document in _OPEN.values():
        document.close()  # type: ignore[attr-defined]
    _OPEN.clear()


def run_page(job: PageJob) -> PageSamples:
    """Read, filter and encode one page (in a worker process, or inline with ``--jobs 1``)."""
    document = _OPEN.get(job.path)
    if document is None:
        close_documents()
        document = _OPEN[job.path] = pdf_text.open_pdf(Path(job.path))
    return page_samples(pdf_text.read_page(document, job.index, job.dpi, job.path), job)  # type: ignore[arg-type]


def distinct(documents: Iterable[Document]) -> tuple[list[Document], list[str]]:
    """Documents with distinct contents, and the paths of repeats (a copy would put one page on both sides)."""
    seen: set[str] = set()
    kept, repeats = [], []
    for doc in documents:
        (repeats if doc.sha256 in seen else kept).append(doc if doc.sha256 not in seen else doc.path)
        seen.add(doc.sha256)
    return kept, repeats  # type: ignore[return-value]


@dataclass(frozen=True)
class Options:
    """What ``scale-ocr make-dataset`` was asked for (its flags, the vocabulary resolved to characters)."""

    dpi: int = 150
    vocab: str = ""
    split_by: str = "document"
    val_fraction: float | None = 0.1
    val_count: int | None = None
    seed: int = 0
    jobs: int = 1
    reco_width: int = 128  # the recognizer's input width: its CTC frames bound a word's length; 0: no bound


def _survey(paths: Sequence[Path], jobs: int) -> tuple[list[Document], list[str]]:
    with closing(parallel_map(_survey_one, sorted(str(p) for p in paths), jobs)) as surveyed:
        documents = list(surveyed)  # the order named: no matter
    kept, repeats = distinct(documents)
    if not any(has_text for doc in kept for _, _, has_text in doc.pages):
        raise UserError(f"no page of the {len(kept)} document(s) has a text layer (scanned or drawn as images); "
                        "make-dataset labels words from the text layer, so pass born-digital PDFs")
    return kept, repeats


def _jobs(documents: Sequence[Document], splits: dict[tuple[str, int], str], opts: Options) -> list[PageJob]:
    return [PageJob(doc.path, doc.id, i, splits[doc.sha256, i], opts.dpi, opts.vocab)
            for doc in documents for i in range(len(doc.pages)) if (doc.sha256, i) in splits]


def _summary(documents: Sequence[Document], repeats: Sequence[str], opts: Options) -> dict:
    no_text = sum(1 for d in documents for p in d.pages if not p[2])
    skipped = {"no_text_layer": no_text, "repeated_page": len(repeated_pages(documents))}
    return {"options": {"dpi": opts.dpi, "vocab": opts.vocab, "reco_width": opts.reco_width,
                        "split_by": opts.split_by, "val_fraction": opts.val_fraction, "val_count": opts.val_count,
                        "seed": opts.seed},
            "documents": [{"path": d.path, "sha256": d.sha256, "pages": len(d.pages)}
                          for d in sorted(documents, key=lambda d: d.path)],
            "repeated_documents": list(repeats),
            "pages": {"in_documents": sum(len(d.pages) for d in documents), "written": 0,
                      "skipped": {k: n for k, n in skipped.items() if n}},
            "words": {"in_text_layer": 0, "detection": 0, "recognition": 0, "lines": 0, "left_out": {},
                      "left_out_of_recognition": {}},
            "splits": {s: {"documents": [], "pages": [], "recognition_words": 0, "lines": 0} for s in SPLITS}}


def _count(summary: dict, samples: PageSamples, doc_path: str) -> None:
    pages, words = summary["pages"], summary["words"]
    words["in_text_layer"] += samples.words_in_layer
    if samples.skipped:
        pages["skipped"][samples.skipped] = pages["skipped"].get(samples.skipped, 0) + 1
    for reason, n in samples.dropped.items():
        where = "left_out" if reason in EVERYWHERE else "left_out_of_recognition"
        words[where][reason] = words[where].get(reason, 0) + n
    if samples.page_png is None:
        return
    split = summary["splits"][samples.split]
    pages["written"] += 1
    words["detection"] += len(samples.page_label["words"])
    words["recognition"] += len(samples.crops)
    words["lines"] += len(samples.lines)
    split["pages"].append(samples.page_name)
    split["recognition_words"] += len(samples.crops)
    split["lines"] += len(samples.lines)
    if doc_path not in split["documents"]:
        split["documents"].append(doc_path)


def _write_all(pages: Iterable[PageSamples], jobs: Sequence[PageJob], stage: Path, summary: dict,
               opts: Options) -> None:
    writer = FolderWriter(stage)
    for job, samples in zip(jobs, pages, strict=True):
        drop_long_words(samples, opts.reco_width)
        writer.add(samples)
        _count(summary, samples, job.path)
    if not summary["pages"]["written"]:
        raise UserError(f"none of the {len(jobs)} page(s) with text has a visible word ({summary['pages']['skipped']});"
                        " make-dataset needs born-digital pages whose text is drawn")
    writer.close()
    for split in summary["splits"].values():  # the same whatever order the PDFs were named in
        split["documents"].sort()
        split["pages"].sort()
    write_json(stage / "summary.json", summary, indent=1)


def make_dataset(pdfs: Sequence[Path], out: Path, opts: Options,
                 progress: Callable[[Iterable, int], Iterable] = lambda it, n: it) -> dict:
    """Turn ``pdfs`` into docTR folders under ``out`` (see :class:`FolderWriter`) and ``out/summary.json``, and
    return that summary. Everything is written into a staging folder that becomes ``out`` by one rename at the end:
    a run that fails, is interrupted (Ctrl-C) or stopped (SIGTERM, under :func:`scale_ocr.errors.stop_on_sigterm`)
    stops its workers, removes that folder and leaves no partial dataset; a full disk is one line (exit 74)."""
    check_dpi(opts.dpi)
    stage = staging_dir(out)
    try:
        documents, repeats = _survey(pdfs, opts.jobs)
        check_sizes(documents, opts.dpi)
        splits = assign_splits(documents, opts.split_by, opts.seed, opts.val_fraction, opts.val_count)
        jobs = _jobs(documents, splits, opts)
        summary = _summary(documents, repeats, opts)
        with closing(parallel_map(run_page, jobs, opts.jobs)) as pages:
            _write_all(progress(pages, len(jobs)), jobs, stage, summary, opts)
        publish(stage, out)
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)  # first: the line says how much is free without it
        fault = disk_fault(exc, out, "the dataset", f"nothing was written (the partial folder {shown(stage.name)} is "
                                                    "removed)")
        if fault is not None:
            raise fault from None
        raise
    finally:
        close_documents()
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
    return summary
