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
    """scale_ocr's own registered model names matching a shell-style pattern, sorted (docTR's ``doctr:`` models:
    :func:`scale_ocr.models.doctr_zoo.names`)."""
    return sorted(n for n in _MODELS if fnmatch.fnmatch(n, pattern) and ":" not in n)


def builder(name: str) -> Callable[..., nn.Module]:
    """The registered builder of ``name`` (its attributes, such as ``task``, describe the model).

    ``doctr:<arch>`` names docTR's own model of that name (:mod:`scale_ocr.models.doctr_zoo`, the optional extra),
    registered the first time it is asked for.
    """
    from scale_ocr.models import doctr_zoo

    if name not in _MODELS and name.startswith(doctr_zoo.PREFIX):
        _MODELS[name] = doctr_zoo.doctr_builder(name)
    if name not in _MODELS:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(list_models())}, or docTR's "
                        f"{', '.join(doctr_zoo.names())} (with {doctr_zoo.INSTALL_HINT})")
    return _MODELS[name]


def recommended_lr(name: str) -> float:
    """The peak learning rate ``--lr`` defaults to for ``name``: its builder's ``default_lr`` (a rate measured to
    learn fastest with the default recipe and batch), else ``DEFAULT_LR``."""
    from scale_ocr.config import DEFAULT_LR

    return float(getattr(builder(name), "default_lr", DEFAULT_LR))


def model_vocabs(name: str) -> tuple[dict[str, str], str]:
    """The vocabulary names ``--vocab`` may use for ``name`` and the one it defaults to: the builder's ``vocabs()``
    and ``default_vocab()`` (docTR's models: docTR's VOCABS and the model's own), else scale_ocr's and latin."""
    from scale_ocr.vocab import VOCABS

    b = builder(name)
    return (b.vocabs() if hasattr(b, "vocabs") else VOCABS,
            b.default_vocab() if hasattr(b, "default_vocab") else "latin")


def create_model(name: str, **kwargs) -> nn.Module:
    """Build a registered model with random weights (nothing is downloaded)."""
    return builder(name)(**kwargs)


def accepts(name: str, keyword: str) -> bool:
    """Whether ``name``'s builder takes ``keyword`` (a capability, such as a settable width)."""
    return keyword in inspect.signature(builder(name)).parameters
