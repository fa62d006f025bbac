"""The model registry, a leaf: typed entries by name, filled by ``@register_model``; it builds nothing itself.

It imports no model, so every model module can register here without an import circle; building by name lives in
:mod:`scale_ocr.models.factory` (timm's ``_registry``/``_factory`` split).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from torch import nn

from scale_ocr.config import DEFAULT_LR, DEFAULT_REFERENCE_BATCH

#: Names of docTR's own models start with it (``doctr:crnn_vgg16_bn``); the factory builds them.
PREFIX = "doctr:"

#: The largest value each size keyword of a builder may take (``--model-width`` ..., or what a model file claims),
#: and ``input_side`` each side of the input size: a crafted or damaged file cannot make scale-ocr build something
#: absurd before its weights are compared (:mod:`scale_ocr.checkpoint.identity`). Generous for real models: several
#: times the largest ViTSTR trained (width 2048, depth 15; ViT-22B is 6144 wide), and a 600 dpi A4 page a side.
SIZE_BOUNDS = MappingProxyType({"width": 16384, "depth": 256, "heads": 512, "mlp_ratio": 16.0, "input_side": 8192})


@dataclass(frozen=True)
class ModelEntry:
    """What the registry knows of one model before building it.

    Attributes:
        build: the builder; its keyword arguments are what the model lets a run set (``accepts``).
        task: the name of the task that trains it (data, targets, metrics), a key of the task registry.
        default_lr: the peak learning rate ``--lr`` defaults to, stated at the global batch ``reference_batch``.
        vocabs: the named vocabularies ``--vocab NAME`` may use; None: scale_ocr's.
        default_vocab: the vocabulary used when none is given; None: latin.
        bounds: the largest value of each size keyword and input side (:data:`SIZE_BOUNDS` unless registered).
    """

    name: str
    build: Callable[..., nn.Module]
    task: str = "recognition"
    default_lr: float = DEFAULT_LR
    reference_batch: int = DEFAULT_REFERENCE_BATCH
    vocabs: Callable[[], dict[str, str]] | None = None
    default_vocab: Callable[[], str] | None = None
    bounds: Mapping[str, float] = field(default_factory=lambda: SIZE_BOUNDS)

    def accepts(self, keyword: str) -> bool:
        """Whether the builder takes ``keyword`` (a capability, such as a settable width)."""
        return keyword in inspect.signature(self.build).parameters

    def size_problem(self, keyword: str, value: Any) -> str | None:
        """Why ``value`` cannot be this model's ``keyword`` (a size keyword, or ``input_side``); None when it can."""
        if keyword != "input_side" and not self.accepts(keyword):
            return f"{self.name} has no {keyword} to set"
        integral = keyword != "mlp_ratio"
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)) \
                or not 0 < value <= self.bounds[keyword]:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"  # a crafted file's value
            kind = "a whole number" if integral else "a number"
            return f"{keyword} {shown} is not {kind} above 0 and at most {self.bounds[keyword]:g} ({self.name}'s bound)"
        return None


_MODELS: dict[str, ModelEntry] = {}


def add_entry(entry: ModelEntry) -> ModelEntry:
    """Register ``entry``; a name registered twice is a programming error."""
    if entry.name in _MODELS:
        raise ValueError(f"model {entry.name!r} is registered twice")
    _MODELS[entry.name] = entry
    return entry


def register_model(fn: Callable[..., nn.Module] | None = None, *, task: str = "recognition",
                   default_lr: float = DEFAULT_LR, reference_batch: int = DEFAULT_REFERENCE_BATCH) -> Any:
    """Register a builder under its function name: ``@register_model`` or ``@register_model(task=..., default_lr=...,
    reference_batch=...)``."""

    def add(builder: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        add_entry(ModelEntry(builder.__name__, builder, task, default_lr, reference_batch))
        return builder

    return add(fn) if fn is not None else add


def find_entry(name: str) -> ModelEntry | None:
    """The entry registered under ``name``, if any (the factory adds ``doctr:`` entries on first use)."""
    return _MODELS.get(name)


def registered_names() -> list[str]:
    return list(_MODELS)


class ModelCapabilities(Protocol):
    """Optional members a model may define; each one turns a capability on, and none is required.

    The callers ask :func:`capable` rather than ``hasattr``, so a capability is spelled in one place.
    """

    #: Feed it channels-last images (convolutional models): ``--channels-last``.
    channels_last: bool

    def sharding_units(self) -> list[nn.Module]:
        """The blocks FSDP2 shards one by one before the root (default: the direct children)."""
        ...

    def checkpoint_units(self) -> list[nn.Module]:
        """The blocks activation checkpointing wraps (ViT blocks, backbone stages)."""
        ...

    def init_param(self, name: str, tensor: Any, generator: Any) -> None:
        """Initialise one parameter by name: the model can then be built on meta and filled shard by shard."""
        ...

    def to_doctr_state_dict(self, state: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """``(docTR architecture, state in docTR's layout)``: the model has a docTR twin to export to."""
        ...

    def from_doctr_state_dict(self, state: dict[str, Any]) -> dict[str, Any]:
        """The inverse: a docTR state dict in this model's layout (``--init-from`` a docTR file)."""
        ...


CAPABILITIES = frozenset(name for name in (*ModelCapabilities.__annotations__, *vars(ModelCapabilities))
                         if not name.startswith("_"))


def capable(model: nn.Module, capability: str) -> bool:
    """Whether ``model`` has one of the optional members named in :class:`ModelCapabilities`."""
    if capability not in CAPABILITIES:
        raise ValueError(f"{capability!r} is not a model capability; known: {', '.join(sorted(CAPABILITIES))}")
    value = getattr(model, capability, None)
    return bool(value) if capability == "channels_last" else value is not None
