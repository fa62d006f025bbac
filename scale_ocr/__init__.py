"""scale_ocr: train the same OCR models under interchangeable distributed strategies."""

__version__ = "0.1.0"
