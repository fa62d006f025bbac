"""Text recognition: word or line crops in, CTC targets, exact match and CER out.

Crops are read fitted into ``--input-size``, or (``--max-width``) at its height and their own width: a batch is then
padded on the right to its widest crop, and ``widths`` says each crop's own columns to the model, which reads no
padding frame into the loss or the decoding."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from scale_ocr.config import FRAME_WIDTH, DataConfig, ModelConfig
from scale_ocr.data.pixel_batches import bucketed
from scale_ocr.data.transforms import MEAN, STD
from scale_ocr.distributed.process_group import DistInfo, all_reduce_sum
from scale_ocr.errors import UserError
from scale_ocr.tasks.base import EvalResult, Task
from scale_ocr.tasks.registry import register_task
from scale_ocr.tasks.text_metrics import TextMetric
from scale_ocr.vocab import Vocab

NUM_EXAMPLES = 8  # validation words shown in the W&B table


@dataclass
class WordBatch:
    """Images and CTC targets for the model, words and mask for metrics."""

    images: torch.Tensor
    targets: torch.Tensor
    target_lengths: torch.Tensor
    words: list[str]
    valid: torch.Tensor
    widths: torch.Tensor | None = None  # each image's own columns (crops read at their own width); None: all

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The model's positional arguments (tensors only, so DataParallel can scatter them)."""
        own = () if self.widths is None else (self.widths,)
        return self.images, self.targets, self.target_lengths, *own

    def to(self, device: torch.device) -> WordBatch:
        nb = device.type == "cuda"
        return WordBatch(self.images.to(device, non_blocking=nb), self.targets.to(device, non_blocking=nb),
                         self.target_lengths.to(device, non_blocking=nb), self.words, self.valid,
                         None if self.widths is None else self.widths.to(device, non_blocking=nb))

    def __len__(self) -> int:
        return len(self.words)


def stack(images: list[torch.Tensor], own_width: bool,
          pad: Callable[[int], int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(C, H, W_i) images as one batch and their widths: read at their own width (``own_width``), padded on the right
    to the widest (``pad``: to the columns it gives for the widest), each with its own last column (the border colour
    the transform padded with); else all of one size, stacked, and None."""
    if not own_width:
        return torch.stack(images), None
    widths = torch.tensor([im.shape[-1] for im in images], dtype=torch.long)
    widest = int(widths.max()) if pad is None else pad(int(widths.max()))
    padded = [F.pad(im[None], (0, widest - im.shape[-1], 0, 0), "replicate")[0] if im.shape[-1] < widest else im
              for im in images]
    return torch.stack(padded), widths


def by_aspect(sizes: list[tuple[int, int]]) -> list[int]:
    """Indices of ``(width, height)`` crops from the narrowest to the widest for their height: read at their own
    width in that order, a batch pads little."""
    return sorted(range(len(sizes)), key=lambda i: sizes[i][0] / max(1, sizes[i][1]))


class Collate:
    """Stacks images (``own_width``: padded to the batch's widest, or to the columns ``pad`` gives for it, with their
    widths) and pads encoded words into a (B, L) target tensor."""

    def __init__(self, vocab: Vocab, own_width: bool = False, pad: Callable[[int], int] | None = None) -> None:
        self.vocab, self.own_width, self.pad = vocab, own_width, pad

    def __call__(self, items) -> WordBatch:
        images, words, valid = zip(*items, strict=True)
        encoded = [self.vocab.encode(w) for w in words]
        lengths = torch.tensor([len(e) for e in encoded], dtype=torch.long)
        targets = torch.zeros(len(encoded), max(1, int(lengths.max())), dtype=torch.long)
        for i, e in enumerate(encoded):
            targets[i, : len(e)] = e
        stacked, widths = stack(list(images), self.own_width, self.pad)
        return WordBatch(stacked, targets, lengths, list(words), torch.tensor(valid), widths)


def by_width(data, sizes: list[tuple[int, int]]):
    """``data`` (a dataset with a scan report) in order of its crops' aspect ratios, its report kept."""
    from torch.utils.data import Subset

    ordered = Subset(data, by_aspect(sizes))
    ordered.report = data.report
    return ordered


def read(model: nn.Module, images: torch.Tensor, widths: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The model's output for a batch of images (``widths``: their own columns, when read at their own width)."""
    return model(images) if widths is None else model(images, widths=widths)


@register_task
class RecognitionTask(Task):
    """CTC text recognition (CRNN, ViTSTR): docTR's recognition folders (words or lines) or synthetic words."""

    name = "recognition"
    default_input_size = (32, 128)
    reads_own_width = True  # --max-width: CRNN's frames and ViTSTR's patch columns follow the input's width
    # Both chosen by the convergence benchmark (its record in benchmarks/results/README.md): augmentation cost exact
    # match within a few epochs, and OneCycle reached the bare loop's level where 5% warm-up + cosine did not.
    default_augment = False
    moves_text = True  # a crop's label is its text, wherever the text sits
    default_sched = "onecycle"
    default_samples = (32768, 512)
    metric_names = ("exact_match", "ci_match", "cer")
    percent_metrics = frozenset({"exact_match", "ci_match"})
    # How crops become inputs: scale_ocr's models pad with the crop's border colour and normalise with ImageNet's
    # statistics (the torchvision backbones' convention); docTR's pad black and use their own.
    mean: tuple[float, ...] = MEAN
    std: tuple[float, ...] = STD
    pad_fill: int | None = None
    cache_tag = ""  # tells apart benchmark caches of differently prepared images

    def __init__(self, model_cfg: ModelConfig) -> None:
        super().__init__(model_cfg)
        if self.own_width and " " not in self.charset:  # a line's words are parted by spaces: a class like any
            self.charset += " "
        self.vocab = Vocab(self.charset)

    @property
    def own_width(self) -> bool:
        """Crops are read at their own width, up to the input size's (``--max-width``)."""
        return self.cfg.max_width is not None

    @classmethod
    def check_config(cls, cfg) -> None:
        """CTC needs one frame per character plus a blank between repeated ones, and synthetic words may
        repeat every character ("aaaa"), so the longest needs 2 * max_chars - 1 frames. Real folders are
        checked word by word at start-up, so only runs that render words are held to it."""
        from scale_ocr.data.mix import draws_synthetic, parse
        from scale_ocr.models.recognition.ctc import ctc_frames

        d = cfg.data
        if cfg.model.max_width is not None and d.data_cache:
            raise UserError("--data-cache holds images of one size, and --max-width reads crops at their own width; "
                            "drop one of them")
        synthetic = draws_synthetic(d)
        if d.batch_pixels and (not d.train_path or parse(d.train_path)):
            raise UserError("--batch-pixels plans each epoch's micro-batches from every crop's size, which docTR "
                            "folders given to --train-path say up front (synthetic words and mixes do not); train "
                            "on folders, or use -b")
        frames, worst = ctc_frames(cfg.model.input_size), 2 * d.max_chars - 1
        if synthetic and worst > frames:
            raise UserError(
                f"--max-chars {d.max_chars} can give synthetic words needing {worst} CTC frames (a blank "
                f"between repeated characters) but a {cfg.model.input_size[1]}-pixel-wide input gives {frames}; "
                f"lower --max-chars to {(frames + 1) // 2} or widen --input-size"
            )

    def model_kwargs(self) -> dict[str, Any]:
        return {"num_classes": self.vocab.num_classes, "input_size": self.input_size}

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "vocab": self.vocab.chars}

    def dummy_inputs(self, batch: int, width: int | None = None) -> tuple[torch.Tensor, ...]:
        height, widest = self.input_size
        return torch.randn(batch, 3, height, width or widest), torch.ones(batch, 1, dtype=torch.long), \
            torch.ones(batch, dtype=torch.long)

    def input_width(self, batch: WordBatch) -> int | None:
        return batch.images.shape[-1] if self.own_width else None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "vocab": self.vocab.chars}

    @classmethod
    def from_identity(cls, identity: dict[str, Any]) -> RecognitionTask:
        task = cls(cls.model_config(identity))
        task.vocab = Vocab(identity["vocab"])  # the characters themselves, never re-read as a vocabulary name
        return task

    def transform(self, train: bool, augment: bool = True, degrade: tuple[str, ...] = ()):
        """PIL crop -> the model's input tensor (augmented and ``degrade``'d when training: NAME=P items)."""
        from scale_ocr.data.degrade import Degrade, parse
        from scale_ocr.data.transforms import build_transform

        return build_transform(self.input_size, train=train, augment=augment, mean=self.mean, std=self.std,
                               fill=self.pad_fill, degrade=Degrade(parse(degrade)) if train else None,
                               own_width=self.own_width)

    def decode(self, logits: torch.Tensor, lengths: torch.Tensor | None = None) -> list[tuple[str, float]]:
        """The model's output -> ``(word, confidence)`` per item (greedy CTC decoding of each item's ``lengths``
        frames, all where None)."""
        from scale_ocr.models.recognition.ctc import ctc_greedy_decode

        words, confs = ctc_greedy_decode(logits, self.vocab, lengths)
        return list(zip(words, confs, strict=True))

    def eval_batch(self, model: nn.Module, batch: WordBatch, autocast) -> tuple[float, list[tuple[str, float]]]:
        """The summed loss of the batch's valid items and the reading of all of them."""
        from scale_ocr.models.recognition.ctc import ctc_loss

        with autocast():
            out = read(model, batch.images, batch.widths)
        lengths = out.get("lengths")
        losses = ctc_loss(out["logits"], batch.targets, batch.target_lengths, reduction="none", lengths=lengths)
        return float(losses[batch.valid.to(losses.device)].sum()), self.decode(out["logits"], lengths)

    def build_data(self, cfg: DataConfig, batch_size: int, seed: int, dist: DistInfo):
        from scale_ocr.data.files import ScanReport
        from scale_ocr.data.fonts import synthetic_fonts
        from scale_ocr.data.loader import VAL_SEED_OFFSET, build_loaders, labels_digest
        from scale_ocr.data.mix import open_train
        from scale_ocr.data.shard_reader import open_words
        from scale_ocr.data.synthetic import SyntheticWords
        train_tf = self.transform(train=True, augment=cfg.augment, degrade=cfg.degrade)
        val_tf = self.transform(train=False)
        fonts = synthetic_fonts(cfg, self.vocab.chars)  # None where no synthetic word is drawn
        if cfg.data_cache:
            from scale_ocr.data.cache import TensorWords

            train_ds, digest = TensorWords(cfg.data_cache, self.vocab, self.input_size), None
        else:
            train_ds, digest = open_train(
                cfg, lambda paths: open_words(paths, self.vocab, cfg.on_bad_sample, train_tf, self.input_size, True,
                                        self.own_width),
                lambda: SyntheticWords(self.vocab.chars, cfg.train_samples, cfg.min_chars, cfg.max_chars, seed,
                                       train_tf, cfg.synthetic_words, fonts), labels_digest)
        report = getattr(train_ds, "report", None) or ScanReport()
        if cfg.data_cache:
            val_ds = train_ds  # benchmarks: validation, if any, is not what is measured
        elif cfg.val_path:
            val_ds, _ = self.eval_set(cfg.val_path, cfg.on_bad_sample)
            for k, v in val_ds.report.skipped.items():
                report.skipped[f"val_{k}"] = v
        else:
            val_ds = SyntheticWords(self.vocab.chars, cfg.val_samples, cfg.min_chars, cfg.max_chars,
                                    seed + VAL_SEED_OFFSET, val_tf, cfg.synthetic_words, fonts)
        pad = functools.partial(bucketed, widest=self.input_size[1], bucket=cfg.width_bucket or FRAME_WIDTH)
        return build_loaders(train_ds, val_ds, Collate(self.vocab, self.own_width, pad if cfg.batch_pixels else None),
                             cfg, batch_size, seed, dist, dict(report.skipped), digest,
                             self.read_widths(train_ds, pad) if cfg.batch_pixels else None)

    def read_widths(self, train_ds, pad: Callable[[int], int]) -> tuple[list[int], int]:
        """Each training crop's width as its micro-batch pads it (``pad``: to ``--width-bucket``), and the input
        height: what ``--batch-pixels`` plans micro-batches from."""
        from scale_ocr.data.transforms import ResizeHeight

        sizes = getattr(train_ds, "sizes", None)
        if not sizes or len(sizes) != len(train_ds):  # a shard set: its crops are decoded as they stream
            raise UserError("--batch-pixels plans each epoch's micro-batches from every crop's size, which docTR "
                            "folders say up front and a shard set does not; train on its folders, or use -b")
        height, widest = self.input_size
        resize = ResizeHeight(height, widest)
        return [pad(resize.width(size)) for size in sizes], height

    def eval_set(self, paths: tuple[str, ...], on_bad_sample: str = "error"):
        """Labelled crops to measure on (recognition folders or a shard set) and the collate :meth:`evaluate`'s
        batches need."""
        from scale_ocr.data.shard_reader import open_words

        data = open_words(paths, self.vocab, on_bad_sample, self.transform(train=False), self.input_size, train=False,
                          own_width=self.own_width)
        sizes = getattr(data, "sizes", None)
        if self.own_width and sizes:  # measured in order of width, so a batch pads little (the sums do not change)
            data = by_width(data, sizes)
        return data, Collate(self.vocab, self.own_width)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader: DataLoader, device: torch.device,
                 autocast: Callable[[], AbstractContextManager]) -> EvalResult:
        """Loss, exact match, case-insensitive match and CER; padding items are masked out of every sum."""
        model.eval()
        metric = TextMetric()
        loss_sum, examples = 0.0, []
        for batch in loader:
            batch = batch.to(device)
            batch_loss, read_out = self.eval_batch(model, batch, autocast)
            loss_sum += batch_loss
            preds = [word for word, _ in read_out]
            keep = [i for i, v in enumerate(batch.valid.tolist()) if v]
            metric.update([preds[i] for i in keep], [batch.words[i] for i in keep])
            for i in keep[: max(0, NUM_EXAMPLES - len(examples))]:
                examples.append({"image": _image(batch.images[i], self.mean, self.std), "target": batch.words[i],
                                 "prediction": preds[i], "correct": preds[i] == batch.words[i]})
        model.train()
        sums = all_reduce_sum([loss_sum, *metric.sums()], device)
        return EvalResult({"val_loss": sums[0] / max(sums[-1], 1), **TextMetric.rates(sums[1:])}, examples)

    def recognize(self, model: nn.Module, crops: list, batch_size: int = 64) -> list[tuple[str, float]]:
        """Texts and confidences for PIL crops (page OCR feeds the detector's crops here)."""
        return self._read(model, crops, batch_size, lambda got, images, chunk: self.decode(got["logits"],
                                                                                           got.get("lengths")))

    def read_lines(self, model: nn.Module, crops: list, batch_size: int = 64
                   ) -> list[list[tuple[str, float, float, float]]]:
        """Each line crop's words, ``(word, confidence, x0, x1)``: x0 and x1 are fractions of the crop's width
        where CTC reads its first character start and its last one end (page OCR by lines gives each word to the
        detected box there). A model that fits every crop into one size does not read lines: refused in one line."""
        from scale_ocr.data.transforms import ResizeHeight
        from scale_ocr.models.recognition.ctc import ctc_word_spans

        if not self.own_width:
            h, w = self.input_size
            raise UserError(f"{self.arch} fits every crop into {h}x{w} pixels, which would crush a line; reading "
                            "lines needs a recognizer trained at its crops' own width (--max-width), or read words")
        sizer = ResizeHeight(*self.input_size)

        def words(got: dict, images: torch.Tensor, chunk: list[int]) -> list:
            per_frame = images.shape[-1] / got["logits"].shape[1]  # input columns per CTC frame
            spans = ctc_word_spans(got["logits"], self.vocab, got.get("lengths"))
            return [[(w, c, min(1.0, f0 * per_frame / own), min(1.0, f1 * per_frame / own)) for w, c, f0, f1 in item]
                    for item, own in zip(spans, [sizer.scaled(crops[j].size) for j in chunk], strict=True)]

        return self._read(model, crops, batch_size, words)

    def _read(self, model: nn.Module, crops: list, batch_size: int, finish: Callable) -> list:
        """``finish(output, images, crop indices)`` of each batch of ``crops``, one result per crop in their order.
        Read at their own width, crops are batched in order of width, so a batch pads little."""
        tf = self.transform(train=False)
        order = by_aspect([c.size for c in crops]) if self.own_width else list(range(len(crops)))
        out: list = [None] * len(crops)
        with torch.no_grad():
            for i in range(0, len(order), batch_size):
                chunk = order[i:i + batch_size]
                tensors = [tf(crops[j]) for j in chunk]
                images, widths = stack(tensors, self.own_width)
                for j, result in zip(chunk, finish(read(model, images, widths), images, chunk), strict=True):
                    out[j] = result
        return out


def _image(image: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]):
    """A normalised input tensor as an (H, W, 3) uint8 array, for the W&B table."""
    from scale_ocr.data.transforms import denormalize

    return (denormalize(image.float().cpu(), mean, std).permute(1, 2, 0) * 255).round().byte().numpy()
