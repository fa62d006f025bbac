"""docTR's own recognition models in the registry, as ``doctr:<arch>`` (the optional extra ``scale-ocr[doctr]``).

``doctr:crnn_mobilenet_v3_small`` is ``doctr.models.crnn_mobilenet_v3_small(pretrained=False,
pretrained_backbone=False)``: docTR's class, layers, initialisation, loss and post-processing, built without
downloading anything. Only its ``forward`` is adapted to scale_ocr's model interface, by a subclass that adds no
state, so its ``state_dict`` is docTR's key for key and loads into docTR's own class with ``strict=True``:

* ``model(images, targets, target_lengths)`` -> ``{"logits", "loss"}``: the targets are the task's padded
  class indices (0 is the blank, character ``i`` is ``i + 1``); they are turned back into the words docTR's
  ``forward`` takes, and the loss is docTR's own (CTC for the CRNNs and VIPTR, cross-entropy for the
  attention and transformer decoders);
* ``model(images)`` -> ``{"logits"}``, docTR's ``out_map``, which docTR's post-processor of the architecture
  (:func:`postprocessor`) turns into words and confidences.

docTR is imported only when a ``doctr:`` model is asked for: its import costs seconds, and without the extra
the rest of scale_ocr works and a ``doctr:`` name is one line saying what to install.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scale_ocr.errors import UserError

PREFIX = "doctr:"
INSTALL_HINT = "pip install 'scale-ocr[doctr]'"
# docTR's recognition architectures (doctr.models.recognition) and the module of each one's post-processor.
RECOGNIZERS: dict[str, str] = {
    "crnn_vgg16_bn": "crnn", "crnn_mobilenet_v3_small": "crnn", "crnn_mobilenet_v3_large": "crnn",
    "vitstr_small": "vitstr", "vitstr_base": "vitstr", "parseq": "parseq", "master": "master",
    "sar_resnet31": "sar", "viptr_tiny": "viptr",
}
POSTPROCESSORS = {"crnn": "CTCPostProcessor", "vitstr": "ViTSTRPostProcessor", "parseq": "PARSeqPostProcessor",
                  "master": "MASTERPostProcessor", "sar": "SARPostProcessor", "viptr": "VIPTRPostProcessor"}


def names() -> list[str]:
    """Every ``doctr:`` model name (known without importing docTR)."""
    return [PREFIX + arch for arch in RECOGNIZERS]


def _doctr():
    try:
        import doctr.models  # noqa: F401 - docTR's models and datasets (VOCABS)
    except ImportError as exc:
        raise UserError(f"docTR's models need the optional extra: {INSTALL_HINT} ({exc})") from None
    import doctr

    return doctr


def vocabs() -> dict[str, str]:
    """docTR's named vocabularies (``doctr.datasets.VOCABS``): what ``--vocab NAME`` means for a docTR model."""
    return dict(_doctr().datasets.VOCABS)


def default_cfg(arch: str) -> dict[str, Any]:
    """docTR's configuration of ``arch``: its vocabulary, input shape and normalisation."""
    from importlib import import_module

    _doctr()
    return import_module(f"doctr.models.recognition.{RECOGNIZERS[arch]}.pytorch").default_cfgs[arch]


def postprocessor(arch: str, vocab: str) -> Callable[[torch.Tensor], list[tuple[str, float]]]:
    """docTR's post-processor of ``arch``: logits (``out_map``) -> ``[(word, confidence)]``."""
    from importlib import import_module

    family = RECOGNIZERS[arch]
    _doctr()
    return getattr(import_module(f"doctr.models.recognition.{family}.pytorch"), POSTPROCESSORS[family])(vocab=vocab)


@functools.cache
def _adapted(cls: type) -> type:
    """``cls`` with scale_ocr's ``forward``: a subclass without state of its own (docTR's state dict, unchanged)."""

    def forward(self, images: torch.Tensor, targets: torch.Tensor | None = None,
                target_lengths: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        words = None
        if targets is not None and target_lengths is not None:
            rows, lengths = targets.tolist(), target_lengths.tolist()
            words = ["".join(self.vocab[i - 1] for i in row[:n]) for row, n in zip(rows, lengths, strict=True)]
        out = cls.forward(self, images, target=words, return_model_output=True)
        return {"logits": out["out_map"], **({"loss": out["loss"]} if "loss" in out else {})}

    return type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__,
                                       "__doc__": f"docTR's {cls.__name__}, called as a scale_ocr model."})


def doctr_builder(name: str) -> Callable[..., nn.Module]:
    """The registry builder of ``doctr:<arch>``: ``builder(num_classes, input_size, vocab)`` -> docTR's model."""
    arch = name[len(PREFIX):]
    if arch not in RECOGNIZERS:
        raise UserError(f"unknown docTR model {name!r}; choose one of: {', '.join(names())}")
    _doctr()

    def build(num_classes: int, input_size: tuple[int, int], vocab: str) -> nn.Module:
        from doctr.models import recognition

        if num_classes != len(vocab) + 1:
            raise ValueError(f"{name}: {num_classes} classes for a vocabulary of {len(vocab)} characters")
        model = getattr(recognition, arch)(pretrained=False, pretrained_backbone=False, vocab=vocab,
                                           input_shape=(3, *input_size))
        model.__class__ = _adapted(type(model))
        return model

    build.__name__ = name
    build.task = "doctr_recognition"
    build.doctr_arch = arch
    build.vocabs = vocabs
    build.default_vocab = lambda: default_cfg(arch)["vocab"]
    return build
