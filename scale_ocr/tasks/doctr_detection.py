"""Text detection with docTR's own models (``doctr:<arch>``): docTR's targets, loss, normalisation and boxes.

The data side is the detection task's (docTR detection folders or synthetic pages, the same page transforms,
metrics and examples); what differs is behind the task's methods: a batch's targets are its word polygons
padded into one tensor (docTR's models build their own target maps and loss from polygons), pages are
normalised with the architecture's own mean and std, the validation loss is the model's own, and
probability maps become boxes through docTR's post-processor of the architecture.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from scale_ocr.config import ModelConfig
from scale_ocr.models.factory import parse_model_name
from scale_ocr.tasks.detection import DetectionTask, PageBatch
from scale_ocr.tasks.registry import register_task


def padded_polygons(polygons: list[np.ndarray], h: int, w: int) -> dict[str, torch.Tensor]:
    """A batch's word polygons (input pixels) as one tensor of relative coordinates ``(B, N, 4, 2)``, padded
    with zeros to the page with most words (at least one slot), and ``counts`` (B,), the real ones per page."""
    n = max([1, *(len(p) for p in polygons)])
    out = np.zeros((len(polygons), n, 4, 2), np.float32)
    for i, p in enumerate(polygons):
        out[i, :len(p)] = np.asarray(p, np.float32).reshape(-1, 4, 2) / np.float32([w, h])
    return {"polygons": torch.from_numpy(out), "counts": torch.tensor([len(p) for p in polygons])}


@register_task
class DoctrDetectionTask(DetectionTask):
    """docTR's detectors (DBNet, LinkNet, FAST) trained as they are."""

    name = "doctr_detection"
    default_input_size = (1024, 1024)  # docTR's input shape for all its detectors
    default_page_scale = "fit"  # docTR's predictor fits whole pages into the input shape: train as docTR reads

    def __init__(self, model_cfg: ModelConfig) -> None:
        from scale_ocr.models.doctr_zoo import default_cfg, det_postprocessor

        super().__init__(model_cfg)
        self.doctr_arch = parse_model_name(self.arch)[1]
        cfg = default_cfg(self.doctr_arch)
        self.mean, self.std = tuple(cfg["mean"]), tuple(cfg["std"])
        self._post = det_postprocessor(self.doctr_arch)

    targets = staticmethod(padded_polygons)

    def dummy_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        h, w = self.input_size
        word = np.float32([[w / 4, h / 4], [3 * w / 4, h / 4], [3 * w / 4, h / 2], [w / 4, h / 2]])
        return (torch.randn(batch, 3, h, w), *padded_polygons([word[None]] * batch, h, w).values())

    def probabilities(self, out: dict[str, torch.Tensor]) -> np.ndarray:
        return out["probs"].detach().float()[:, 0].cpu().numpy()

    def eval_batch(self, model: nn.Module, batch: PageBatch, autocast) -> tuple[float, np.ndarray]:
        """docTR's loss is a batch mean, so the batch's is weighted by its valid pages (a rank's last batch may
        carry the sampler's padding repeats, which then count at the batch's mean)."""
        with autocast():
            out = model(*batch.inputs)
        return float(out["loss"].float()) * int(batch.valid.sum()), self.probabilities(out)

    def boxes(self, prob: np.ndarray) -> list:
        """docTR's boxes of one (H, W) probability map, as :class:`~scale_ocr.boxes.Box` (relative corners
        clockwise from the top left)."""
        from scale_ocr.boxes.postprocess import Box

        (found,) = self._post(prob[None, :, :, None])[0]  # one page, one class
        return [Box(np.float64([[x0, y0], [x1, y0], [x1, y1], [x0, y1]]), float(score))
                for x0, y0, x1, y1, score in found[:, :5]]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "doctr_arch": self.doctr_arch}
