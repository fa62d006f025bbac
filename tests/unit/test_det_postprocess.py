"""boxes_from_map: DB-shrunk words drawn on a map come back as boxes around the original words."""

import cv2
import numpy as np
import pyclipper
import shapely

from scale_ocr.boxes import box_iou, boxes_from_map
from scale_ocr.boxes.metrics import as_polygons

H, W = 256, 320


def _draw_shrunk(prob: np.ndarray, poly: np.ndarray, value: float = 1.0, shrink_ratio: float = 0.4) -> None:
    """Draws ``poly`` shrunk by DB's D = A * (1 - r^2) / L, as a trained model's map would show it."""
    shape = shapely.Polygon(poly)
    d = shape.area * (1 - shrink_ratio**2) / shape.length
    offset = pyclipper.PyclipperOffset()
    # cv2 puts pixel centres at integers, boxes_from_map at i + 0.5 (pixel i covers [i, i + 1)): shift by half.
    offset.AddPath(np.round((poly - 0.5) * 16).astype(np.int64), pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    cv2.fillPoly(prob, [np.asarray(offset.Execute(-d * 16)[0], np.int32)], value, shift=4)


def _absolute(boxes) -> np.ndarray:
    return np.stack([b.polygon for b in boxes]) * [W, H]


def test_shrunk_rectangles_are_recovered():
    words = as_polygons(np.array([[30, 20, 90, 50], [150, 40, 190, 80], [40, 150, 85, 165]], float))
    prob = np.zeros((H, W), np.float32)
    for poly in words:
        _draw_shrunk(prob, poly)
    boxes = boxes_from_map(prob, unclip_ratio=1.5)
    assert len(boxes) == 3
    assert (box_iou(_absolute(boxes), words).max(axis=0) > 0.8).all()


def test_rotated_rectangle_is_recovered_with_rotated_boxes():
    word = cv2.boxPoints(((150.0, 120.0), (90.0, 40.0), 15.0)).astype(np.float64)
    prob = np.zeros((H, W), np.float32)
    _draw_shrunk(prob, word)
    (box,) = boxes_from_map(prob, rotated=True)
    pred = shapely.Polygon(box.polygon * [W, H])
    truth = shapely.Polygon(word)
    assert pred.intersection(truth).area / pred.union(truth).area > 0.8


def test_low_score_region_is_dropped():
    prob = np.zeros((H, W), np.float32)
    _draw_shrunk(prob, as_polygons([[30, 20, 90, 50]])[0], value=0.9)
    _draw_shrunk(prob, as_polygons([[150, 40, 210, 70]])[0], value=0.4)
    boxes = boxes_from_map(prob, box_thresh=0.5)
    assert len(boxes) == 1
    assert boxes[0].score > 0.85


def test_score_is_the_mean_inside_the_region_not_its_bounding_rectangle():
    # A thin diagonal stroke fills a small part of its bounding rectangle.
    prob = np.zeros((H, W), np.float32)
    cv2.line(prob, (40, 40), (200, 200), 0.9, thickness=6)
    (box,) = boxes_from_map(prob, box_thresh=0.5)
    assert box.score > 0.85


def test_small_box_is_dropped_by_min_size():
    prob = np.zeros((H, W), np.float32)
    prob[100:103, 100:103] = 1.0  # 3 x 3 px: expands to about 5 x 5 px
    assert len(boxes_from_map(prob, min_size=3)) == 1
    assert boxes_from_map(prob, min_size=6) == []


def test_empty_map_gives_no_boxes():
    assert boxes_from_map(np.zeros((H, W), np.float32)) == []
