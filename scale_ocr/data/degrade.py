"""Degradations that real scans and renders show, each a named option with its probability (``--degrade
blur=0.3 jpeg=0.3 ...``; docs/data.md, "Degradations").

They apply to training images only, to every source (folders, shards, the generator), on the PIL image before it is
resized to the model's input, in the order of :data:`NAMES` (the order a page goes through: printed, scanned or
photographed, stored). Each draws its strength from torch's generator, so a run's stream is seeded as its
augmentations are. Sizes are relative to the image's height, so a word crop and a page degrade alike:

- ``ink``: strokes spread (ink bleeding into the paper) or thin (a light print), half a pixel at 32 px of height;
- ``rotate``: a turn of up to 3 degrees (word crops only: a page's words would leave their boxes);
- ``perspective``: a photographed page's keystone, corners moved by up to 5% of the width and 10% of the height
  (word crops only);
- ``blur``: defocus, a Gaussian of 0.3 to 1.2 px at 32 px of height;
- ``lowres``: rendered or scanned at 35 to 70% of the resolution, then enlarged back;
- ``noise``: sensor noise, a grey Gaussian of 3 to 15 levels;
- ``jpeg``: stored as JPEG at quality 15 to 60.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageFilter

from scale_ocr.errors import UserError, shown

NAMES = ("ink", "rotate", "perspective", "blur", "lowres", "noise", "jpeg")
# The set the benchmarks try against the defaults (benchmarks.convergence's and benchmarks.cross_documents' recipe
# `degraded`): each at 0.2, the geometric ones at 0.1. Not a default until those records say it pays.
CANDIDATE = ("ink=0.2", "rotate=0.1", "perspective=0.1", "blur=0.2", "lowres=0.2", "noise=0.2", "jpeg=0.2")
GEOMETRIC = ("rotate", "perspective")  # they move text: word crops only


def parse(items: tuple[str, ...] | list[str], geometric: bool = True) -> dict[str, float]:
    """``NAME=PROBABILITY`` items as ``{name: p}``; refused in one line when a name is unknown, a probability is not
    in [0, 1], or (``geometric`` False: pages) a degradation would move text out of its labelled box."""
    chosen: dict[str, float] = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            p = float(text) if sep else math.nan
        except ValueError:
            p = math.nan
        if name not in NAMES:
            raise UserError(f"--degrade {shown(item)}: no degradation {shown(name)}; give NAME=PROBABILITY with NAME "
                            f"one of {', '.join(NAMES)}")
        if not 0 <= p <= 1:
            raise UserError(f"--degrade {shown(item)}: give the probability it is applied to an image, from 0 to 1, "
                            f"e.g. {name}=0.3")
        if name in GEOMETRIC and not geometric:
            raise UserError(f"--degrade {name}: it moves text, and a page's words would leave their labelled boxes; "
                            "detection turns pages with --augment, leave it out")
        chosen[name] = p
    return chosen


def _uniform(lo: float, hi: float) -> float:
    return lo + (hi - lo) * float(torch.rand(()))


def _background(img: Image.Image) -> tuple[int, ...]:
    """The image's most common border colour, what a turned or distorted image is filled with."""
    a = np.asarray(img)
    border = np.concatenate([a[0], a[-1], a[:, 0], a[:, -1]]).reshape(-1, a.shape[-1] if a.ndim == 3 else 1)
    return tuple(int(v) for v in np.median(border, axis=0))


def ink(img: Image.Image) -> Image.Image:
    """Spread or thin the strokes (darker than the paper or lighter) by a minimum or maximum filter at twice the
    resolution: half a pixel of a 32-pixel-high crop."""
    w, h = img.size
    big = img.resize((2 * w, 2 * h), Image.BILINEAR)
    grey = np.asarray(img.convert("L"), dtype=np.float32)
    dark_ink = float(np.median(grey)) >= float(grey.mean())  # mostly light paper: the ink is the dark minority
    spread = torch.rand(()) < 0.5
    size = 3 if h < 64 else 5
    grow_dark = spread == dark_ink
    big = big.filter(ImageFilter.MinFilter(size) if grow_dark else ImageFilter.MaxFilter(size))
    return big.resize((w, h), Image.BILINEAR)


def rotate(img: Image.Image) -> Image.Image:
    return img.rotate(_uniform(-3, 3), resample=Image.BILINEAR, expand=True, fillcolor=_background(img))


def perspective(img: Image.Image) -> Image.Image:
    from torchvision.transforms.v2 import functional as TF

    w, h = img.size
    corners = [[0, 0], [w - 1, 0], [w - 1, h - 1], [0, h - 1]]
    moved = [[x + _uniform(-0.05, 0.05) * w, y + _uniform(-0.1, 0.1) * h] for x, y in corners]
    return TF.perspective(img, corners, moved, fill=list(_background(img)))


def blur(img: Image.Image) -> Image.Image:
    return img.filter(ImageFilter.GaussianBlur(_uniform(0.3, 1.2) * img.size[1] / 32))


def lowres(img: Image.Image) -> Image.Image:
    w, h = img.size
    f = _uniform(0.35, 0.7)
    small = img.resize((max(1, round(w * f)), max(1, round(h * f))), Image.BILINEAR)
    return small.resize((w, h), Image.BILINEAR)


def noise(img: Image.Image) -> Image.Image:
    a = np.asarray(img, dtype=np.float32)
    sigma = _uniform(3, 15)
    grey = torch.randn(a.shape[0], a.shape[1], 1).numpy() * sigma
    return Image.fromarray((a + (grey if a.ndim == 3 else grey[..., 0])).clip(0, 255).astype(np.uint8))


def jpeg(img: Image.Image) -> Image.Image:
    """Encoded as JPEG and decoded back, in memory (torchvision's codec: no file is opened)."""
    from torchvision.io import decode_jpeg, encode_jpeg

    pixels = torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1).contiguous()
    back = decode_jpeg(encode_jpeg(pixels, quality=round(_uniform(15, 60))))
    return Image.fromarray(back.permute(1, 2, 0).numpy()).convert(img.mode)


OPS = {"ink": ink, "rotate": rotate, "perspective": perspective, "blur": blur, "lowres": lowres, "noise": noise,
       "jpeg": jpeg}


class Degrade:
    """PIL image -> PIL image: each chosen degradation applied with its probability, in :data:`NAMES`' order."""

    def __init__(self, chosen: dict[str, float]) -> None:
        self.chosen = [(name, chosen[name]) for name in NAMES if chosen.get(name, 0) > 0]

    def __bool__(self) -> bool:
        return bool(self.chosen)

    def __call__(self, img: Image.Image) -> Image.Image:
        for name, p in self.chosen:
            if torch.rand(()) < p:
                img = OPS[name](img)
        return img
