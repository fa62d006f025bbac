"""Page OCR: a detector finds the words of a page, a recognizer reads them, and they come back in reading order.

Two pipelines (``read``): ``words`` reads each detected word's crop; ``lines`` groups the detected words into lines
(:func:`~scale_ocr.boxes.reading_lines`), reads each line's crop at its own width with a recognizer trained so
(``--max-width``), and gives each word it read to the detected box where CTC read it.

The two models are any detection and recognition checkpoints or exports (:func:`scale_ocr.checkpoint.export.load_any`);
each task feeds and decodes its own model, so this module only cuts the detected words out of the page, hands
them to the recognizer and puts the results back together. ``scale-ocr predict --det --reco`` and
``scale-ocr evaluate-pages`` are the command-line faces of :func:`read_pages` and :func:`evaluate_pages`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from scale_ocr.boxes import LocalizationMetric, OCRMetric, reading_lines
from scale_ocr.boxes.crop import PAD, crop_words, readable
from scale_ocr.checkpoint.export import LoadedModel
from scale_ocr.data.files import WORD_LIMITS, open_rgb
from scale_ocr.errors import UserError, printable

LABEL_COLOUR = (220, 0, 0)


@torch.no_grad()
def predict(loaded: LoadedModel, images: list[str], batch_size: int = 64) -> list[dict[str, Any]]:
    """One result per image file, a batch of files at a time: a recognizer's ``{"image", "word", "confidence"}``,
    a detector's ``{"image", "boxes": [{"polygon": [[x, y] x 4] in the page's pixels, "score"}]}``."""
    task, results = loaded.task, []
    for i in range(0, len(images), batch_size):  # a folder can be large
        chunk = images[i:i + batch_size]
        if hasattr(task, "recognize"):
            words = task.recognize(loaded.model, [open_rgb(name, WORD_LIMITS) for name in chunk], batch_size)
            results += [{"image": n, "word": w, "confidence": c} for n, (w, c) in zip(chunk, words, strict=True)]
            continue
        found = task.detect(loaded.model, [open_rgb(n) for n in chunk], batch_size)
        results += [{"image": name, "boxes": [{"polygon": np.round(poly, 1).tolist(), "score": round(float(s), 4)}
                                              for poly, s in boxes]} for name, boxes in zip(chunk, found, strict=True)]
    return results


def prediction_line(result: dict[str, Any]) -> str:
    """One result of :func:`predict` as ``scale-ocr predict`` prints it: a word as ``image<TAB>word<TAB>confidence``
    (one line whatever the file name holds: a newline would forge a line), boxes as JSON."""
    if "word" in result:
        return f"{printable(result['image'])}\t{printable(result['word'])}\t{result['confidence']:.4f}"
    return json.dumps(result)


def check_models(detector: LoadedModel, recognizer: LoadedModel) -> None:
    """Refuse, in one line naming the file, a detector that does not detect or a recognizer that does not read.

    Page OCR composes exactly these two tasks, so it compares their names (no trainer code does).
    """
    from scale_ocr.models.factory import list_models
    from scale_ocr.tasks.registry import task_name

    for loaded, role, flag, want in ((detector, "detector", "--det", "detection"),
                                     (recognizer, "recognizer", "--reco", "recognition")):
        if loaded.task.name != want:
            examples = ", ".join(m for m in list_models("*") if task_name(m) == want)
            raise UserError(f"{loaded.source or 'the ' + role} holds {loaded.arch}, a {loaded.task.name} model, "
                            f"but the {role} ({flag}) must be a {want} model ({examples}); check which file "
                            f"goes to --det and which to --reco")


def _word(poly: np.ndarray, text: str, confidence: float, box_score: float, line: int) -> dict[str, Any]:
    return {"polygon": np.round(poly, 1).tolist(), "text": text, "confidence": round(float(confidence), 4),
            "box_score": round(float(box_score), 4), "line": line}


def _polygons(words: Sequence[dict[str, Any]]) -> np.ndarray:
    """The (N, 4, 2) polygons of :func:`read_pages` words."""
    return np.array([w["polygon"] for w in words], dtype=np.float64).reshape(-1, 4, 2)


def _page_words(page: Image.Image, boxes: list) -> tuple[list[np.ndarray], list[float], list[list[int]]]:
    """A page's detected boxes with some area on it (polygons clipped to the page, scores) and their lines in
    reading order. A box in the detector's padding lies beyond the page: clipped, it has no area and is dropped."""
    polys, scores = [], []
    for p, score in boxes:
        poly = np.clip(np.asarray(p, np.float64), 0, [page.width, page.height])
        if readable(poly):
            polys.append(poly)
            scores.append(score)
    return polys, scores, reading_lines(polys)


def _line_box(polys: Sequence[np.ndarray]) -> np.ndarray:
    """The upright rectangle around a line's word polygons, as a polygon."""
    pts = np.concatenate(list(polys))
    (x0, y0), (x1, y1) = pts.min(axis=0), pts.max(axis=0)
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]])


def _by_words(recognizer: LoadedModel, pages: list, word_batch_size: int, pad: float) -> list[list[tuple[str, float]]]:
    """Per page, the text and confidence of each box (``_page_words``' order): each word's crop read alone."""
    crops, where = [], []
    for i, (page, polys, _, _) in enumerate(pages):
        for j, crop in enumerate(crop_words(page, polys, pad)):
            crops.append(crop)
            where.append((i, j))
    out = [[("", 0.0)] * len(p[1]) for p in pages]
    texts = recognizer.task.recognize(recognizer.model, crops, word_batch_size) if crops else []
    for (i, j), text in zip(where, texts, strict=True):
        out[i][j] = text
    return out


def _by_lines(recognizer: LoadedModel, pages: list, word_batch_size: int, pad: float) -> list[list[tuple[str, float]]]:
    """Per page, the text and confidence of each box (``_page_words``' order): each line's crop read at its own width,
    each word read given to the box of its line whose columns hold its middle (or the nearest); a box given two
    words reads them with a space, a box given none reads nothing."""
    crops, where = [], []
    for i, (page, polys, _, lines) in enumerate(pages):
        rects = [_line_box([polys[j] for j in line]) for line in lines]
        for line, rect, crop in zip(lines, rects, crop_words(page, rects, pad), strict=True):
            if crop is not None:
                crops.append(crop)
                where.append((i, line, max(0, int(np.floor(rect[0, 0] - pad)))))  # the crop's left edge on the page
    out = [[["", 1.0, 0] for _ in p[1]] for p in pages]  # text, confidence, words given
    read = recognizer.task.read_lines(recognizer.model, crops, word_batch_size) if crops else []
    for (i, line, left), crop, words in zip(where, crops, read, strict=True):
        polys = pages[i][1]
        spans = np.array([[polys[j][:, 0].min(), polys[j][:, 0].max()] for j in line])
        for word, conf, x0, x1 in words:
            x = left + (x0 + x1) / 2 * crop.width
            k = line[int(np.argmin(np.maximum(spans[:, 0] - x, 0) + np.maximum(x - spans[:, 1], 0)))]
            got = out[i][k]
            got[0], got[1], got[2] = (f"{got[0]} {word}" if got[2] else word), min(got[1], conf), got[2] + 1
    return [[(t, c if n else 0.0) for t, c, n in page] for page in out]


PIPELINES = {"words": _by_words, "lines": _by_lines}


def read_pages(detector: LoadedModel, recognizer: LoadedModel, pages: Sequence[Image.Image], batch_size: int = 4,
               word_batch_size: int = 64, pad: float = PAD, det_size: tuple[int, int] | str | None = None,
               keep_unread: bool = False, max_side: int | None = None, read: str = "words"
               ) -> list[list[dict[str, Any]]]:
    """The words of each page, in reading order.

    Args:
        detector: a detection model (its task's ``detect`` finds boxes in the page's pixels).
        recognizer: a recognition model (its task's ``recognize`` reads the crops).
        pages: PIL pages of any size.
        batch_size: pages per detector batch; the words of those pages are read together.
        word_batch_size: crops per recognizer batch.
        pad: see :func:`crop_words`.
        det_size: ``(H, W)`` pages are fitted into for the detector, or ``auto``: each page whole at the scale the
            detector trained at, padded up to a multiple of 32; None: as the detector trained (``auto`` after
            ``--page-scale native`` or a factor, its input size after ``fit``).
        keep_unread: also return boxes in which the recognizer read nothing (an empty text). They are not
            words, so page OCR drops them; evaluation keeps them to score the detector on all its boxes.
        max_side: with ``auto``, the longest side a page is read at; None: the detector's ``--max-page-side``.
        read: ``words`` (each word's crop) or ``lines`` (each line's crop, with a recognizer that reads crops at
            their own width): a key of :data:`PIPELINES`.

    Returns:
        Per page, one ``{"polygon": [[x, y] x 4] (page pixels, 0.1 px), "text", "confidence", "box_score",
        "line"}`` per word, JSON-serialisable. ``confidence`` is the recognizer's (lowest character probability),
        ``box_score`` the detector's (mean probability inside the box), ``line`` the number of its line in reading
        order (from 0).
    """
    check_models(detector, recognizer)
    if read not in PIPELINES:
        raise UserError(f"--read {read}: page OCR reads {' or '.join(PIPELINES)}")
    results: list[list[dict[str, Any]]] = []
    for start in range(0, len(pages), batch_size):
        chunk = pages[start:start + batch_size]
        found = detector.task.detect(detector.model, list(chunk), batch_size, det_size, max_side)
        kept = [(page, *_page_words(page, boxes)) for page, boxes in zip(chunk, found, strict=True)]
        texts = PIPELINES[read](recognizer, kept, word_batch_size, pad)
        for (_, polys, scores, lines), page_texts in zip(kept, texts, strict=True):
            ordered = [_word(polys[j], *page_texts[j], scores[j], n) for n, line in enumerate(lines) for j in line]
            results.append(ordered if keep_unread else [w for w in ordered if w["text"]])
    return results


def _label_font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    from scale_ocr.data.synthetic import system_fonts

    fonts = system_fonts()
    sans = [f for f in fonts if f.endswith("DejaVuSans.ttf")]
    return ImageFont.truetype((sans or list(fonts))[0], size) if fonts else ImageFont.load_default(size=size)


def overlay(page: Image.Image, words: Sequence[dict[str, Any]], colour: tuple[int, int, int] = LABEL_COLOUR
            ) -> Image.Image:
    """The page with each word's box outlined and its text written just above it (below at the top edge).

    Args:
        page: the page the words were read from.
        words: :func:`read_pages` results for it (``polygon`` and ``text`` are used).
        colour: boxes and text.

    Returns:
        A new RGB image of the page's size.
    """
    from scale_ocr.boxes.draw import draw_polygons

    polys = _polygons(words)
    thickness = max(1, round(min(page.size) / 500))
    img = Image.fromarray(draw_polygons(np.asarray(page.convert("RGB")), polys, colour, thickness)).convert("RGBA")
    if not len(polys):
        return img.convert("RGB")
    # Labels as tall as most words (within reason), on a translucent white tab so they read over any page.
    font = _label_font(int(np.clip(0.7 * np.median(np.ptp(polys[:, :, 1], axis=1)), 10, 48)))
    layer = Image.new("RGBA", img.size, (0, 0, 0, 0))
    draw = ImageDraw.Draw(layer)
    for word, poly in zip(words, polys, strict=True):
        if not word["text"]:
            continue
        left, top, right, bottom = draw.textbbox((0, 0), word["text"], font=font)
        x = float(np.clip(poly[:, 0].min(), 0, max(0, img.width - (right - left)))) - left
        y = float(poly[:, 1].min()) - (bottom - top) - 2 - top
        if y + top < 0:  # no room above the box
            y = float(poly[:, 1].max()) + 2 - top
        draw.rectangle((x + left - 1, y + top - 1, x + right + 1, y + bottom + 1), fill=(255, 255, 255, 190))
        draw.text((x, y), word["text"], fill=(*colour, 255), font=font)
    return Image.alpha_composite(img, layer).convert("RGB")


class LineCER:
    """Character error rate per line of text. True lines are a page's true words grouped as page OCR groups detected
    ones (:func:`~scale_ocr.boxes.reading_lines`), their words joined by single spaces. Each word read goes to the
    true line whose rectangle holds its box's centre, and a true line's reading is its words, left to right, joined
    so: however either side cut its lines, each true line is compared with what was read on it. A word read on no
    true line counts its characters as errors."""

    def __init__(self) -> None:
        self.edits = self.chars = self.lines = 0

    def update(self, words: Sequence[dict[str, Any]], gt_polys: np.ndarray, gt_words: Sequence[str]) -> None:
        from scale_ocr.tasks.text_metrics import edit_distance

        gt_lines = reading_lines(gt_polys)
        truth = [" ".join(gt_words[i] for i in line) for line in gt_lines]
        rects = np.array([_line_box([gt_polys[i] for i in line])[[0, 2]].ravel() for line in gt_lines]).reshape(-1, 4)
        said: list[list[tuple[float, str]]] = [[] for _ in gt_lines]
        for word in words:
            if not word["text"]:
                continue
            x, y = np.asarray(word["polygon"]).mean(axis=0)
            on = np.nonzero((rects[:, 0] <= x) & (x <= rects[:, 2]) & (rects[:, 1] <= y) & (y <= rects[:, 3]))[0]
            if len(on):
                said[int(on[0])].append((x, word["text"]))
            else:
                self.edits += len(word["text"])
        self.edits += sum(edit_distance(" ".join(t for _, t in sorted(got)), true) for got, true in zip(said, truth,
                                                                                                          strict=True))
        self.chars += sum(map(len, truth))
        self.lines += len(truth)


def evaluate_pages(detector: LoadedModel, recognizer: LoadedModel, folder_paths: Sequence[str | Path],
                   batch_size: int = 4, det_size: tuple[int, int] | str | None = None,
                   max_side: int | None = None, read: str = "words") -> dict[str, float | int]:
    """End-to-end accuracy of a detector and recognizer pair on docTR detection folders whose labels carry words.

    Detection is scored on boxes alone (``LocalizationMetric``: one-to-one matching at IoU 0.5), reading on
    boxes and text (``OCRMetric``: a true word is read when its matched box's text equals it), both in the
    original pages' pixels.

    ``det_size``, ``max_side`` and ``read`` (the pipeline) are :func:`read_pages`'.

    Returns:
        ``pages``, ``gt_words``, ``pred_words`` (words read), ``unread_boxes`` (boxes read as nothing: scored
        by detection, not words), ``gt_lines`` (counts), ``recall``, ``precision``, ``mean_iou`` (detection),
        ``word_recall``, ``word_precision`` and their case-insensitive ``ci_`` variants (rates in [0, 1]),
        ``line_cer`` (:class:`LineCER`), ``seconds_per_page`` (page OCR's wall time, reading the pages
        included), and ``read``.
    """
    import time

    from scale_ocr.data.detection import DetectionFolder

    check_models(detector, recognizer)
    folders = [DetectionFolder((str(p),), "error", transform=None) for p in folder_paths]
    for path, folder in zip(folder_paths, folders, strict=True):
        for page in folder.pages:
            if len(page.words) != len(page.polygons):
                raise UserError(f"{Path(path) / 'labels.json'}: {page.path.name!r} has no \"words\"; end-to-end "
                                "accuracy needs each polygon's text, so add a \"words\" list parallel to "
                                "\"polygons\" (or measure the detector alone with its validation)")
    boxes, texts, lines = LocalizationMetric(), OCRMetric(), LineCER()
    samples = [(folder, i) for folder in folders for i in range(len(folder))]
    unread, seconds = 0, 0.0
    for start in range(0, len(samples), batch_size):
        t0 = time.perf_counter()
        chunk = [folder[i] for folder, i in samples[start:start + batch_size]]  # (image, polygons, words)
        found = read_pages(detector, recognizer, [c[0] for c in chunk], batch_size, det_size=det_size,
                           keep_unread=True, max_side=max_side, read=read)
        seconds += time.perf_counter() - t0
        for (_, gt_polys, gt_words), words in zip(chunk, found, strict=True):
            lines.update(words, gt_polys, gt_words)
            # The detector is scored on every box it found; page OCR's words are those with text read.
            boxes.update(_polygons(words), gt_polys)
            said = [w for w in words if w["text"]]
            unread += len(words) - len(said)
            texts.update(_polygons(said), [w["text"] for w in said], gt_polys, gt_words)
    return {"pages": len(samples), "gt_words": texts.num_gt, "pred_words": texts.num_pred, "unread_boxes": unread,
            "gt_lines": lines.lines, **LocalizationMetric.rates(boxes.sums()), **OCRMetric.rates(texts.sums()),
            "line_cer": lines.edits / max(lines.chars, 1), "seconds_per_page": seconds / max(len(samples), 1),
            "read": read}
