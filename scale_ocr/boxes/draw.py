"""Boxes drawn on a page: the W&B validation table and ``scale-ocr predict --overlay``."""

from __future__ import annotations

import cv2
import numpy as np


def draw_polygons(page: np.ndarray, polygons: np.ndarray, colour: tuple[int, int, int],
                  thickness: int = 1) -> np.ndarray:
    """A copy of ``page`` (H, W, 3 uint8 RGB) with each (4, 2) polygon, in its pixels, outlined."""
    out = np.ascontiguousarray(page).copy()
    pts = [np.round(p).astype(np.int32).reshape(-1, 1, 2) for p in np.asarray(polygons).reshape(-1, 4, 2)]
    if pts:
        cv2.polylines(out, pts, isClosed=True, color=colour, thickness=thickness, lineType=cv2.LINE_AA)
    return out
