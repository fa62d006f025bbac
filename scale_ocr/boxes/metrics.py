"""Detection metrics: box IoU, localization recall/precision/IoU and end-to-end word recall/precision.

Each metric accumulates plain counts (``sums()``, all-reduced across ranks) that the static ``rates(sums)`` turns
into rates, so a metric computed on shards equals the metric computed on the whole set.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import shapely
from scipy.optimize import linear_sum_assignment


def as_polygons(boxes: np.ndarray | Sequence) -> np.ndarray:
    """(N, 4, 2) float polygons from polygons or (N, 4) ``(xmin, ymin, xmax, ymax)`` boxes; [] gives (0, 4, 2)."""
    arr = np.asarray(boxes, dtype=np.float64)
    if arr.size == 0:
        return np.zeros((0, 4, 2))
    if arr.ndim == 2 and arr.shape[1] == 4:
        x0, y0, x1, y1 = arr.T
        arr = np.stack([np.stack([x0, y0], 1), np.stack([x1, y0], 1), np.stack([x1, y1], 1), np.stack([x0, y1], 1)], 1)
    if arr.ndim != 3 or arr.shape[1:] != (4, 2):
        raise ValueError(f"expected (N, 4, 2) polygons or (N, 4) boxes, got shape {arr.shape}")
    return arr


def _axis_aligned(polys: np.ndarray) -> bool:
    """True when every edge of every polygon is horizontal or vertical (up to rounding)."""
    edges = np.roll(polys, -1, axis=1) - polys
    tol = 1e-9 * max(1.0, float(np.abs(polys).max(initial=0.0)))
    return bool(np.all(np.abs(edges).min(axis=2) <= tol))


def _rect_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    amin, amax, bmin, bmax = a.min(1), a.max(1), b.min(1), b.max(1)
    wh = np.clip(np.minimum(amax[:, None], bmax[None]) - np.maximum(amin[:, None], bmin[None]), 0, None)
    inter = wh[..., 0] * wh[..., 1]
    area_a, area_b = np.prod(amax - amin, axis=1), np.prod(bmax - bmin, axis=1)
    union = area_a[:, None] + area_b[None] - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def _shapes(polys: np.ndarray) -> np.ndarray:
    shapes = shapely.polygons(polys)
    # A self-crossing (badly ordered) quadrilateral makes GEOS raise on intersection; repair it instead.
    bad = ~shapely.is_valid(shapes)
    if bad.any():
        shapes[bad] = shapely.make_valid(shapes[bad])
    return shapes


def _poly_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    pa, pb = _shapes(a), _shapes(b)
    iou = np.zeros((len(a), len(b)))
    # Only pairs whose envelopes meet can overlap: a page has hundreds of words, each near a handful.
    i, j = shapely.STRtree(pb).query(pa, predicate="intersects")
    inter = shapely.area(shapely.intersection(pa[i], pb[j]))
    union = shapely.area(pa)[i] + shapely.area(pb)[j] - inter
    iou[i, j] = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    return iou


def box_iou(a: np.ndarray | Sequence, b: np.ndarray | Sequence, rotated: bool | None = None) -> np.ndarray:
    """(N, M) IoU matrix between polygons or boxes (as :func:`as_polygons` takes them, the same units on both
    sides); 0 where the union has no area.

    ``rotated``: False treats every polygon as its bounding rectangle (numpy), True computes exact polygon IoU
    (shapely), None picks numpy when all polygons are axis-aligned.
    """
    a, b = as_polygons(a), as_polygons(b)
    if len(a) == 0 or len(b) == 0:
        return np.zeros((len(a), len(b)))
    if rotated is None:
        rotated = not (_axis_aligned(a) and _axis_aligned(b))
    return _poly_iou(a, b) if rotated else _rect_iou(a, b)


def match_boxes(pred: np.ndarray | Sequence, gt: np.ndarray | Sequence, iou_thresh: float = 0.5,
                rotated: bool | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One-to-one matching of predictions to ground truth (Hungarian assignment).

    The assignment maximizes the number of pairs with IoU >= ``iou_thresh`` first, their total IoU second.
    docTR maximizes the total IoU over all pairs, sub-threshold ones included; that can trade a match for
    IoU when boxes overlap (two 0.55 pairs lose to a 0.95 pair plus a 0.3 one). Words that do not overlap
    each other get the same matches either way. Returns ``(pred_idx, gt_idx, iou)`` of the K matched pairs.
    """
    iou = box_iou(pred, gt, rotated)
    valid = iou >= iou_thresh
    if not valid.any():
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0)
    # Each match is worth 1 plus its IoU scaled below 1/K: K matches always beat K - 1, whatever their IoU.
    weight = np.where(valid, 1.0 + iou / (min(iou.shape) + 1), 0.0)
    rows, cols = linear_sum_assignment(weight, maximize=True)
    keep = valid[rows, cols]
    return rows[keep], cols[keep], iou[rows[keep], cols[keep]]


class LocalizationMetric:
    """Recall, precision and mean IoU of detected boxes against ground truth (``match_boxes`` pairs), over pages.

    ``mean_iou`` is the mean IoU of the matched pairs (how tight the found boxes are, like panoptic quality's SQ;
    docTR's divides each ground truth's best IoU by the number of predictions, mixing in precision). A page
    without ground truth still counts its predictions. A rate with a zero denominator is 0.0.
    """

    def __init__(self, iou_thresh: float = 0.5, rotated: bool | None = None) -> None:
        self.iou_thresh, self.rotated = iou_thresh, rotated
        self.matches = self.num_gt = self.num_pred = 0
        self.iou_sum = 0.0

    def update(self, pred_polys: np.ndarray | Sequence, gt_polys: np.ndarray | Sequence) -> None:
        """Adds one page; both sides in the same units (relative or absolute). See ``box_iou``."""
        pred, gt = as_polygons(pred_polys), as_polygons(gt_polys)
        _, _, iou = match_boxes(pred, gt, self.iou_thresh, self.rotated)
        self.matches += len(iou)
        self.iou_sum += float(iou.sum())
        self.num_gt += len(gt)
        self.num_pred += len(pred)

    def sums(self) -> list[float]:
        return [self.matches, self.num_gt, self.num_pred, self.iou_sum]

    @staticmethod
    def rates(sums: list[float]) -> dict[str, float]:
        matches, num_gt, num_pred, iou_sum = sums
        return {"recall": _ratio(matches, num_gt), "precision": _ratio(matches, num_pred),
                "mean_iou": _ratio(iou_sum, matches)}


class OCRMetric:
    """End-to-end page OCR: a ground-truth word is read when its matched prediction (``match_boxes``) has the same
    text (``ci_`` rates: lower-cased). A rate with a zero denominator is 0.0."""

    def __init__(self, iou_thresh: float = 0.5, rotated: bool | None = None) -> None:
        self.iou_thresh, self.rotated = iou_thresh, rotated
        self.read = self.ci_read = self.num_gt = self.num_pred = 0

    def update(self, pred_polys: np.ndarray | Sequence, pred_words: Sequence[str],
               gt_polys: np.ndarray | Sequence, gt_words: Sequence[str]) -> None:
        """Adds one page; boxes in the same units on both sides, one word per box."""
        pred, gt = as_polygons(pred_polys), as_polygons(gt_polys)
        if len(pred) != len(pred_words) or len(gt) != len(gt_words):
            raise ValueError(f"{len(pred)} predicted boxes for {len(pred_words)} words, "
                             f"{len(gt)} ground-truth boxes for {len(gt_words)} words")
        pi, gi, _ = match_boxes(pred, gt, self.iou_thresh, self.rotated)
        for p, g in zip(pi, gi, strict=True):
            self.read += pred_words[p] == gt_words[g]
            self.ci_read += pred_words[p].lower() == gt_words[g].lower()
        self.num_gt += len(gt)
        self.num_pred += len(pred)

    def sums(self) -> list[float]:
        return [self.read, self.ci_read, self.num_gt, self.num_pred]

    @staticmethod
    def rates(sums: list[float]) -> dict[str, float]:
        read, ci_read, num_gt, num_pred = sums
        return {"word_recall": _ratio(read, num_gt), "word_precision": _ratio(read, num_pred),
                "ci_word_recall": _ratio(ci_read, num_gt), "ci_word_precision": _ratio(ci_read, num_pred)}


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0
