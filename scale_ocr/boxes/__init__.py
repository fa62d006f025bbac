"""Detection post-processing and evaluation: probability map to boxes, localization/OCR metrics, reading order.

Plain numpy / OpenCV / shapely code: usable on CPU workers and in evaluation without torch.
"""

from scale_ocr.boxes.metrics import LocalizationMetric, OCRMetric, box_iou, match_boxes
from scale_ocr.boxes.order import reading_lines, reading_order
from scale_ocr.boxes.postprocess import Box, boxes_from_map

__all__ = ["Box", "LocalizationMetric", "OCRMetric", "box_iou", "boxes_from_map", "match_boxes", "reading_lines",
           "reading_order"]
