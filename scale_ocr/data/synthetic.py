"""Synthetic word images rendered with Pillow, deterministic per (seed, index).

Every rank builds the same dataset from the seed, so a distributed sampler can split it without any
file on disk. Fonts are the system's DejaVu faces, falling back to Pillow's bundled font.
"""

from __future__ import annotations

import functools
import glob
import string

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from torch.utils.data import Dataset

FONT_GLOBS = (
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf",
    "/usr/share/fonts/**/DejaVuSans.ttf",
    "/usr/share/fonts/**/DejaVuSerif.ttf",
)


@functools.lru_cache(maxsize=1)
def system_fonts() -> tuple[str, ...]:
    """Paths of the DejaVu fonts found on this system (empty: use Pillow's bundled font)."""
    found: list[str] = []
    for pattern in FONT_GLOBS:
        for path in sorted(glob.glob(pattern, recursive=True)):
            if path not in found:
                found.append(path)
    return tuple(found)


@functools.lru_cache(maxsize=64)
def _font(path: str | None, size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    if path is None:
        return ImageFont.load_default(size=size)
    return ImageFont.truetype(path, size=size)


def random_word(rng: np.random.Generator, charset: str, min_chars: int, max_chars: int) -> str:
    """A word of the charset in one of the shapes text takes on a page.

    Mostly lower-case, capitalised or upper-case letter runs, some numbers, and some words with
    arbitrary characters, so every character of the vocabulary is seen.
    """
    n = int(rng.integers(min_chars, max_chars + 1))
    lower = [c for c in string.ascii_lowercase if c in charset]
    upper = [c for c in string.ascii_uppercase if c in charset]
    digits = [c for c in string.digits if c in charset]
    style = rng.random()
    if style < 0.35 and lower:
        chars = list(rng.choice(lower, n))
    elif style < 0.5 and lower and upper:
        chars = [str(rng.choice(upper))] + list(rng.choice(lower, n - 1))
    elif style < 0.6 and upper:
        chars = list(rng.choice(upper, n))
    elif style < 0.7 and digits:
        chars = list(rng.choice(digits, n))
    else:
        chars = list(rng.choice(list(charset), n))
    return "".join(chars)


def render_word(word: str, rng: np.random.Generator, fonts: tuple[str, ...], height: int = 32) -> Image.Image:
    """Render ``word`` dark-on-light or light-on-dark with a random font, size and margins."""
    font_path = str(rng.choice(fonts)) if fonts else None
    size = int(rng.integers(int(height * 0.7), int(height * 1.1) + 1))
    font = _font(font_path, size)
    # The crop spans the font's whole line (ascent + descent), not just the ink: "xo" and "XO" then
    # differ in glyph height as they do on a page, instead of both filling the crop.
    left, _, right, _ = font.getbbox(word)
    ascent, descent = font.getmetrics()
    mx, my = int(rng.integers(1, 8)), int(rng.integers(0, 4))
    w, h = max(1, right - left) + 2 * mx, ascent + descent + 2 * my
    bg = int(rng.integers(170, 256))
    fg = int(rng.integers(0, max(1, bg - 110)))
    tint = rng.integers(-20, 21, size=3)
    bg_rgb = tuple(int(np.clip(bg + t, 0, 255)) for t in tint)
    fg_rgb = tuple(int(np.clip(fg + t, 0, 255)) for t in tint)
    img = Image.new("RGB", (w, h), bg_rgb)
    ImageDraw.Draw(img).text((mx - left, my), word, font=font, fill=fg_rgb)
    return img


class SyntheticWords(Dataset):
    """``num_samples`` rendered words; sample ``i`` depends only on ``(seed, i)``.

    Args:
        charset: characters to draw words from.
        num_samples: dataset length.
        min_chars: shortest word.
        max_chars: longest word.
        seed: base seed; training and validation sets use different seeds.
        transform: applied to the PIL image (resize, augment, to tensor).
    """

    def __init__(self, charset: str, num_samples: int, min_chars: int, max_chars: int, seed: int,
                 transform=None) -> None:
        self.charset = charset
        self.num_samples = num_samples
        self.min_chars, self.max_chars = min_chars, max_chars
        self.seed = seed
        self.transform = transform
        self.fonts = system_fonts()

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int) -> tuple[Image.Image, str]:
        """The raw image and its word."""
        rng = np.random.default_rng([self.seed, index])
        word = random_word(rng, self.charset, self.min_chars, self.max_chars)
        return render_word(word, rng, self.fonts), word

    def label(self, index: int) -> str:
        """The word of sample ``index`` (without rendering it)."""
        rng = np.random.default_rng([self.seed, index])
        return random_word(rng, self.charset, self.min_chars, self.max_chars)

    def __getitem__(self, index: int):
        img, word = self.sample(index)
        return (self.transform(img) if self.transform else img), word
