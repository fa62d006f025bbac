"""Models by name: the registry (a leaf), the factory that builds from it, and the architectures it holds."""

from scale_ocr.models.factory import accepts, create_model, list_models, model_entry
from scale_ocr.models.registry import register_model

__all__ = ["accepts", "create_model", "list_models", "model_entry", "register_model"]
