"""Text detection: pages in, DB target maps, boxes and recall / precision / IoU out."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from scale_ocr.config import DataConfig, ModelConfig
from scale_ocr.dist.distributed import DistInfo, all_reduce_sum
from scale_ocr.errors import UserError
from scale_ocr.tasks.base import EvalResult, Task
from scale_ocr.tasks.registry import register_task

NUM_EXAMPLES = 4  # validation pages shown in the W&B table, boxes drawn on them
TARGET_KEYS = ("prob_target", "prob_mask", "thresh_target", "thresh_mask")


@dataclass(frozen=True)
class PostProcess:
    """Probability map -> boxes settings (DBNet paper / docTR defaults)."""

    bin_thresh: float = 0.3
    box_thresh: float = 0.1
    unclip_ratio: float = 1.5
    rotated: bool = False


@dataclass
class PageBatch:
    """Images and the model's training targets (the task's: DB maps, or padded polygons); ground-truth boxes
    (input pixels) and mask for metrics."""

    images: torch.Tensor
    maps: dict[str, torch.Tensor]
    polygons: list[np.ndarray]
    words: list[list[str]]
    valid: torch.Tensor

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The model's positional arguments, images then targets in order (tensors only, batch first, so
        DataParallel can scatter them)."""
        return (self.images, *self.maps.values())

    def to(self, device: torch.device) -> PageBatch:
        nb = device.type == "cuda"
        return PageBatch(self.images.to(device, non_blocking=nb),
                         {k: v.to(device, non_blocking=nb) for k, v in self.maps.items()},
                         self.polygons, self.words, self.valid)

    def __len__(self) -> int:
        return len(self.polygons)


def db_maps(polygons: list[np.ndarray], h: int, w: int) -> dict[str, torch.Tensor]:
    """scale_ocr's DBNet targets of a batch: the four (B, H, W) maps of :data:`TARGET_KEYS`."""
    from scale_ocr.models.detection.targets import build_targets

    maps = [build_targets(p, h, w) for p in polygons]
    return {k: torch.from_numpy(np.stack([m[k] for m in maps])) for k in TARGET_KEYS}


class PageCollate:
    """Stacks pages and builds their training targets with ``targets(polygons, h, w)`` (in the loader's workers
    when there are any)."""

    def __init__(self, targets: Callable[[list[np.ndarray], int, int], dict[str, torch.Tensor]] = db_maps) -> None:
        self.targets = targets

    def __call__(self, items) -> PageBatch:
        images, polygons, words, valid = zip(*items, strict=True)
        h, w = images[0].shape[-2:]
        return PageBatch(torch.stack(images), self.targets(list(polygons), h, w), list(polygons),
                         [list(x) for x in words], torch.tensor(valid))


@register_task
class DetectionTask(Task):
    """DBNet text detection: docTR's detection folders or synthetic pages."""

    name = "detection"
    default_input_size = (512, 512)
    default_samples = (2048, 64)
    default_augment = True  # page geometry and photometry: what a detector must not depend on
    metric_names = ("hmean", "recall", "precision", "mean_iou")
    percent_metrics = frozenset({"hmean", "recall", "precision"})

    def __init__(self, model_cfg: ModelConfig) -> None:
        from scale_ocr.data.transforms import MEAN, STD

        super().__init__(model_cfg)
        self.post = PostProcess()
        self.mean, self.std = MEAN, STD  # the pages' normalisation

    @classmethod
    def check_config(cls, cfg) -> None:
        from scale_ocr.models.detection.sizes import check_input_size

        check_input_size(*cfg.model.input_size)
        if cfg.data.data_cache:
            raise UserError("--data-cache holds word crops for recognition; a detection model trains on pages "
                            "(synthetic, or --train-path with docTR detection folders)")

    def model_kwargs(self) -> dict[str, Any]:
        return {"input_size": self.input_size}

    @classmethod
    def from_identity(cls, identity: dict[str, Any]) -> DetectionTask:
        return cls(cls.model_config(identity))

    def dummy_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        h, w = self.input_size
        maps = [torch.zeros(batch, h, w), torch.ones(batch, h, w), torch.full((batch, h, w), 0.3),
                torch.zeros(batch, h, w)]
        maps[0][:, h // 4: h // 2, w // 4: 3 * w // 4] = 1  # one "word", so every loss term is exercised
        return (torch.randn(batch, 3, h, w), *maps)

    def benchmark_data(self, work: Path, samples: int, log: Callable[[str], None]) -> list[str]:
        """Synthetic pages rendered by the loader: a page costs tens of milliseconds to draw against seconds
        of DBNet compute on CPU, and a page cache of 512x512 images would not fit in memory at scale."""
        return ["--train-samples", str(samples), "--val-samples", "8"]

    def build_data(self, cfg: DataConfig, batch_size: int, seed: int, dist: DistInfo):
        from scale_ocr.data.files import ScanReport
        from scale_ocr.data.loader import VAL_SEED_OFFSET, build_loaders, labels_digest
        from scale_ocr.data.shard_reader import open_pages
        from scale_ocr.data.synthetic_pages import SyntheticPages

        train_tf = self.transform(train=True, augment=cfg.augment)
        val_tf = self.transform(train=False)
        report = ScanReport()
        if cfg.train_path:
            train_ds = open_pages(cfg.train_path, cfg.on_bad_sample, train_tf, train=True)
            report = train_ds.report
        else:
            train_ds = SyntheticPages(cfg.train_samples, seed, self.input_size, self.charset, train_tf)
        if cfg.val_path:
            val_ds = open_pages(cfg.val_path, cfg.on_bad_sample, val_tf, train=False)
            for k, v in val_ds.report.skipped.items():
                report.skipped[f"val_{k}"] = v
        else:
            val_ds = SyntheticPages(cfg.val_samples, seed + VAL_SEED_OFFSET, self.input_size, self.charset, val_tf)
        digest = labels_digest(cfg.train_path) if cfg.train_path else None
        return build_loaders(train_ds, val_ds, PageCollate(self.targets), cfg, batch_size, seed, dist, dict(report.skipped),
                             digest)

    targets = staticmethod(db_maps)  # a batch's training targets, the model's arguments after the images

    def transform(self, train: bool, augment: bool = True):
        """Page (PIL) + polygons -> the model's input tensor, polygons and words (augmented when training)."""
        from scale_ocr.data.det_transforms import build_det_transform

        return build_det_transform(self.input_size, train=train, augment=augment, mean=self.mean, std=self.std)

    def doctr_info(self) -> dict[str, Any]:
        """What docTR's class is built with to hold this model's weights, and how to feed it."""
        return {"input_shape": [3, *self.input_size], "mean": list(self.mean), "std": list(self.std)}

    def probabilities(self, out: dict[str, torch.Tensor]) -> np.ndarray:
        """The model's output -> the (B, H, W) text probability maps."""
        return torch.sigmoid(out["logits"].float())[:, 0].cpu().numpy()

    def eval_batch(self, model: nn.Module, batch: PageBatch, autocast) -> tuple[float, np.ndarray]:
        """The summed loss of the batch's valid pages and the probability maps of all of them."""
        with autocast():
            out = model(*batch.inputs)
        return float(out["losses"][batch.valid.to(out["losses"].device)].sum()), self.probabilities(out)

    def boxes(self, prob: np.ndarray) -> list:
        """Boxes (relative coordinates) of one (H, W) probability map."""
        from scale_ocr.boxes import boxes_from_map

        p = self.post
        return boxes_from_map(prob, p.bin_thresh, p.box_thresh, p.unclip_ratio, rotated=p.rotated)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: DataLoader, device: torch.device,
                 autocast: Callable[[], AbstractContextManager]) -> EvalResult:
        """DB loss, and recall / precision / mean IoU at IoU 0.5 with one-to-one matching, over every page."""
        from scale_ocr.boxes import LocalizationMetric

        model.eval()
        metric = LocalizationMetric()
        loss_sum, pages, examples = 0.0, 0, []
        for batch in loader:
            batch = batch.to(device)
            batch_loss, probs = self.eval_batch(model, batch, autocast)
            loss_sum += batch_loss
            h, w = probs.shape[-2:]
            for i in (i for i, v in enumerate(batch.valid.tolist()) if v):
                pred = _polygons(self.boxes(probs[i]))
                gt = batch.polygons[i] / np.float32([w, h])
                metric.update(pred, gt)
                pages += 1
                if len(examples) < NUM_EXAMPLES:
                    examples.append(_example(batch.images[i], pred, gt, self.mean, self.std))
        model.train()
        sums = all_reduce_sum([loss_sum, pages, *metric.sums()], device)
        rates = LocalizationMetric.rates(sums[2:])
        r, p = rates["recall"], rates["precision"]
        return EvalResult({"val_loss": sums[0] / max(sums[1], 1), "hmean": 2 * r * p / (r + p) if r + p else 0.0,
                           **rates}, examples)

    @torch.no_grad()
    def detect(self, model: nn.Module, pages: list, batch_size: int = 4,
               input_size: tuple[int, int] | None = None) -> list[list]:
        """Boxes of each PIL page, as ``(polygon (4, 2) in the page's pixels, score)``.

        ``input_size`` fits the pages into another size than the model was trained at (``--det-size``): DBNet
        is fully convolutional, and a detector trained on small pages finds small words better run larger.
        """
        from scale_ocr.data.det_transforms import build_det_transform
        from scale_ocr.models.detection.sizes import check_input_size

        h, w = input_size or self.input_size
        check_input_size(h, w, "--det-size")
        tf = build_det_transform((h, w), train=False, mean=self.mean, std=self.std)
        out = []
        for i in range(0, len(pages), batch_size):
            chunk = pages[i:i + batch_size]
            images = torch.stack([tf(page, np.zeros((0, 4, 2)))[0] for page in chunk])
            probs = self.probabilities(model(images))
            for page, prob in zip(chunk, probs, strict=True):
                scale = min(h / page.height, w / page.width)  # ResizePage's fit; padding is bottom/right
                out.append([(b.polygon * np.float64([w, h]) / scale, b.score) for b in self.boxes(prob)])
        return out

    def predict(self, model: nn.Module, images: list[str], batch_size: int = 4) -> list[dict[str, Any]]:
        """``{"image", "boxes": [{"polygon": [[x, y] x 4] in the page's pixels, "score"}]}`` per page."""
        from scale_ocr.data.files import open_rgb

        results = []
        for i in range(0, len(images), batch_size):
            chunk = images[i:i + batch_size]
            for name, boxes in zip(chunk, self.detect(model, [open_rgb(n) for n in chunk], batch_size), strict=True):
                results.append({"image": name, "boxes": [{"polygon": np.round(poly, 1).tolist(),
                                                          "score": round(float(s), 4)} for poly, s in boxes]})
        return results


def _polygons(boxes: list) -> np.ndarray:
    return np.array([b.polygon for b in boxes], dtype=np.float64).reshape(-1, 4, 2)


def _example(image: torch.Tensor, pred: np.ndarray, gt: np.ndarray, mean: tuple[float, ...],
             std: tuple[float, ...]) -> dict[str, Any]:
    """A W&B table row: the page with true (green) and predicted (red) boxes drawn on it."""
    from scale_ocr.boxes.draw import draw_polygons
    from scale_ocr.data.transforms import denormalize

    page = (denormalize(image.float().cpu(), mean, std).permute(1, 2, 0) * 255).round().byte().numpy()
    size = np.float64([page.shape[1], page.shape[0]])
    page = draw_polygons(page, gt * size, (0, 200, 0))
    page = draw_polygons(page, pred * size, (230, 0, 0))
    return {"page": page, "true_boxes": len(gt), "predicted_boxes": len(pred)}
