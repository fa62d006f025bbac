"""Model registry and the architectures it holds (importing this package registers them)."""

from scale_ocr.models import recognition  # noqa: F401 - registers the recognition models
from scale_ocr.models.registry import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model"]
