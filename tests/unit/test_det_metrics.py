"""Localization and end-to-end OCR metrics, box IoU and reading order, on hand-computed pages."""

import numpy as np
import pytest

from scale_ocr.boxes import LocalizationMetric, OCRMetric, box_iou, reading_order


def _rates(metric) -> dict:
    return metric.rates(metric.sums())


def _row(*xs: tuple[float, float]) -> np.ndarray:
    """Boxes on one text row (y from 0 to 10) with the given x intervals."""
    return np.array([[x0, 0, x1, 10] for x0, x1 in xs], float)


def test_perfect_match():
    boxes = np.array([[0, 0, 10, 10], [20, 0, 40, 10]], float)
    metric = LocalizationMetric()
    metric.update(boxes, boxes)
    assert _rates(metric) == {"recall": 1.0, "precision": 1.0, "mean_iou": 1.0}


def test_two_predictions_for_one_word_match_once():
    metric = LocalizationMetric()
    metric.update(_row((0, 10), (1, 10)), _row((0, 10)))
    assert _rates(metric) == {"recall": 1.0, "precision": 0.5, "mean_iou": 1.0}


def test_prediction_below_iou_threshold_does_not_count():
    metric = LocalizationMetric(iou_thresh=0.5)
    metric.update(_row((0, 4)), _row((0, 10)))  # IoU 0.4
    assert metric.sums() == [0, 1, 1, 0.0]


def test_assignment_is_the_global_optimum_not_greedy():
    # Greedy takes the best pair A-gt1 (19/21) and leaves B-gt2 at 14/30; A-gt2 (17/23) + B-gt1 (18/26) wins.
    gt, pred = _row((10, 30), (14, 34)), _row((11, 31), (4, 28))
    metric = LocalizationMetric()
    metric.update(pred, gt)
    assert metric.matches == 2
    assert metric.iou_sum == pytest.approx(17 / 23 + 18 / 26)


def test_sub_threshold_pairs_do_not_steer_the_assignment():
    # Max total IoU (docTR) pairs A-gt2 (0.4) with B-gt1 (7/27) and finds nothing; B-gt2 (17/33) is a match.
    gt, pred = _row((29, 38), (3, 28)), _row((11, 21), (11, 36))
    metric = LocalizationMetric()
    metric.update(pred, gt)
    assert metric.matches == 1


def test_sums_of_pages_add_up_like_an_all_reduce():
    pages = [(_row((0, 10), (50, 60)), _row((0, 10))), (_row((0, 8)), _row((0, 10), (20, 30)))]
    whole, shards = LocalizationMetric(), [LocalizationMetric(), LocalizationMetric()]
    for shard, (pred, gt) in zip(shards, pages, strict=True):
        whole.update(pred, gt)
        shard.update(pred, gt)
    reduced = np.sum([s.sums() for s in shards], axis=0).tolist()
    assert reduced == whole.sums()
    assert LocalizationMetric.rates(reduced) == {"recall": 2 / 3, "precision": 2 / 3, "mean_iou": 0.9}


def test_page_without_ground_truth_lowers_precision():
    metric = LocalizationMetric()
    metric.update(_row((0, 10)), _row((0, 10)))
    metric.update(_row((0, 10)), np.zeros((0, 4, 2)))
    assert _rates(metric) == {"recall": 1.0, "precision": 0.5, "mean_iou": 1.0}


def test_empty_page_counts_nothing_and_rates_are_zero():
    metric = LocalizationMetric()
    metric.update([], [])
    assert metric.sums() == [0, 0, 0, 0.0]
    assert _rates(metric) == {"recall": 0.0, "precision": 0.0, "mean_iou": 0.0}


def test_rotated_iou_is_exact():
    square = np.array([[[0, 0], [2, 0], [2, 2], [0, 2]]], float)
    diamond = np.array([[[1, 0], [2, 1], [1, 2], [0, 1]]], float)  # area 2, inside the square
    assert box_iou(square, diamond)[0, 0] == pytest.approx(0.5)


def test_ocr_word_counts_only_when_box_matches_and_text_is_equal():
    gt = _row((0, 10), (20, 30))
    pred = _row((0, 10), (20, 30), (50, 60))
    metric = OCRMetric()
    metric.update(pred, ["Hello", "world", "Hello"], gt, ["Hello", "World"])
    assert _rates(metric) == {"word_recall": 0.5, "word_precision": 1 / 3,
                              "ci_word_recall": 1.0, "ci_word_precision": 2 / 3}


def test_reading_order_of_two_lines():
    # Line 1 (y about 0-20): words 1, 4, 3 left to right, at uneven heights so that sorting by y alone mixes them.
    words = np.array([[60, 31, 90, 49], [0, 1, 40, 19], [0, 30, 50, 50], [100, 0, 150, 18], [50, 2, 90, 20]], float)
    assert reading_order(words) == [1, 4, 3, 2, 0]


def test_reading_order_reads_columns_after_a_title():
    title = [[100, 0, 300, 20]]
    lines = [[[0, y, 80, y + 18], [100, y, 180, y + 18], [220, y, 300, y + 18], [320, y, 400, y + 18]]
             for y in (30, 55)]
    words = np.array(title + lines[0] + lines[1], float)  # 0 title; 1 2 | 3 4 first line; 5 6 | 7 8 second
    assert reading_order(words) == [0, 1, 2, 5, 6, 3, 4, 7, 8]
