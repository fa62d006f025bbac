"""Image transforms: aspect-preserving resize with padding, and docTR-style train augmentations."""

from __future__ import annotations

import torch
from PIL import Image, ImageOps
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from scale_ocr.config import FRAME_WIDTH

# ImageNet statistics, the convention of the torchvision backbones.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class ResizePad:
    """Resize to fit (H, W) keeping the aspect ratio, then pad right/bottom with the border colour.

    A short word is not stretched across the whole width: the glyphs keep their shape, which is
    what the recognizer learns from.
    """

    def __init__(self, size: tuple[int, int], fill: int | None = None) -> None:
        self.h, self.w = size
        self.fill = fill  # a grey level for the padding (docTR's models: 0, as docTR pads); None: the border colour

    def __call__(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        scale = min(self.h / h, self.w / w)
        nw, nh = max(1, round(w * scale)), max(1, round(h * scale))
        img = img.resize((nw, nh), Image.BILINEAR)
        if (nw, nh) == (self.w, self.h):
            return img
        fill = img.getpixel((nw - 1, nh - 1)) if self.fill is None else (self.fill,) * len(img.getbands())
        return ImageOps.expand(img, border=(0, 0, self.w - nw, self.h - nh), fill=fill)


class ResizeHeight:
    """Resize to height H keeping the aspect ratio, at most ``max_width`` wide (a wider crop is squeezed into it),
    then pad right with the border colour up to a multiple of ``multiple`` columns and at least H: a crop read at
    its own width (``--max-width``). :meth:`width` says how wide a crop of a given size comes out."""

    def __init__(self, height: int, max_width: int, fill: int | None = None, multiple: int = FRAME_WIDTH) -> None:
        self.h, self.max_width, self.fill, self.multiple = height, max_width, fill, multiple

    def scaled(self, size: tuple[int, int]) -> int:
        """The columns a ``(width, height)`` crop's own pixels take at height H."""
        w, h = size
        return max(1, min(self.max_width, round(w * self.h / h)))

    def width(self, size: tuple[int, int]) -> int:
        """The width, padding included, that a ``(width, height)`` crop is read at."""
        m = self.multiple
        return min(self.max_width, max(-(-self.scaled(size) // m) * m, -(-self.h // m) * m))

    def __call__(self, img: Image.Image) -> Image.Image:
        nw, out = self.scaled(img.size), self.width(img.size)
        img = img.resize((nw, self.h), Image.BILINEAR)
        if nw == out:
            return img
        fill = img.getpixel((nw - 1, self.h - 1)) if self.fill is None else (self.fill,) * len(img.getbands())
        return ImageOps.expand(img, border=(0, 0, out - nw, 0), fill=fill)


class GaussianNoise:
    """Additive Gaussian noise on a [0, 1] tensor."""

    def __init__(self, std: float = 0.04, p: float = 0.3) -> None:
        self.std, self.p = std, p

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand(()) >= self.p:
            return x
        return (x + torch.randn_like(x) * self.std).clamp_(0, 1)


class WordTransform:
    """PIL crop -> normalised tensor in two stages: ``pil`` (augment, resize, pad -> uint8 tensor), then
    ``tensor`` (scale to [0, 1], augment, normalise).

    ``deterministic`` says the first stage draws no random numbers, so its uint8 result can be kept and
    reused (see :class:`~scale_ocr.data.synthetic.SyntheticWords`): ``tensor(kept)`` equals ``self(img)`` exactly.
    """

    def __init__(self, pil: list, tensor: list, deterministic: bool) -> None:
        self.pil, self.tensor, self.deterministic = T.Compose(pil), T.Compose(tensor), deterministic

    def __call__(self, img: Image.Image) -> torch.Tensor:
        return self.tensor(self.pil(img))


def build_transform(input_size: tuple[int, int], train: bool, augment: bool = True,
                    mean: tuple[float, ...] = MEAN, std: tuple[float, ...] = STD,
                    fill: int | None = None, degrade=None, own_width: bool = False) -> WordTransform:
    """PIL image -> float tensor (3, H, W) normalised by ``mean``/``std``; augmentations only when training;
    ``fill`` pads as :class:`ResizePad` does; ``degrade`` (a :class:`~scale_ocr.data.degrade.Degrade`) first.
    ``own_width``: W is the crop's own (:class:`ResizeHeight`, at most ``input_size``'s width)."""
    augmented = train and augment
    pil: list = [degrade] if degrade else []
    if augmented:
        pil += [
            T.RandomApply([T.RandomPerspective(distortion_scale=0.15, p=1.0, fill=255)], p=0.25),
            T.RandomApply([T.RandomRotation(2, expand=False, fill=255)], p=0.2),
        ]
    pil += [ResizeHeight(*input_size, fill) if own_width else ResizePad(input_size, fill), T.PILToTensor()]
    tensor: list = [T.ToDtype(torch.float32, scale=True)]
    if augmented:
        tensor += [
            T.RandomApply([T.GaussianBlur(3, sigma=(0.1, 1.0))], p=0.2),
            T.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2, hue=0.02),
            GaussianNoise(),
            T.RandomApply([T.Lambda(lambda x: 1.0 - x)], p=0.1),  # colour inversion
        ]
    tensor.append(T.Normalize(mean, std))
    return WordTransform(pil, tensor, deterministic=not augmented and not degrade)


def denormalize(x: torch.Tensor, mean: tuple[float, ...] = MEAN, std: tuple[float, ...] = STD) -> torch.Tensor:
    """Inverse of the normalisation, for showing images."""
    mean = torch.tensor(mean, device=x.device).view(3, 1, 1)
    std = torch.tensor(std, device=x.device).view(3, 1, 1)
    return (x * std + mean).clamp(0, 1)


__all__ = ["ResizeHeight", "ResizePad", "WordTransform", "build_transform", "denormalize", "TF"]
