"""Text detection: pages in, DB target maps, boxes and recall / precision / IoU out."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from scale_ocr.config import DEFAULT_MAX_PAGE_SIDE, DataConfig, ModelConfig
from scale_ocr.distributed.process_group import DistInfo, all_reduce_sum
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
    sizes: list[tuple[int, int]] | None = None  # each page's (h, w) inside the padded images; None: all of them

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The model's positional arguments, images then targets in order (tensors only, batch first, so
        DataParallel can scatter them)."""
        return (self.images, *self.maps.values())

    def to(self, device: torch.device) -> PageBatch:
        nb = device.type == "cuda"
        return PageBatch(self.images.to(device, non_blocking=nb),
                         {k: v.to(device, non_blocking=nb) for k, v in self.maps.items()},
                         self.polygons, self.words, self.valid, self.sizes)

    def page_size(self, i: int) -> tuple[int, int]:
        """Page ``i``'s own ``(h, w)``: the images beyond it are padding."""
        return self.sizes[i] if self.sizes else tuple(self.images.shape[-2:])

    def __len__(self) -> int:
        return len(self.polygons)


def db_maps(polygons: list[np.ndarray], h: int, w: int) -> dict[str, torch.Tensor]:
    """scale_ocr's DBNet targets of a batch: the four (B, H, W) maps of :data:`TARGET_KEYS`."""
    from scale_ocr.models.detection.targets import build_targets

    maps = [build_targets(p, h, w) for p in polygons]
    return {k: torch.from_numpy(np.stack([m[k] for m in maps])) for k in TARGET_KEYS}


MASK_KEYS = ("prob_mask", "thresh_mask")  # the DB maps whose 0 leaves a pixel out of the loss


class PageCollate:
    """Stacks pages and builds their training targets with ``targets(polygons, h, w)`` (in the loader's workers
    when there are any).

    Pages of different sizes (whole pages at their own scale, in validation) are padded bottom/right to the
    largest, rounded up to DBNet's stride (:func:`~scale_ocr.data.det_transforms.pad_batch`); the padding is out
    of the DB loss (its masks are 0 there) and of the metrics (each page's own size is kept).
    """

    def __init__(self, targets: Callable[[list[np.ndarray], int, int], dict[str, torch.Tensor]] = db_maps,
                 mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None) -> None:
        from scale_ocr.data.transforms import MEAN, STD

        self.targets, self.mean, self.std = targets, mean or MEAN, std or STD

    def __call__(self, items) -> PageBatch:
        from scale_ocr.data.det_transforms import pad_batch

        images, polygons, words, valid = zip(*items, strict=True)
        stacked, sizes = pad_batch(images, self.mean, self.std)
        h, w = stacked.shape[-2:]
        maps = self.targets(list(polygons), h, w)
        padded = any(s != (h, w) for s in sizes)
        for key in MASK_KEYS if padded else ():
            if key in maps:
                for i, (ph, pw) in enumerate(sizes):
                    maps[key][i, ph:] = 0
                    maps[key][i, :, pw:] = 0
        return PageBatch(stacked, maps, list(polygons), [list(x) for x in words], torch.tensor(valid),
                         sizes if padded else None)


@register_task
class DetectionTask(Task):
    """DBNet text detection: docTR's detection folders or synthetic pages."""

    name = "detection"
    default_input_size = (512, 512)
    default_samples = (2048, 64)
    default_augment = True  # page geometry and photometry: what a detector must not depend on
    moves_text = False  # words must stay in their polygons (its augmentation turns the polygons with the page)
    metric_names = ("hmean", "recall", "precision", "mean_iou")
    percent_metrics = frozenset({"hmean", "recall", "precision"})

    default_page_scale = "native"  # for real pages (--train-path); synthetic pages are rendered at the input size

    def __init__(self, model_cfg: ModelConfig) -> None:
        from scale_ocr.data.transforms import MEAN, STD

        super().__init__(model_cfg)
        self.post = PostProcess()
        self.mean, self.std = MEAN, STD  # the pages' normalisation
        # Unset (a model file from before page scales, a task built by hand): whole pages fitted, as then.
        self.page_scale = model_cfg.page_scale or "fit"
        self.max_page_side = model_cfg.max_page_side or DEFAULT_MAX_PAGE_SIDE

    @classmethod
    def resolve_page_scale(cls, cfg) -> tuple[str, int]:
        """``--page-scale`` and ``--max-page-side`` as given, else: native for real pages, fit for synthetic pages
        (rendered at the input size, so fitting them is the identity) and the default cap."""
        scale = cfg.model.page_scale or (cls.default_page_scale if cfg.data.train_path else "fit")
        return scale, cfg.model.max_page_side or DEFAULT_MAX_PAGE_SIDE

    @classmethod
    def check_config(cls, cfg) -> None:
        from scale_ocr.models.detection.sizes import check_input_size

        check_input_size(*cfg.model.input_size)
        if cfg.data.data_cache:
            raise UserError("--data-cache holds word crops for recognition; a detection model trains on pages "
                            "(synthetic, or --train-path with docTR detection folders)")
        h, w = cfg.model.input_size
        if cfg.model.page_scale != "fit" and cfg.model.max_page_side < max(h, w):
            raise UserError(f"--max-page-side {cfg.model.max_page_side} is below the {h}x{w} crops "
                            f"--page-scale {cfg.model.page_scale} trains on (--input-size); raise it to at least "
                            f"{max(h, w)} or use smaller crops")

    def model_kwargs(self) -> dict[str, Any]:
        return {"input_size": self.input_size}

    @classmethod
    def from_identity(cls, identity: dict[str, Any]) -> DetectionTask:
        import dataclasses

        return cls(dataclasses.replace(cls.model_config(identity), page_scale=identity.get("page_scale"),
                                       max_page_side=identity.get("max_page_side")))

    def _reading(self) -> dict[str, Any]:
        """How the model reads pages, unless ``fit`` (what every model file before page scales did: those still
        load and resume as they are)."""
        return {} if self.page_scale == "fit" else {"page_scale": self.page_scale, "max_page_side": self.max_page_side}

    def identity(self) -> dict[str, Any]:
        """The model's identity, and the scale and longest side it trained and reads pages at (``--det-size auto``
        reads pages as it trained)."""
        return {**super().identity(), **self._reading()}

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **self._reading()}  # config.json's top level: what best_model.pt loads with

    def dummy_inputs(self, batch: int) -> tuple[torch.Tensor, ...]:
        h, w = self.input_size
        maps = [torch.zeros(batch, h, w), torch.ones(batch, h, w), torch.full((batch, h, w), 0.3),
                torch.zeros(batch, h, w)]
        maps[0][:, h // 4: h // 2, w // 4: 3 * w // 4] = 1  # one "word", so every loss term is exercised
        return (torch.randn(batch, 3, h, w), *maps)

    def build_data(self, cfg: DataConfig, batch_size: int, seed: int, dist: DistInfo):
        from scale_ocr.data.files import ScanReport
        from scale_ocr.data.fonts import synthetic_fonts
        from scale_ocr.data.loader import VAL_SEED_OFFSET, build_loaders, labels_digest
        from scale_ocr.data.mix import open_train
        from scale_ocr.data.shard_reader import open_pages
        from scale_ocr.data.synthetic_pages import SyntheticPages

        train_tf = self.transform(train=True, augment=cfg.augment, degrade=cfg.degrade)
        val_tf = self.transform(train=False)
        fonts = synthetic_fonts(cfg, self.charset)  # None where no synthetic page is drawn
        paths = fonts.paths if fonts else ()
        train_ds, digest = open_train(
            cfg, lambda folders: open_pages(folders, cfg.on_bad_sample, train_tf, train=True),
            lambda: SyntheticPages(cfg.train_samples, seed, self.input_size, self.charset, train_tf, paths),
            labels_digest)
        report = getattr(train_ds, "report", None) or ScanReport()
        if cfg.val_path:
            val_ds, _ = self.eval_set(cfg.val_path, cfg.on_bad_sample)
            for k, v in val_ds.report.skipped.items():
                report.skipped[f"val_{k}"] = v
        else:
            val_ds = SyntheticPages(cfg.val_samples, seed + VAL_SEED_OFFSET, self.input_size, self.charset, val_tf,
                                    paths)
        return build_loaders(train_ds, val_ds, PageCollate(self.targets, self.mean, self.std), cfg, batch_size, seed,
                             dist, dict(report.skipped), digest)

    targets = staticmethod(db_maps)  # a batch's training targets, the model's arguments after the images

    def eval_set(self, paths: tuple[str, ...], on_bad_sample: str = "error"):
        """Labelled pages to measure on (detection folders or a shard set) and the collate :meth:`evaluate`'s batches
        need."""
        from scale_ocr.data.shard_reader import open_pages

        data = open_pages(paths, on_bad_sample, self.transform(train=False), train=False)
        return data, PageCollate(self.targets, self.mean, self.std)

    def transform(self, train: bool, augment: bool = True, degrade: tuple[str, ...] = ()):
        """Page (PIL) + polygons -> the model's input tensor, polygons and words (augmented and ``degrade``'d when
        training: NAME=P items, none that moves text)."""
        from scale_ocr.data.degrade import Degrade, parse
        from scale_ocr.data.det_transforms import build_det_transform

        return build_det_transform(self.input_size, train=train, augment=augment, mean=self.mean, std=self.std,
                                   page_scale=self.page_scale, max_side=self.max_page_side,
                                   degrade=Degrade(parse(degrade, self.moves_text)) if train else None)

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
            for i in (i for i, v in enumerate(batch.valid.tolist()) if v):
                h, w = batch.page_size(i)  # the padding beyond a page is neither searched nor scored
                pred = _polygons(self.boxes(probs[i, :h, :w]))
                gt = batch.polygons[i] / np.float32([w, h])
                metric.update(pred, gt)
                pages += 1
                if len(examples) < NUM_EXAMPLES:
                    examples.append(_example(batch.images[i, :, :h, :w], pred, gt, self.mean, self.std))
        model.train()
        sums = all_reduce_sum([loss_sum, pages, *metric.sums()], device)
        rates = LocalizationMetric.rates(sums[2:])
        r, p = rates["recall"], rates["precision"]
        return EvalResult({"val_loss": sums[0] / max(sums[1], 1), "hmean": 2 * r * p / (r + p) if r + p else 0.0,
                           **rates}, examples)

    def reads_whole_pages(self, det_size: tuple[int, int] | str | None) -> bool:
        """Whether ``detect`` runs pages at their own scale (``auto``) rather than fitted into a size: the default
        for a detector trained at a page scale, ``auto`` asked for by name."""
        return det_size == "auto" or (det_size is None and self.page_scale != "fit")

    @torch.no_grad()
    def detect(self, model: nn.Module, pages: list, batch_size: int = 4,
               input_size: tuple[int, int] | str | None = None, max_side: int | None = None) -> list[list]:
        """Boxes of each PIL page, as ``(polygon (4, 2) in the page's pixels, score)``.

        Args:
            input_size: ``auto`` runs each page whole at the scale the detector trained at (its own pixels for
                ``native`` and ``fit``, times the factor of a numeric ``--page-scale``), padded up to a multiple of
                32; ``(H, W)`` fits pages into that size (``--det-size``: DBNet is fully convolutional, and a
                detector trained on small pages finds small words better run larger); None: ``auto`` for a
                detector trained at a page scale, else its own input size.
            max_side: with ``auto``, the longest side a page is read at (larger pages are scaled down to it);
                None: the detector's ``--max-page-side``.
        """
        from scale_ocr.data.det_transforms import build_det_transform, pad_batch
        from scale_ocr.models.detection.sizes import check_input_size

        if self.reads_whole_pages(input_size):
            tf = build_det_transform(self.input_size, train=False, mean=self.mean, std=self.std,
                                     page_scale=self.page_scale if self.page_scale != "fit" else "native",
                                     max_side=max_side or self.max_page_side)
            fit = None
        else:
            fit = input_size or self.input_size
            check_input_size(*fit, "--det-size")
            tf = build_det_transform(fit, train=False, mean=self.mean, std=self.std)
        out = []
        for i in range(0, len(pages), batch_size):
            chunk = pages[i:i + batch_size]
            images, sizes = pad_batch([tf(page, np.zeros((0, 4, 2)))[0] for page in chunk], self.mean, self.std)
            probs = self.probabilities(model(images))
            for page, prob, (h, w) in zip(chunk, probs, sizes, strict=True):
                if fit is None:  # relative to the page as run, which is the whole page scaled: back by its size
                    back = np.float64([page.width, page.height])
                    found = self.boxes(prob[:h, :w])
                else:
                    scale = min(fit[0] / page.height, fit[1] / page.width)  # ResizePage's fit; padding bottom/right
                    back = np.float64([fit[1], fit[0]]) / scale
                    found = self.boxes(prob)
                out.append([(b.polygon * back, b.score) for b in found])
        return out

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
