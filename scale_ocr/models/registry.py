"""One model registry: ``@register_model`` on a builder, ``create_model(name)`` to build."""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Callable

from torch import nn

from scale_ocr.errors import UserError

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register a builder under its function name (``<arch>_<backbone>[_<size>]``)."""
    name = fn.__name__
    if name in _MODELS:
        raise ValueError(f"model {name!r} is registered twice")
    _MODELS[name] = fn
    return fn


def list_models(pattern: str = "*") -> list[str]:
    """Registered model names matching a shell-style pattern, sorted."""
    return sorted(n for n in _MODELS if fnmatch.fnmatch(n, pattern))


def builder(name: str) -> Callable[..., nn.Module]:
    """The registered builder of ``name`` (its attributes, such as ``task``, describe the model)."""
    if name not in _MODELS:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(list_models())}")
    return _MODELS[name]


def recommended_lr(name: str) -> float:
    """The peak learning rate ``--lr`` defaults to for ``name``: its builder's ``default_lr`` (a rate measured to
    learn fastest with the default recipe and batch), else ``DEFAULT_LR``."""
    from scale_ocr.config import DEFAULT_LR

    return float(getattr(builder(name), "default_lr", DEFAULT_LR))


def create_model(name: str, **kwargs) -> nn.Module:
    """Build a registered model with random weights (nothing is downloaded)."""
    return builder(name)(**kwargs)


def accepts(name: str, keyword: str) -> bool:
    """Whether ``name``'s builder takes ``keyword`` (a capability, such as a settable width)."""
    return keyword in inspect.signature(builder(name)).parameters
