"""DBNet training targets from word polygons (Liao et al. 2020, section 3.3).

Each polygon of area A and perimeter L, shrunk by D = A * (1 - r^2) / L, is the probability map's positive region
(touching words stay apart); dilated by D, the threshold map's supervised region. Words too small to shrink are
ignored (``prob_mask`` 0), not negatives: they are text. Pixel (x, y) is centred at (x, y); offsets and filling use
4 fractional bits (pyclipper's integers, cv2.fillPoly's ``shift``), accurate to a sixteenth of a pixel.
"""

from __future__ import annotations

import cv2
import numpy as np
import pyclipper

_SHIFT = 4
_SCALE = 1 << _SHIFT


def _offset(poly: np.ndarray, delta: float) -> list[np.ndarray]:
    """``poly`` (K, 2) grown by ``delta`` pixels (shrunk if negative), as fixed-point int32 paths."""
    # Round joins as in the paper; arc tolerance of a quarter pixel keeps the corner vertex count small.
    pco = pyclipper.PyclipperOffset(arc_tolerance=0.25 * _SCALE)
    pco.AddPath(np.round(poly * _SCALE).astype(np.int64).tolist(), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    return [np.asarray(p, dtype=np.int32) for p in pco.Execute(delta * _SCALE) if len(p) >= 3]


def _fill(canvas: np.ndarray, paths: list[np.ndarray], value: float) -> None:
    cv2.fillPoly(canvas, paths, value, lineType=cv2.LINE_8, shift=_SHIFT)


def _fixed(poly: np.ndarray) -> np.ndarray:
    return np.round(poly * _SCALE).astype(np.int32)


def _box(paths: list[np.ndarray], height: int, width: int) -> tuple[int, int, int, int]:
    """Inclusive pixel box (x0, y0, x1, y1) of fixed-point ``paths``, clipped to the image."""
    x, y, w, h = cv2.boundingRect(np.concatenate(paths))
    return (max(x >> _SHIFT, 0), max(y >> _SHIFT, 0), min((x + w + _SCALE - 1) >> _SHIFT, width - 1),
            min((y + h + _SCALE - 1) >> _SHIFT, height - 1))


def _draw_border(canvas: np.ndarray, poly: np.ndarray, d: float, box: tuple[int, int, int, int]) -> None:
    """Max ``canvas`` over ``box`` with 1 - min(distance to the nearest edge of ``poly`` / d, 1).

    Exact point-to-segment distances to all K edges at once on (K, h, w) arrays built by broadcasting
    a pixel row and column, then a minimum over the leading axis (cv2.distanceTransform is up to a pixel off).
    """
    x0, y0, x1, y1 = box
    a = poly.astype(np.float32) - np.array([x0, y0], np.float32)  # vertices relative to the box
    e = np.concatenate([a[1:], a[:1]]) - a  # edge k runs from vertex k to vertex k + 1
    inv_len2 = (1 / np.maximum((e**2).sum(1), 1e-6))[:, None, None]
    ex, ey = e[:, 0, None, None], e[:, 1, None, None]
    dx = np.arange(x1 - x0 + 1, dtype=np.float32)[None, None, :] - a[:, 0, None, None]  # (K, 1, w)
    dy = np.arange(y1 - y0 + 1, dtype=np.float32)[None, :, None] - a[:, 1, None, None]  # (K, h, 1)
    t = dx * (ex * inv_len2) + dy * (ey * inv_len2)  # projection onto each edge's line ...
    np.clip(t, 0, 1, out=t)  # ... kept on the segment
    ox, oy = dx - t * ex, dy - t * ey
    ox *= ox
    oy *= oy
    ox += oy
    near = 1 - np.clip(np.sqrt(ox.min(0)) / d, 0, 1)
    region = canvas[y0:y1 + 1, x0:x1 + 1]
    np.maximum(region, near, out=region)  # touching words: keep the nearer border's (higher) value


def build_targets(polygons: np.ndarray, height: int, width: int, shrink_ratio: float = 0.4,
                  thresh_min: float = 0.3, thresh_max: float = 0.7, min_size: float = 3.0) -> dict[str, np.ndarray]:
    """Probability and threshold targets and masks for one image, from (N, K >= 4, 2) word ``polygons`` in its
    pixels (clipped to it first; N may be 0).

    Returns float32 (height, width) maps ``prob_target`` (1 in shrunk words), ``prob_mask`` (0 on words whose
    minimum-area rectangle has a side under ``min_size``), ``thresh_target`` (``thresh_max`` on the edges down to
    ``thresh_min``) and ``thresh_mask`` (1 in dilated words); ``shrink_ratio`` is r in D = A * (1 - r^2) / L.
    """
    prob_target = np.zeros((height, width), np.float32)
    prob_mask = np.ones((height, width), np.float32)
    border = np.zeros((height, width), np.float32)  # 0..1, mapped to [thresh_min, thresh_max] at the end
    thresh_mask = np.zeros((height, width), np.float32)
    polys = np.array(polygons, dtype=np.float64)  # a copy: clipped in place below
    if polys.size == 0:  # (0,), (0, K, 2) and [] all mean a page without words
        polys = polys.reshape(0, 4, 2)
    polys[..., 0] = polys[..., 0].clip(0, width - 1)
    polys[..., 1] = polys[..., 1].clip(0, height - 1)
    # Area (shoelace), perimeter and offset D of every word at once.
    nxt = np.roll(polys, -1, axis=1)
    area = 0.5 * np.abs((polys[..., 0] * nxt[..., 1] - polys[..., 1] * nxt[..., 0]).sum(1))
    perimeter = np.hypot(*np.moveaxis(nxt - polys, -1, 0)).sum(1)
    offsets = area * (1 - shrink_ratio**2) / np.maximum(perimeter, 1e-6)
    for poly, d in zip(polys, offsets, strict=True):
        # The min-area rectangle's short side is the word's thickness, rotated words included.
        thick_enough = min(cv2.minAreaRect(poly.astype(np.float32))[1]) >= min_size
        shrunk = _offset(poly, -d) if thick_enough and d > 0 else []
        if not shrunk:  # too small, degenerate, or shrunk to nothing: ignored, not background
            _fill(prob_mask, [_fixed(poly)], 0.0)
            continue
        _fill(prob_target, shrunk, 1.0)
        dilated = _offset(poly, d)
        _fill(thresh_mask, dilated, 1.0)
        _draw_border(border, poly, d, _box(dilated, height, width))
    # The clip only removes float32 rounding (0.3 + 0.4 * 1 is 0.70000005), so the range is exact.
    thresh_target = np.clip(thresh_min + (thresh_max - thresh_min) * border, thresh_min, thresh_max)
    return {"prob_target": prob_target, "prob_mask": prob_mask, "thresh_target": thresh_target,
            "thresh_mask": thresh_mask}
