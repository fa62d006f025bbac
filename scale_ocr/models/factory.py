"""Build models by name: scale_ocr's registered architectures, and docTR's own as ``doctr:<arch>`` (whose entry is
added to the registry the first time one is asked for)."""

from __future__ import annotations

import fnmatch

from torch import nn

from scale_ocr.errors import UserError
from scale_ocr.models import detection, doctr_zoo, recognition  # noqa: F401 - registers scale_ocr's own models
from scale_ocr.models.registry import PREFIX, ModelEntry, add_entry, find_entry, registered_names
from scale_ocr.vocab import VOCABS


def parse_model_name(name: str) -> tuple[str, str]:
    """``(source, arch)``: ``("doctr", arch)`` for ``doctr:<arch>``, ``("", name)`` for scale_ocr's own."""
    return ("doctr", name[len(PREFIX):]) if name.startswith(PREFIX) else ("", name)


def list_models(pattern: str = "*") -> list[str]:
    """scale_ocr's own registered model names matching a shell-style pattern, sorted (docTR's ``doctr:`` models:
    :func:`scale_ocr.models.doctr_zoo.names`)."""
    return sorted(n for n in registered_names() if fnmatch.fnmatch(n, pattern) and not n.startswith(PREFIX))


def model_entry(name: str) -> ModelEntry:
    """The registry entry of ``name``; a ``doctr:`` name is registered the first time it is asked for."""
    entry = find_entry(name)
    if entry is None and parse_model_name(name)[0] == "doctr":
        entry = add_entry(doctr_zoo.doctr_entry(name))
    if entry is None:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(list_models())}, or docTR's "
                        f"{', '.join(doctr_zoo.names())} (with {doctr_zoo.INSTALL_HINT})")
    return entry


def create_model(name: str, **kwargs) -> nn.Module:
    """Build a registered model with random weights (nothing is downloaded)."""
    return model_entry(name).build(**kwargs)


def accepts(name: str, keyword: str) -> bool:
    """Whether ``name``'s builder takes ``keyword`` (a capability, such as a settable width)."""
    return model_entry(name).accepts(keyword)


def recommended_lr(name: str) -> float:
    """The peak learning rate ``--lr`` defaults to for ``name``, at its :func:`reference_batch`."""
    return float(model_entry(name).default_lr)


def reference_batch(name: str) -> int:
    """The global batch :func:`recommended_lr` is stated at (``--lr-scaling`` carries the rate from there)."""
    return int(model_entry(name).reference_batch)


def model_vocabs(name: str) -> tuple[dict[str, str], str]:
    """The vocabulary names ``--vocab`` may use for ``name`` and the one it defaults to (docTR's models: docTR's
    VOCABS and the model's own; scale_ocr's: scale_ocr's and latin)."""
    entry = model_entry(name)
    return (entry.vocabs() if entry.vocabs else VOCABS, entry.default_vocab() if entry.default_vocab else "latin")
