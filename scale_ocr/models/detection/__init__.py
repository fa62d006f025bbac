"""Text detection models (importing this package registers them)."""

from scale_ocr.models.detection import dbnet  # noqa: F401 - registers the models
from scale_ocr.models.detection.loss import db_loss
from scale_ocr.models.detection.targets import build_targets

__all__ = ["build_targets", "db_loss"]
