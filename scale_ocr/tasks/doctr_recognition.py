"""Word recognition with docTR's own models (``doctr:<arch>``): docTR's loss, vocabulary, normalisation and decoding.

The data side is the recognition task's (docTR folders or synthetic words, the same collation and metrics);
what differs is behind the task's methods: crops are resized keeping their aspect ratio and padded with black
as docTR pads, normalised with the architecture's own mean and std; the validation loss is the model's own;
logits are decoded by docTR's post-processor of the architecture; and ``predict`` prepares crops with docTR's
own ``PreProcessor``, as ``doctr.models.recognition_predictor`` does, so the same weights give the same words
in scale_ocr and in docTR.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from scale_ocr.config import ModelConfig
from scale_ocr.models.factory import parse_model_name
from scale_ocr.tasks.recognition import RecognitionTask, WordBatch
from scale_ocr.tasks.registry import register_task


@register_task
class DoctrRecognitionTask(RecognitionTask):
    """docTR's recognizers (CRNN, ViTSTR, PARSeq, MASTER, SAR, VIPTR) trained as they are."""

    name = "doctr_recognition"

    def __init__(self, model_cfg: ModelConfig) -> None:
        from scale_ocr.models.doctr_zoo import default_cfg, postprocessor

        super().__init__(model_cfg)
        self.doctr_arch = parse_model_name(self.arch)[1]
        cfg = default_cfg(self.doctr_arch)
        self.mean, self.std, self.pad_fill = tuple(cfg["mean"]), tuple(cfg["std"]), 0
        self._post = postprocessor(self.doctr_arch, self.vocab.chars)

    cache_tag = "-doctr"

    @classmethod
    def from_identity(cls, identity: dict[str, Any]) -> DoctrRecognitionTask:
        from scale_ocr.models.doctr_zoo import postprocessor

        task = super().from_identity(identity)  # the recorded characters replace the default vocabulary
        task._post = postprocessor(task.doctr_arch, task.vocab.chars)
        return task

    def model_kwargs(self) -> dict[str, Any]:
        return {**super().model_kwargs(), "vocab": self.vocab.chars}

    reads_own_width = False  # docTR's models read one input size, as docTR's predictor fits crops into it

    def decode(self, logits: torch.Tensor, lengths: torch.Tensor | None = None) -> list[tuple[str, float]]:
        return [(word, float(conf)) for word, conf in self._post(logits.float())]

    def eval_batch(self, model: nn.Module, batch: WordBatch, autocast) -> tuple[float, list[tuple[str, float]]]:
        """docTR's loss is a batch mean, so the batch's is weighted by its valid items (a rank's last batch may
        carry the sampler's padding repeats, which then count at the batch's mean)."""
        with autocast():
            out = model(*batch.inputs)
        return float(out["loss"].float().mean()) * int(batch.valid.sum()), self.decode(out["logits"])

    def recognize(self, model: nn.Module, crops: list, batch_size: int = 64) -> list[tuple[str, float]]:
        """Crops prepared by docTR's own ``PreProcessor`` (aspect-preserving resize, zero padding, the model's
        normalisation), as docTR's recognition predictor prepares them."""
        from doctr.models.preprocessor import PreProcessor

        pre = PreProcessor(self.input_size, batch_size, self.mean, self.std, preserve_aspect_ratio=True)
        out: list[tuple[str, float]] = []
        with torch.no_grad():
            for batch in pre([np.asarray(c.convert("RGB")) for c in crops]):
                out += self.decode(model(batch)["logits"])
        return out
