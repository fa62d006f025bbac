"""Page OCR: a detector finds the words of a page, a recognizer reads each one, and they come back in reading order.

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

from scale_ocr.boxes import LocalizationMetric, OCRMetric, reading_order
from scale_ocr.boxes.crop import PAD, crop_words
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


def _word(poly: np.ndarray, text: str, confidence: float, box_score: float) -> dict[str, Any]:
    return {"polygon": np.round(poly, 1).tolist(), "text": text, "confidence": round(float(confidence), 4),
            "box_score": round(float(box_score), 4)}


def _polygons(words: Sequence[dict[str, Any]]) -> np.ndarray:
    """The (N, 4, 2) polygons of :func:`read_pages` words."""
    return np.array([w["polygon"] for w in words], dtype=np.float64).reshape(-1, 4, 2)


def read_pages(detector: LoadedModel, recognizer: LoadedModel, pages: Sequence[Image.Image], batch_size: int = 4,
               word_batch_size: int = 64, pad: float = PAD, det_size: tuple[int, int] | str | None = None,
               keep_unread: bool = False, max_side: int | None = None) -> list[list[dict[str, Any]]]:
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

    Returns:
        Per page, one ``{"polygon": [[x, y] x 4] (page pixels, 0.1 px), "text", "confidence", "box_score"}``
        per word, JSON-serialisable. ``confidence`` is the recognizer's (lowest character probability),
        ``box_score`` the detector's (mean probability inside the box).
    """
    check_models(detector, recognizer)
    results: list[list[dict[str, Any]]] = []
    for start in range(0, len(pages), batch_size):
        chunk = pages[start:start + batch_size]
        found = detector.task.detect(detector.model, list(chunk), batch_size, det_size, max_side)
        crops: list[Image.Image] = []
        kept: list[list[tuple[np.ndarray, float]]] = []  # per page: (polygon, box score) of each crop
        for page, boxes in zip(chunk, found, strict=True):
            # A box in the detector's padding lies beyond the page: clipped, it has no area and is dropped.
            polys = [np.clip(np.asarray(p, np.float64), 0, [page.width, page.height]) for p, _ in boxes]
            page_kept = []
            for poly, (_, score), crop in zip(polys, boxes, crop_words(page, polys, pad), strict=True):
                if crop is not None:
                    crops.append(crop)
                    page_kept.append((poly, score))
            kept.append(page_kept)
        texts = iter(recognizer.task.recognize(recognizer.model, crops, word_batch_size) if crops else [])
        for page_kept in kept:
            words = [_word(poly, *next(texts), score) for poly, score in page_kept]
            ordered = [words[i] for i in reading_order([p for p, _ in page_kept])]
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


def evaluate_pages(detector: LoadedModel, recognizer: LoadedModel, folder_paths: Sequence[str | Path],
                   batch_size: int = 4, det_size: tuple[int, int] | str | None = None,
                   max_side: int | None = None) -> dict[str, float | int]:
    """End-to-end accuracy of a detector and recognizer pair on docTR detection folders whose labels carry words.

    Detection is scored on boxes alone (``LocalizationMetric``: one-to-one matching at IoU 0.5), reading on
    boxes and text (``OCRMetric``: a true word is read when its matched box's text equals it), both in the
    original pages' pixels.

    ``det_size`` and ``max_side`` are :func:`read_pages`'.

    Returns:
        ``pages``, ``gt_words``, ``pred_words`` (words read), ``unread_boxes`` (boxes read as nothing: scored
        by detection, not words) (counts), ``recall``, ``precision``, ``mean_iou`` (detection),
        ``word_recall``, ``word_precision`` and their case-insensitive ``ci_`` variants (rates in [0, 1]).
    """
    from scale_ocr.data.detection import DetectionFolder

    check_models(detector, recognizer)
    folders = [DetectionFolder((str(p),), "error", transform=None) for p in folder_paths]
    for path, folder in zip(folder_paths, folders, strict=True):
        for page in folder.pages:
            if len(page.words) != len(page.polygons):
                raise UserError(f"{Path(path) / 'labels.json'}: {page.path.name!r} has no \"words\"; end-to-end "
                                "accuracy needs each polygon's text, so add a \"words\" list parallel to "
                                "\"polygons\" (or measure the detector alone with its validation)")
    boxes, texts = LocalizationMetric(), OCRMetric()
    samples = [(folder, i) for folder in folders for i in range(len(folder))]
    unread = 0
    for start in range(0, len(samples), batch_size):
        chunk = [folder[i] for folder, i in samples[start:start + batch_size]]  # (image, polygons, words)
        found = read_pages(detector, recognizer, [c[0] for c in chunk], batch_size, det_size=det_size,
                           keep_unread=True, max_side=max_side)
        for (_, gt_polys, gt_words), words in zip(chunk, found, strict=True):
            # The detector is scored on every box it found; page OCR's words are those with text read.
            boxes.update(_polygons(words), gt_polys)
            read = [w for w in words if w["text"]]
            unread += len(words) - len(read)
            texts.update(_polygons(read), [w["text"] for w in read], gt_polys, gt_words)
    return {"pages": len(samples), "gt_words": texts.num_gt, "pred_words": texts.num_pred, "unread_boxes": unread,
            **LocalizationMetric.rates(boxes.sums()), **OCRMetric.rates(texts.sums())}
