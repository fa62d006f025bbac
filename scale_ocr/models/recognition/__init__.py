"""Text recognition models."""

from scale_ocr.models.recognition import crnn, vitstr  # noqa: F401 - registers the models
from scale_ocr.models.recognition.ctc import ctc_greedy_decode

__all__ = ["ctc_greedy_decode"]
