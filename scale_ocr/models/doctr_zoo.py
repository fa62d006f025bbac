"""docTR's own models in the registry, as ``doctr:<arch>`` (the optional extra ``scale-ocr[doctr]``; docs/models.md).

Each is docTR's model built with ``pretrained=False, pretrained_backbone=False``; only its ``forward`` is adapted to
scale_ocr's model interface, by a subclass without state of its own, so its ``state_dict`` is docTR's key for key.
A recognizer takes the task's padded class indices (0 is the blank) and returns ``{"logits", "loss"}``; a detector
takes padded relative polygons ``(B, N, 4, 2)`` with per-page ``counts`` and returns ``{"probs", "loss"}``. docTR
is imported only when a ``doctr:`` model is asked for: its import costs seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from scale_ocr.errors import UserError
from scale_ocr.models.detection.sizes import check_input_size
from scale_ocr.models.registry import PREFIX, ModelEntry

INSTALL_HINT = "pip install 'scale-ocr[doctr]'"
# docTR's recognition architectures (doctr.models.recognition) and the module of each one's post-processor.
RECOGNIZERS: dict[str, str] = {
    "crnn_vgg16_bn": "crnn", "crnn_mobilenet_v3_small": "crnn", "crnn_mobilenet_v3_large": "crnn",
    "vitstr_small": "vitstr", "vitstr_base": "vitstr", "parseq": "parseq", "master": "master",
    "sar_resnet31": "sar", "viptr_tiny": "viptr",
}
POSTPROCESSORS = {"crnn": "CTCPostProcessor", "vitstr": "ViTSTRPostProcessor", "parseq": "PARSeqPostProcessor",
                  "master": "MASTERPostProcessor", "sar": "SARPostProcessor", "viptr": "VIPTRPostProcessor"}
# docTR's detection architectures (doctr.models.detection), their module and their post-processor.
DETECTORS: dict[str, str] = {
    **{a: "differentiable_binarization" for a in ("db_resnet34", "db_resnet50", "db_mobilenet_v3_large")},
    **{a: "linknet" for a in ("linknet_resnet18", "linknet_resnet34", "linknet_resnet50")},
    **{a: "fast" for a in ("fast_tiny", "fast_small", "fast_base")},
}
DET_POSTPROCESSORS = {"differentiable_binarization": "DBPostProcessor", "linknet": "LinkNetPostProcessor",
                      "fast": "FASTPostProcessor"}
CLASS_NAME = "words"  # docTR's one detection class (doctr.utils.CLASS_NAME)


def names() -> list[str]:
    """Every ``doctr:`` model name (known without importing docTR)."""
    return [PREFIX + arch for arch in (*RECOGNIZERS, *DETECTORS)]


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


def _module(arch: str):
    """docTR's PyTorch module of ``arch``."""
    from importlib import import_module

    _doctr()
    if arch in DETECTORS:
        return import_module(f"doctr.models.detection.{DETECTORS[arch]}.pytorch")
    return import_module(f"doctr.models.recognition.{RECOGNIZERS[arch]}.pytorch")


def default_cfg(arch: str) -> dict[str, Any]:
    """docTR's configuration of ``arch``: its input shape and normalisation (and a recognizer's vocabulary)."""
    return _module(arch).default_cfgs[arch]


def det_postprocessor(arch: str) -> Callable[[np.ndarray], list[list[np.ndarray]]]:
    """docTR's post-processor of detector ``arch`` with its model's default thresholds, for straight pages:
    ``(B, H, W, 1)`` probabilities -> per page ``[(n, 5) boxes]`` (relative xmin, ymin, xmax, ymax, score)."""
    import inspect
    from importlib import import_module

    family = DETECTORS[arch]
    model_cls = {"differentiable_binarization": "DBNet", "linknet": "LinkNet", "fast": "FAST"}[family]
    defaults = inspect.signature(getattr(_module(arch), model_cls).__init__).parameters  # the model's thresholds
    base = import_module(f"doctr.models.detection.{family}.base")
    return getattr(base, DET_POSTPROCESSORS[family])(
        bin_thresh=defaults["bin_thresh"].default, box_thresh=defaults["box_thresh"].default,
        assume_straight_pages=True)


def postprocessor(arch: str, vocab: str) -> Callable[[torch.Tensor], list[tuple[str, float]]]:
    """docTR's post-processor of ``arch``: logits (``out_map``) -> ``[(word, confidence)]``."""
    return getattr(_module(arch), POSTPROCESSORS[RECOGNIZERS[arch]])(vocab=vocab)


def _with_forward(cls: type, forward: Callable) -> type:
    """A subclass of docTR's ``cls`` that only replaces ``forward`` (no state of its own: docTR's state dict)."""
    return type(cls.__name__, (cls,), {"forward": forward, "__module__": __name__,
                                       "__doc__": f"docTR's {cls.__name__}, called as a scale_ocr model."})


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

    return _with_forward(cls, forward)


@functools.cache
def _adapted_detector(cls: type) -> type:
    """Detector ``cls`` with scale_ocr's ``forward`` (padded polygon tensors in, probabilities and loss out)."""

    def forward(self, images: torch.Tensor, polygons: torch.Tensor | None = None,
                counts: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        target = None
        if polygons is not None and counts is not None:
            boxes = polygons.detach().float().clamp(0, 1).cpu().numpy()  # docTR refuses coordinates outside 0..1
            target = [{CLASS_NAME: boxes[i, :n]} for i, n in enumerate(counts.tolist())]
        # Without targets docTR's forward also post-processes the pages into boxes ("preds"); they are dropped:
        # the task post-processes, as DataParallel gathers tensors only.
        out = cls.forward(self, images, target=target, return_model_output=True)
        return {"probs": out["out_map"], **({"loss": out["loss"]} if "loss" in out else {})}

    return _with_forward(cls, forward)


def _detector_builder(name: str, arch: str) -> Callable[..., nn.Module]:
    def build(input_size: tuple[int, int]) -> nn.Module:
        from doctr.models import detection

        check_input_size(*input_size)  # docTR's FPNs need multiples of 32 as scale_ocr's DBNet does
        model = getattr(detection, arch)(pretrained=False, pretrained_backbone=False)
        model.__class__ = _adapted_detector(type(model))
        return model

    build.__name__ = name
    return build


def _recognizer_builder(name: str, arch: str) -> Callable[..., nn.Module]:
    def build(num_classes: int, input_size: tuple[int, int], vocab: str) -> nn.Module:
        from doctr.models import recognition

        if num_classes != len(vocab) + 1:
            raise ValueError(f"{name}: {num_classes} classes for a vocabulary of {len(vocab)} characters")
        model = getattr(recognition, arch)(pretrained=False, pretrained_backbone=False, vocab=vocab,
                                           input_shape=(3, *input_size))
        model.__class__ = _adapted(type(model))
        return model

    build.__name__ = name
    return build


def doctr_entry(name: str) -> ModelEntry:
    """The registry entry of ``doctr:<arch>``: a recognizer's ``build(num_classes, input_size, vocab)`` or a
    detector's ``build(input_size)`` -> docTR's model, under the doctr_recognition or doctr_detection task."""
    arch = name[len(PREFIX):]
    if arch not in RECOGNIZERS and arch not in DETECTORS:
        raise UserError(f"unknown docTR model {name!r}; choose one of: {', '.join(names())}")
    _doctr()
    if arch in DETECTORS:
        # docTR's scripts: detection at -b 2, recognition at -b 64 (the default reference), both at 1e-3.
        return ModelEntry(name, _detector_builder(name, arch), task="doctr_detection", reference_batch=2)
    return ModelEntry(name, _recognizer_builder(name, arch), task="doctr_recognition", vocabs=vocabs,
                      default_vocab=lambda: default_cfg(arch)["vocab"])
