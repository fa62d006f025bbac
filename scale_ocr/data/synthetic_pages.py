"""Synthetic document pages with known word polygons, deterministic per (seed, index).

Paragraphs in one or two columns, the page tinted, turned and noised; every word's polygon is its tight ink box
(``font.getbbox``) turned with the page, so labels match pixels exactly.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from torch.utils.data import Dataset

from scale_ocr.data.det_transforms import rotate_points
from scale_ocr.data.fonts import DEFAULT as DEFAULT_FONTS
from scale_ocr.data.fonts import select
from scale_ocr.data.synthetic import (
    TEXT_HEIGHT,
    _box,
    _font,
    ink_colour,
    page_turn,
    paper_colour,
    random_word,
    sensor_noise,
    system_fonts,
)
from scale_ocr.errors import say
from scale_ocr.vocab import VOCABS

DEFAULT_CHARSET = VOCABS["latin"]


def _layout(rng: np.random.Generator, size: tuple[int, int], charset: str, unit: float,
            fonts: tuple[str, ...] = ()) -> list[tuple]:
    """Words placed on the unrotated page: ``(origin, word, font, colour, tight box)`` each; font sizes are
    :data:`TEXT_HEIGHT` times ``unit``; faces from ``fonts`` (none: the classic ones, or Pillow's own)."""
    h, w = size
    fonts = fonts or system_fonts() or (None,)
    left, right = rng.uniform(0.03, 0.15, 2) * w
    top, bottom = rng.uniform(0.03, 0.15, 2) * h
    ncols = 2 if rng.random() < 0.35 else 1
    gutter = rng.uniform(0.03, 0.08) * w
    col_w = (w - left - right - gutter * (ncols - 1)) / ncols
    placed = []
    for col in range(ncols):
        x_start, y = left + col * (col_w + gutter), top
        # Some columns stop early, leaving a blank area a detector must keep empty.
        y_end = h - bottom if rng.random() < 0.8 else rng.uniform(top + 0.3 * (h - bottom - top), h - bottom)
        while y < y_end:
            font = _font(fonts[int(rng.integers(len(fonts)))],
                         max(6, round(int(rng.integers(TEXT_HEIGHT[0], TEXT_HEIGHT[1] + 1)) * unit)))
            ascent, descent = font.getmetrics()
            line_h = (ascent + descent) * rng.uniform(1.1, 1.8)
            colour = ink_colour(rng)
            n_lines = int(rng.integers(1, 7))
            for line in range(n_lines):
                if y + ascent + descent > y_end:
                    break
                x = x_start + (rng.uniform(0, 0.1) * col_w if line == 0 else 0)  # paragraph indent
                limit = x_start + col_w * (rng.uniform(0.3, 1.0) if line == n_lines - 1 else 1.0)
                first = True
                while True:
                    word = random_word(rng, charset, 1, 10)
                    x0, t, r, b = font.getbbox(word)
                    if x + r > (x_start + col_w if first else limit):  # a short last line still gets a word
                        break
                    first = False
                    if r > x0 and b > t:  # skip words with no ink
                        placed.append(((x, y), word, font, colour, _box(x + x0, y + t, x + r, y + b)))
                    x += font.getlength(word) + font.getlength(" ") * rng.uniform(1.0, 2.0)
                y += line_h
            y += line_h * rng.uniform(0.3, 2.0)  # paragraph gap
    return placed


def render_page(seed: int, index: int, size: tuple[int, int] = (512, 512), charset: str = DEFAULT_CHARSET,
                text_scale: float | None = None, fonts: tuple[str, ...] = ()) -> tuple[Image.Image, np.ndarray,
                                                                                       list[str]]:
    """Page ``index`` of the stream ``seed``, ``size`` (H, W): the RGB page, its word polygons as float32
    ``(N, 4, 2)`` absolute pixels (clockwise from the word's top-left), and the N words.

    ``text_scale``: font sizes are ``TEXT_HEIGHT`` times this; None: the page's shorter side / 512, so a page of any
    size holds the same layout (with 1, a large page holds words of the trained size, as a scan at its resolution).
    ``fonts``: the font files words are set in (:mod:`scale_ocr.data.fonts`); none: the classic faces.
    """
    rng = np.random.default_rng([seed, index])
    charset = "".join(c for c in charset if not c.isspace())
    h, w = size
    bg = paper_colour(rng)
    angle = page_turn(rng)
    placed = _layout(rng, size, charset, text_scale or min(h, w) / 512, fonts)
    img = Image.new("RGB", (w, h), bg)
    if not placed:
        return img, np.zeros((0, 4, 2), np.float32), []
    turned = rotate_points(np.float32([p[4] for p in placed]), angle, (w, h), (w, h))
    # The page turns in place, so words whose turned box would leave it are never drawn: no cut word
    # is ever left unlabelled.
    inside = ((turned >= 0) & (turned <= (w, h))).all(axis=(1, 2))
    draw = ImageDraw.Draw(img)
    for (origin, word, font, colour, _), keep in zip(placed, inside, strict=True):
        if keep:
            draw.text(origin, word, font=font, fill=colour)
    img = img.rotate(angle, resample=Image.BILINEAR, fillcolor=bg)  # in place, as rotate_points assumes
    img = sensor_noise(img, rng)
    return img, turned[inside].reshape(-1, 4, 2), [p[1] for p, k in zip(placed, inside, strict=True) if k]


class SyntheticPages(Dataset):
    """``num_samples`` rendered pages; page ``i`` depends only on ``(seed, i)``; ``transform(img, polygons, words)``
    as :func:`~scale_ocr.data.det_transforms.build_det_transform` makes it, None returns the PIL page."""

    def __init__(self, num_samples: int, seed: int, size: tuple[int, int] = (512, 512),
                 charset: str = DEFAULT_CHARSET, transform=None, fonts: tuple[str, ...] = ()) -> None:
        self.num_samples, self.seed, self.size, self.charset = num_samples, seed, tuple(size), charset
        self.transform = transform
        self.fonts = tuple(fonts)  # font files (scale_ocr.data.fonts); empty: the classic faces

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        """``(image, polygons float32 (N, 4, 2) in the image's pixels, words)``."""
        img, polygons, words = render_page(self.seed, index, self.size, self.charset, fonts=self.fonts)
        return self.transform(img, polygons, words) if self.transform else (img, polygons, words)


def write_detection_folder(path: str | Path, num_pages: int, seed: int, size: tuple[int, int] = (512, 512),
                           charset: str = DEFAULT_CHARSET, text_scale: float | None = None,
                           fonts: tuple[str, ...] = ()) -> Path:
    """Write pages ``0..num_pages-1`` of the stream ``seed`` as a docTR detection folder (with ``img_dimensions``,
    ``img_hash`` and ``words``), set in ``fonts`` (font files; none: the classic faces); returns the folder."""
    root = Path(path)
    (root / "images").mkdir(parents=True, exist_ok=True)
    labels = {}
    for i in range(num_pages):
        img, polygons, words = render_page(seed, i, size, charset, text_scale, fonts)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        name = f"page_{i:05d}.png"
        (root / "images" / name).write_bytes(buf.getvalue())
        labels[name] = {"img_dimensions": [img.height, img.width],
                        "img_hash": hashlib.sha256(buf.getvalue()).hexdigest(),
                        "polygons": np.round(polygons.astype(np.float64), 2).tolist(), "words": words}
    (root / "labels.json").write_text(json.dumps(labels), encoding="utf-8")
    return root


def _size(text: str) -> tuple[int, int] | None:
    """``HxW`` or one number (a square) as ``(H, W)``; None when it is neither."""
    parts = text.lower().split("x")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[-1])


def main(argv: list[str] | None = None) -> int:
    """``python -m scale_ocr.data.synthetic_pages OUT``: a docTR detection folder of held-out synthetic pages
    (with their words, for ``scale-ocr evaluate-pages``)."""
    import argparse

    from scale_ocr.errors import UserError

    p = argparse.ArgumentParser(prog="python -m "
                                     "scale_ocr.data.synthetic_pages", description=main.__doc__.split("``:")[1]
                                .strip())
    p.add_argument("out", type=Path, help="a new folder (images/, labels.json)")
    p.add_argument("--pages", type=int, default=10)
    p.add_argument("--seed", type=int, default=4242, help="the page stream (training uses the run's --seed, "
                   "validation that plus 1000003; the default is neither)")
    p.add_argument("--size", default="512", metavar="HxW", help="page height x width in pixels, or one number for a "
                   "square, e.g. 1650x1275 (an A4 page at 150 dpi)")
    p.add_argument("--text-scale", type=float, default=None, help="font sizes times this (1: 12-40 px words, as "
                   "synthetic training pages of 512 px); default: the page's shorter side / 512")
    p.add_argument("--fonts", nargs="+", default=list(DEFAULT_FONTS), metavar="FONT",
                   help="the fonts words are set in, as train's --fonts (default: installed)")
    args = p.parse_args(argv)
    size = _size(args.size)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise UserError(f"{args.out} already exists and is not an empty folder; choose a new one")
    if args.pages < 1 or size is None or min(size) < 64 or max(size) > 8192:
        raise UserError(f"--pages {args.pages} --size {args.size}: give at least 1 page and a size HxW (or one "
                        "number) from 64 to 8192 pixels a side, e.g. 1650x1275")
    if args.text_scale is not None and not 0.25 <= args.text_scale <= 8:
        raise UserError(f"--text-scale {args.text_scale}: give a factor from 0.25 to 8 (1: 12-40 px words)")
    fonts = select(args.fonts, DEFAULT_CHARSET)
    say(fonts.line())
    say(write_detection_folder(args.out, args.pages, args.seed, size, text_scale=args.text_scale, fonts=fonts.paths))
    return 0


if __name__ == "__main__":
    from scale_ocr.errors import report_user_errors

    raise SystemExit(report_user_errors(main)())
