"""Cutting words out of a page: an upright box as is, any other quadrilateral warped onto an upright rectangle.

Page OCR and the synthetic words a page-OCR recognizer trains on both cut here, so both see words cut the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import cv2
import numpy as np
from PIL import Image

from scale_ocr.boxes.metrics import as_polygons

# Pixels of page kept around each word: recognizers are trained on crops whose ink does not touch the border,
# and a detector's box may shave the tips of letters.
PAD = 1.5
MIN_SIDE = 1.0  # a word narrower or lower than this (pixels, inside the page) is nothing to read


def _upright(poly: np.ndarray) -> bool:
    """Every edge horizontal or vertical (what an axis-aligned detector returns)."""
    edges = np.abs(np.roll(poly, -1, axis=0) - poly)
    return bool(np.all(edges.min(axis=1) <= 1e-6 * max(1.0, float(np.abs(poly).max()))))


def _side_lengths(quad: np.ndarray) -> tuple[float, float]:
    """Width (mean of top and bottom edges) and height (mean of left and right) of a clockwise quadrilateral."""
    tl, tr, br, bl = quad
    width = (np.linalg.norm(tr - tl) + np.linalg.norm(br - bl)) / 2
    height = (np.linalg.norm(bl - tl) + np.linalg.norm(br - tr)) / 2
    return float(width), float(height)


def readable(quad: np.ndarray) -> bool:
    """Whether a word's polygon (inside its page) has the area :func:`crop_words` cuts out: sides of a pixel or more."""
    if _upright(quad):
        return bool(np.ptp(quad[:, 0]) >= MIN_SIDE and np.ptp(quad[:, 1]) >= MIN_SIDE)
    return min(_side_lengths(quad)) >= MIN_SIDE


def _crop(page: Image.Image, pixels: np.ndarray, poly: np.ndarray, pad: float) -> Image.Image | None:
    h, w = pixels.shape[:2]
    quad = np.clip(poly, 0, [w, h])  # the part of the word on the page
    if not readable(quad):
        return None
    if _upright(quad):
        (x0, y0), (x1, y1) = quad.min(axis=0), quad.max(axis=0)
        # Whole pixels covering the padded box (pixel i covers [i, i + 1)), clipped to the page.
        box = (max(0, int(np.floor(x0 - pad))), max(0, int(np.floor(y0 - pad))),
               min(w, int(np.ceil(x1 + pad))), min(h, int(np.ceil(y1 + pad))))
        return page.crop(box)
    width, height = _side_lengths(quad)
    tl, tr, br, bl = quad
    across, down = (tr - tl) + (br - bl), (bl - tl) + (br - tr)  # the word's own axes
    u, v = pad * across / np.linalg.norm(across), pad * down / np.linalg.norm(down)
    src = np.float32([tl - u - v, tr + u - v, br + u + v, bl - u + v])
    out_w, out_h = max(1, round(width + 2 * pad)), max(1, round(height + 2 * pad))
    dst = np.float32([[0, 0], [out_w, 0], [out_w, out_h], [0, out_h]])
    # Corners in continuous coordinates; OpenCV puts pixel centres on integers, half a pixel earlier.
    matrix = cv2.getPerspectiveTransform(src - 0.5, dst - 0.5)
    # The padding may reach past the page's edge: repeat the edge rather than paint a black frame.
    warped = cv2.warpPerspective(pixels, matrix, (out_w, out_h), flags=cv2.INTER_LINEAR,
                                 borderMode=cv2.BORDER_REPLICATE)
    return Image.fromarray(warped)


def crop_words(page: Image.Image, polygons: np.ndarray | Sequence, pad: float = PAD) -> list[Image.Image | None]:
    """Each word of a page cut out and straightened (RGB), ready for a recognizer.

    ``polygons``: (N, 4, 2) in the page's pixels, clockwise on screen from the word's top-left corner, or (N, 4)
    ``(xmin, ymin, xmax, ymax)`` boxes; ``pad``: pixels kept around each word, along its own axes. One crop per
    polygon, None where less than a pixel of it lies inside the page, so the list stays parallel to ``polygons``.
    """
    page = page.convert("RGB")
    pixels = np.asarray(page)
    return [_crop(page, pixels, poly, pad) for poly in as_polygons(polygons)]
