"""DBNet post-processing: from a probability map to word boxes.

Coordinates: pixel ``i`` of the map covers ``[i, i + 1)``, so a box covering the whole map is
``[0, W] x [0, H]``, and relative coordinates are ``x / W`` and ``y / H`` (0..1 on both axes).
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np
import pyclipper

# A kernel thinner than this is binarization noise: DB shrinks even 6 px tall text to about 2 px.
_MIN_KERNEL_PX = 2
# pyclipper works on integers; offsetting at 1/8 px keeps the expanded box sub-pixel exact, and a round join
# within a quarter pixel of the true arc keeps the outline short (its points are the per-box cost).
_CLIPPER_SCALE = 8
_ARC_TOLERANCE_PX = 0.25


@dataclass(frozen=True, eq=False)
class Box:
    """A detected word: a read-only (4, 2) ``polygon`` in relative (x / W, y / H) coordinates, clockwise on screen
    from the top-left corner (the smallest x + y), and its ``score``, the mean probability inside the region."""

    polygon: np.ndarray
    score: float

    def __post_init__(self) -> None:
        # Frozen means the coordinates too; a copy, so that the caller's array stays writable.
        polygon = np.array(self.polygon, dtype=np.float64)
        polygon.flags.writeable = False
        object.__setattr__(self, "polygon", polygon)


def _order_clockwise(pts: np.ndarray) -> np.ndarray:
    """Orders 4 corners clockwise on screen (y points down), starting at the smallest x + y."""
    center = pts.mean(axis=0)
    pts = pts[np.argsort(np.arctan2(pts[:, 1] - center[1], pts[:, 0] - center[0]))]
    return np.roll(pts, -int(np.argmin(pts.sum(axis=1))), axis=0)


def _region_score(prob: np.ndarray, contour: np.ndarray) -> float:
    """Mean probability inside the contour polygon (not its bounding rectangle: slanted words)."""
    x, y, w, h = cv2.boundingRect(contour)
    mask = np.zeros((h, w), np.uint8)
    cv2.fillPoly(mask, [contour - np.array([x, y], np.int32)], 1)
    return float(cv2.mean(prob[y : y + h, x : x + w], mask=mask)[0])


def _unclip(contour: np.ndarray, unclip_ratio: float) -> np.ndarray | None:
    """Expands a region by D = A * unclip_ratio / L; returns the expanded points in map coordinates.

    The contour runs through pixel centres, half a pixel inside the region's pixels. DB's D is defined on
    the continuous polygon, so A and L are those of the pixels' outline (exact for rectangles), and the
    offset adds the missing half pixel: a region of w x h pixels has A = w * h, not (w - 1) * (h - 1), which
    matters for the 2-6 px thin kernels DB's 0.4 shrink leaves.
    """
    centres = contour.reshape(-1, 2).astype(np.float64) + 0.5
    area_c = cv2.contourArea(centres.astype(np.float32))
    length_c = cv2.arcLength(centres.astype(np.float32), closed=True)
    area, length = area_c + length_c / 2 + 1, length_c + 4
    distance = area * unclip_ratio / length + 0.5
    offset = pyclipper.PyclipperOffset()
    offset.ArcTolerance = _ARC_TOLERANCE_PX * _CLIPPER_SCALE
    offset.AddPath((centres * _CLIPPER_SCALE).round().astype(np.int64), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    paths = offset.Execute(distance * _CLIPPER_SCALE)
    if not paths:
        return None
    # A single region expands to one outline; keep the largest should clipper split it.
    return np.asarray(max(paths, key=len), np.float64) / _CLIPPER_SCALE


def _rectangle(points: np.ndarray, rotated: bool) -> tuple[np.ndarray, float]:
    """Bounding rectangle of the points (axis-aligned or minimum-area), and its shorter side."""
    if rotated:
        rect = cv2.minAreaRect(points.astype(np.float32))
        return _order_clockwise(cv2.boxPoints(rect).astype(np.float64)), float(min(rect[1]))
    (x0, y0), (x1, y1) = points.min(axis=0), points.max(axis=0)
    return np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]]), float(min(x1 - x0, y1 - y0))


def boxes_from_map(
    prob: np.ndarray,
    bin_thresh: float = 0.3,
    box_thresh: float = 0.1,
    unclip_ratio: float = 1.5,
    min_size: int = 3,
    rotated: bool = False,
    max_candidates: int = 1000,
) -> list[Box]:
    """Turns an (H, W) DBNet probability map into word boxes (in no particular order; see ``reading_order``).

    Binarizes the map at ``bin_thresh``, scores each connected region by its mean probability (dropped under
    ``box_thresh``), expands it by DB's unclip distance D = A * ``unclip_ratio`` / L and returns its bounding
    rectangle (``rotated``: minimum-area), dropped when its shorter side is under ``min_size`` pixels. At most
    ``max_candidates`` regions, the largest first. Boxes are clipped to the map, in relative coordinates (a rotated
    box clipped at the border may no longer be a rectangle).
    """
    if prob.ndim != 2:
        raise ValueError(f"prob must be an (H, W) map, got shape {prob.shape}")
    prob = np.ascontiguousarray(prob, dtype=np.float32)
    height, width = prob.shape
    bitmap = (prob > bin_thresh).astype(np.uint8)
    contours, _ = cv2.findContours(bitmap, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    if len(contours) > max_candidates:
        contours = sorted(contours, key=cv2.contourArea, reverse=True)[:max_candidates]
    boxes = []
    for contour in contours:
        if min(cv2.boundingRect(contour)[2:]) < _MIN_KERNEL_PX:
            continue
        score = _region_score(prob, contour)
        if score < box_thresh:
            continue
        expanded = _unclip(contour, unclip_ratio)
        if expanded is None:
            continue
        corners, short_side = _rectangle(expanded, rotated)
        if short_side < min_size:
            continue
        corners = np.clip(corners, 0, [width, height]) / np.array([width, height], np.float64)
        boxes.append(Box(polygon=corners, score=score))
    return boxes
