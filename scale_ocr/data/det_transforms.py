"""Page transforms that move the word polygons with the pixels: resize and pad, crop, rotate, jitter.

Every op takes and returns ``(PIL image, polygons, words)``: float32 ``(N, 4, 2)`` ``(x, y)`` points in the image's
absolute pixels (pixel edges, not centres) and the parallel words (or none). Random choices use torch's RNG only,
which the DataLoader seeds per worker, so augmentation is reproducible (docs/data.md, "Detection at the page's scale").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import shapely
import torch
from PIL import Image
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from scale_ocr.config import DEFAULT_MAX_PAGE_SIDE
from scale_ocr.data.transforms import MEAN, STD
from scale_ocr.models.detection.sizes import STRIDE

SCALE_JITTER = (0.7, 1.4)  # training pages' random scale around --page-scale: other resolutions' word sizes
TEXT_CROP_P = 0.9  # share of training crops placed on a random word (the rest uniform: margins, blank areas)


def _uniform(low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand(()))


def rotate_points(polygons: np.ndarray, angle: float, src_size: tuple[int, int],
                  dst_size: tuple[int, int]) -> np.ndarray:
    """Where points of a ``src_size`` (W, H) image land once Pillow rotates it by ``angle`` degrees.

    Pillow maps the input centre onto the output centre (``dst_size``, larger when expanded); with y
    pointing down a counter-clockwise turn on screen is (dx, dy) -> (cos dx + sin dy, -sin dx + cos dy).
    """
    c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    d = np.asarray(polygons, dtype=np.float64) - (src_size[0] / 2, src_size[1] / 2)
    turned = np.stack([c * d[..., 0] + s * d[..., 1], -s * d[..., 0] + c * d[..., 1]], axis=-1)
    return (turned + (dst_size[0] / 2, dst_size[1] / 2)).astype(np.float32)


def rotate_page(img: Image.Image, polygons: np.ndarray, angle: float, fill: tuple[int, ...],
                expand: bool) -> tuple[Image.Image, np.ndarray]:
    """Rotate ``img`` counter-clockwise by ``angle`` degrees about its centre, and the polygons with it; ``expand``
    grows the canvas so no pixel is cut, False keeps the size (a page rendered with room for it)."""
    out = img.rotate(angle, resample=Image.BILINEAR, expand=expand, fillcolor=fill)
    return out, rotate_points(polygons, angle, img.size, out.size)


def border_colour(img: Image.Image) -> tuple[int, ...]:
    """Median colour of the image's outermost pixels: the paper, for filling rotated corners."""
    a = np.asarray(img)
    ring = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]])
    return tuple(int(v) for v in np.median(ring, axis=0))


def inside_fraction(polygons: np.ndarray, width: float, height: float) -> np.ndarray:
    """Share of each polygon's area that lies within ``[0, width] x [0, height]`` (0 for an empty one)."""
    if len(polygons) == 0:
        return np.zeros(0)
    geoms = shapely.polygons(polygons.astype(np.float64))
    area = shapely.area(geoms)
    cut = shapely.area(shapely.intersection(geoms, shapely.box(0, 0, width, height)))
    return np.divide(cut, area, out=np.zeros_like(area), where=area > 0)


def crop_window(img: Image.Image, polygons: np.ndarray, words: list[str], box: tuple[int, int, int, int],
                keep: float):
    """The ``(x0, y0, x1, y1)`` window of the page, its polygons shifted into it and clipped to its edges.

    A word with less than ``keep`` of its area inside is dropped with its text; its visible sliver stays
    unlabelled, the price of not labelling half-letters as words. A word cut by the edge but mostly inside is
    kept, clipped to the window: its visible part is the word the model must find there.
    """
    x0, y0, x1, y1 = box
    cw, ch = x1 - x0, y1 - y0
    img = img.crop(box)
    polygons = polygons - np.float32([x0, y0])
    kept = inside_fraction(polygons, cw, ch) >= keep
    polygons = np.clip(polygons[kept], 0, np.float32([cw, ch]))
    if len(words) == len(kept):
        words = [wd for wd, k in zip(words, kept, strict=True) if k]
    return img, polygons.reshape(-1, 4, 2), words


class ResizePage:
    """Fit the page into ``(H, W)`` keeping its aspect ratio, then pad bottom/right with black.

    docTR's ``preserve_aspect_ratio=True, symmetric_pad=False``: text keeps its shape, and the padding
    is the zero image docTR's predictor pads with, so a trained model sees the inputs it will get.
    ``pad=False`` only fits (the first step of a rotation, done at model size rather than full scan size).
    """

    def __init__(self, size: tuple[int, int], pad: bool = True) -> None:
        self.h, self.w = size
        self.pad = pad

    def __call__(self, img: Image.Image, polygons: np.ndarray, words: list[str]):
        w, h = img.size
        scale = min(self.h / h, self.w / w)
        nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
        if (nw, nh) != (w, h):
            img = img.resize((nw, nh), Image.BILINEAR)
            polygons = polygons * np.float32([nw / w, nh / h])  # the exact per-axis factors after rounding
        if self.pad and (nw, nh) != (self.w, self.h):
            canvas = Image.new("RGB", (self.w, self.h), (0, 0, 0))
            canvas.paste(img, (0, 0))
            img = canvas
        return img, polygons, words


class RandomCrop:
    """With probability ``p``, keep a random window of the page (later resized: a zoom-in), cut by
    :func:`crop_window`; ``scale`` bounds its area as a share of the page's, ``ratio`` its aspect relative to it."""

    def __init__(self, p: float = 0.5, scale: tuple[float, float] = (0.3, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), keep: float = 0.5) -> None:
        self.p, self.scale, self.ratio, self.keep = p, scale, ratio, keep

    def window(self, w: int, h: int) -> tuple[int, int, int, int]:
        """Draw a crop window ``(x0, y0, x1, y1)`` of a ``w`` x ``h`` page from torch's RNG."""
        area = _uniform(*self.scale)
        aspect = math.exp(_uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
        cw = min(w, max(1, round(w * math.sqrt(area * aspect))))
        ch = min(h, max(1, round(h * math.sqrt(area / aspect))))
        x0 = int(torch.randint(0, w - cw + 1, ()))
        y0 = int(torch.randint(0, h - ch + 1, ()))
        return x0, y0, x0 + cw, y0 + ch

    def __call__(self, img: Image.Image, polygons: np.ndarray, words: list[str]):
        if float(torch.rand(())) >= self.p:
            return img, polygons, words
        return crop_window(img, polygons, words, self.window(*img.size), self.keep)


def page_factor(page_scale: str) -> float | None:
    """The factor pages are scaled by for a ``--page-scale`` value: None for ``fit``, 1 for ``native``."""
    if page_scale == "fit":
        return None
    return 1.0 if page_scale == "native" else float(page_scale)


def run_size(width: int, height: int, factor: float, max_side: int) -> tuple[int, int]:
    """``(width, height)`` a page is read at: scaled by ``factor``, then down (aspect kept) so no side passes
    ``max_side``. Not padded: :func:`stride_ceil` of it is what the detector runs on."""
    f = min(factor, max_side / max(width, height))
    return min(max_side, max(1, round(width * f))), min(max_side, max(1, round(height * f)))


def stride_ceil(side: int) -> int:
    """``side`` rounded up to DBNet's stride (32): the page is padded, never stretched, to it."""
    return -(-side // STRIDE) * STRIDE


class ScalePage:
    """Scale the page by ``factor`` (capped so its longest side is at most ``max_side``), times a random
    log-uniform ``jitter`` when given (augmentation: words of other sizes, as pages of other resolutions hold).

    Polygons follow with the exact per-axis factors of the rounded size, so they map back to the page exactly.
    """

    def __init__(self, factor: float, max_side: int, jitter: tuple[float, float] | None = None) -> None:
        self.factor, self.max_side, self.jitter = factor, max_side, jitter

    def __call__(self, img: Image.Image, polygons: np.ndarray, words: list[str]):
        w, h = img.size
        nw, nh = run_size(w, h, self.factor, self.max_side)
        if self.jitter:
            j = math.exp(_uniform(math.log(self.jitter[0]), math.log(self.jitter[1])))
            nw, nh = max(1, round(nw * j)), max(1, round(nh * j))
        if (nw, nh) != (w, h):
            img = img.resize((nw, nh), Image.BILINEAR)
            polygons = polygons * np.float32([nw / w, nh / h])
        return img, polygons, words


class TextCrop:
    """A window of exactly ``size`` (H, W) from the page at its scale (the whole side where the page is smaller),
    placed so that it holds a random word with probability ``text_p``: a page's margins are wide and its text
    sparse, so uniform windows would show the model mostly paper. Words the edge cuts: :func:`crop_window`.
    """

    def __init__(self, size: tuple[int, int], text_p: float = 0.9, keep: float = 0.5) -> None:
        self.h, self.w = size
        self.text_p, self.keep = text_p, keep

    @staticmethod
    def _start(lo: float, hi: float, span: int, page: int) -> int:
        """A uniform start in ``[lo, hi]`` (whole pixels) that keeps ``span`` inside ``page``."""
        lo, hi = max(0, math.ceil(lo)), min(page - span, math.floor(hi))
        if lo > hi:  # the word cannot be held whole: the nearest start
            lo = hi = min(max(0, lo), page - span)
        return int(torch.randint(lo, hi + 1, ()))

    def window(self, w: int, h: int, polygons: np.ndarray) -> tuple[int, int, int, int]:
        """Draw the window ``(x0, y0, x1, y1)`` of a ``w`` x ``h`` page from torch's RNG."""
        cw, ch = min(self.w, w), min(self.h, h)
        if len(polygons) and float(torch.rand(())) < self.text_p:
            word = polygons[int(torch.randint(0, len(polygons), ()))]
            (x_lo, y_lo), (x_hi, y_hi) = word.min(0), word.max(0)
            if x_hi - x_lo > cw:
                x_lo = x_hi = (x_lo + x_hi) / 2
            if y_hi - y_lo > ch:
                y_lo = y_hi = (y_lo + y_hi) / 2
            x0, y0 = self._start(x_hi - cw, x_lo, cw, w), self._start(y_hi - ch, y_lo, ch, h)
        else:
            x0, y0 = self._start(0, w - cw, cw, w), self._start(0, h - ch, ch, h)
        return x0, y0, x0 + cw, y0 + ch

    def __call__(self, img: Image.Image, polygons: np.ndarray, words: list[str]):
        return crop_window(img, polygons, words, self.window(*img.size, polygons), self.keep)


class PadTo:
    """Pad the page bottom/right with black up to ``size`` (H, W): a page smaller than the crop. Polygons stay."""

    def __init__(self, size: tuple[int, int]) -> None:
        self.h, self.w = size

    def __call__(self, img: Image.Image, polygons: np.ndarray, words: list[str]):
        if img.size != (self.w, self.h):
            canvas = Image.new("RGB", (max(self.w, img.width), max(self.h, img.height)), (0, 0, 0))
            canvas.paste(img, (0, 0))
            img = canvas
        return img, polygons, words


class RandomRotate:
    """With probability ``p``, turn the page by up to ``degrees`` either way, growing the canvas."""

    def __init__(self, degrees: float = 5.0, p: float = 0.5) -> None:
        self.degrees, self.p = degrees, p

    def __call__(self, img: Image.Image, polygons: np.ndarray, words: list[str]):
        if float(torch.rand(())) >= self.p:
            return img, polygons, words
        angle = _uniform(-self.degrees, self.degrees)
        img, polygons = rotate_page(img, polygons, angle, border_colour(img), expand=True)
        return img, polygons, words


class ImageOnly:
    """Apply an image-only transform (colour jitter) and pass the polygons through."""

    def __init__(self, transform) -> None:
        self.transform = transform

    def __call__(self, img: Image.Image, polygons: np.ndarray, words: list[str]):
        return self.transform(img), polygons, words


class DetCompose:
    """Run page ops in order, then turn the image into a normalised float tensor (3, H, W): ``transform(img,
    polygons, words=())`` returns ``(tensor, polygons in its pixels, words filtered alongside)``."""

    def __init__(self, ops: Sequence, mean: Sequence[float] = MEAN, std: Sequence[float] = STD) -> None:
        self.ops = list(ops)
        self.mean, self.std = list(mean), list(std)

    def __call__(self, img: Image.Image, polygons, words: Sequence[str] = ()):
        polygons = np.asarray(polygons, dtype=np.float32).reshape(-1, 4, 2)
        words = list(words)
        if img.mode != "RGB":  # a grey or palette page: the ops fill and pad with RGB colours
            img = img.convert("RGB")
        for op in self.ops:
            img, polygons, words = op(img, polygons, words)
        x = TF.normalize(TF.to_dtype(TF.pil_to_tensor(img), torch.float32, scale=True), self.mean, self.std)
        return x, polygons.astype(np.float32), words


def build_det_transform(input_size: tuple[int, int], train: bool, augment: bool = True,
                        mean: Sequence[float] = MEAN, std: Sequence[float] = STD, page_scale: str = "fit",
                        max_side: int = DEFAULT_MAX_PAGE_SIDE, degrade=None) -> DetCompose:
    """Page (PIL) + polygons -> model input; crop, rotation and colour jitter only when ``train`` and ``augment``.

    ``page_scale``: ``fit`` fits whole pages into ``input_size``; ``native`` or a factor scales pages (capped at
    ``max_side``), trains on ``input_size`` crops of them and evaluates whole pages, unpadded (the collate pads a
    batch to its largest page, rounded up to the stride).
    """
    factor = page_factor(page_scale)
    first = [ImageOnly(degrade)] if train and degrade else []  # scale_ocr.data.degrade: on the page as it came
    if factor is not None:
        if not train:
            return DetCompose([ScalePage(factor, max_side)], mean, std)
        jitter = SCALE_JITTER if augment else None
        ops: list = [*first, ScalePage(factor, max_side, jitter)]
        if augment:
            ops += [RandomRotate(), TextCrop(input_size, TEXT_CROP_P),
                    ImageOnly(T.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2, hue=0.02))]
        else:
            ops.append(TextCrop(input_size, TEXT_CROP_P))
        return DetCompose([*ops, PadTo(input_size)], mean, std)
    ops = first
    if train and augment:
        # Jitter before padding, so the pad stays the black a predictor pads with.
        ops += [RandomCrop(), ResizePage(input_size, pad=False), RandomRotate(),
                ImageOnly(T.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2, hue=0.02))]
    ops.append(ResizePage(input_size))
    return DetCompose(ops, mean, std)


def pad_batch(images: Sequence[torch.Tensor], mean: Sequence[float] = MEAN, std: Sequence[float] = STD
              ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Normalised pages of any sizes as one batch, padded bottom/right with normalised black up to the largest
    height and width rounded up to the stride; and each page's own ``(h, w)`` within it."""
    sizes = [tuple(int(v) for v in im.shape[-2:]) for im in images]
    h, w = stride_ceil(max(s[0] for s in sizes)), stride_ceil(max(s[1] for s in sizes))
    if all(s == (h, w) for s in sizes):
        return torch.stack(list(images)), sizes
    black = ((0 - torch.tensor(mean, dtype=torch.float32)) / torch.tensor(std, dtype=torch.float32)).view(-1, 1, 1)
    out = black.to(images[0].dtype).expand(len(images), -1, h, w).clone()
    for i, im in enumerate(images):
        out[i, :, :im.shape[-2], :im.shape[-1]] = im
    return out, sizes
