"""Model registry and the architectures it holds (importing this package registers them)."""

from scale_ocr.models import detection, recognition  # noqa: F401 - registers the models
from scale_ocr.models.registry import accepts, builder, create_model, list_models, register_model

__all__ = ["accepts", "builder", "create_model", "list_models", "register_model"]
