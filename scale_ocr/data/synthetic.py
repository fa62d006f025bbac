"""Synthetic word images rendered with Pillow, deterministic per (seed, index), so every rank builds the same dataset.

Two styles (docs/data.md, "Synthetic data"): ``line`` crops span the font's whole line, as in word-crop datasets;
``page`` crops are words as page OCR hands them to a recognizer, so a recognizer meant for page OCR trains on what
it will read.
"""

from __future__ import annotations

import functools
import glob
import math
import string
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from torch.utils.data import Dataset

from scale_ocr.errors import UserError

if TYPE_CHECKING:
    from scale_ocr.data.fonts import FontSet

FONT_GLOBS = (
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSerif.ttf",
    "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf",
    "/usr/share/fonts/**/DejaVuSans.ttf",
    "/usr/share/fonts/**/DejaVuSerif.ttf",
)
TEXT_HEIGHT = (12, 40)  # font size range in pixels on a 512-pixel page (synthetic pages scale it with the page)
MAX_ANGLE = 5.0  # pages turn by up to this many degrees
# How far a trained detector's axis-aligned box strays from a word's ink box, per side (left, top, right, bottom;
# outwards positive) in word heights, as db_mobilenet_v3_large's boxes did on synthetic pages. Page-style words are
# cut along a box drawn from this (spread clipped at 2 sigma).
BOX_ERROR_MEAN = np.array([0.0, 0.0, 0.12, 0.1])
BOX_ERROR_STD = np.array([0.12, 0.07, 0.15, 0.1])


@functools.lru_cache(maxsize=1)
def system_fonts() -> tuple[str, ...]:
    """Paths of the DejaVu fonts found on this system (empty: use Pillow's bundled font)."""
    found: list[str] = []
    for pattern in FONT_GLOBS:
        for path in sorted(glob.glob(pattern, recursive=True)):
            if path not in found:
                found.append(path)
    return tuple(found)


# Faces x sizes, most recent: a face loads in 0.04 ms (FreeType maps its file and holds no descriptor), while each
# held one costs about 150 KB, so a few hundred faces at every size are loaded again rather than all kept.
@functools.lru_cache(maxsize=256)
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
    else:  # the space parts words (random_text); inside one it would be an invisible edge or a double space
        chars = list(rng.choice([c for c in charset if c != " "], n))
    return "".join(chars)


TEXT_WORD = (1, 12)  # characters of a word of a synthetic text line


def random_text(rng: np.random.Generator, charset: str, min_chars: int, max_chars: int) -> str:
    """Words of :func:`random_word`'s shapes parted by single spaces, ``min_chars`` to ``max_chars`` characters in
    all: a line of text, for recognizers that read lines at their own width."""
    n = int(rng.integers(min_chars, max_chars + 1))
    words: list[str] = []
    length = -1  # of the words joined so far; -1: none yet, so the first takes no space before it
    while length < n:
        left = n - length - 1  # characters after the space before the next word
        if left < 1:  # room for the space alone: the last word takes the character
            words[-1] += random_word(rng, charset, 1, 1)
            break
        words.append(random_word(rng, charset, TEXT_WORD[0], min(TEXT_WORD[1], left)))
        length += len(words[-1]) + 1
    return " ".join(words)


def render_word(word: str, rng: np.random.Generator, fonts: tuple[str, ...], height: int = 32,
                spacing: tuple[float, float] = (0.0, 0.0)) -> Image.Image:
    """Render ``word`` dark-on-light or light-on-dark with a random font, size, letter spacing (ems drawn from
    ``spacing``; ``(0, 0)``: set as the font sets it, and no draw for it) and margins."""
    font_path = str(rng.choice(fonts)) if fonts else None
    size = int(rng.integers(int(height * 0.7), int(height * 1.1) + 1))
    font = _font(font_path, size)
    tracking = float(rng.uniform(*spacing)) * size if spacing != (0.0, 0.0) else 0.0
    # The crop spans the font's whole line (ascent + descent), not just the ink: "xo" and "XO" then
    # differ in glyph height as they do on a page, instead of both filling the crop.
    (left, _, right, _), xs = tracked(font, word, tracking)
    ascent, descent = font.getmetrics()
    mx, my = int(rng.integers(1, 8)), int(rng.integers(0, 4))
    w, h = max(1, right - left) + 2 * mx, ascent + descent + 2 * my
    bg = int(rng.integers(170, 256))
    fg = int(rng.integers(0, max(1, bg - 110)))
    tint = rng.integers(-20, 21, size=3)
    bg_rgb = tuple(int(np.clip(bg + t, 0, 255)) for t in tint)
    fg_rgb = tuple(int(np.clip(fg + t, 0, 255)) for t in tint)
    img = Image.new("RGB", (w, h), bg_rgb)
    draw_tracked(ImageDraw.Draw(img), (mx - left, my), word, font, fg_rgb, xs)
    return img


def tracked(font, word: str, tracking: float) -> tuple[tuple[int, int, int, int], list[float] | None]:
    """``font.getbbox(word)`` with ``tracking`` pixels added after every character (whole pixels, outwards), and
    where each character then starts: its font's advance, kerning included, plus the tracking (None: no tracking)."""
    if not tracking:
        return font.getbbox(word), None
    xs = [font.getlength(word[:i]) + i * tracking for i in range(len(word))]
    boxes = [(x + b[0], b[1], x + b[2], b[3]) for x, b in zip(xs, map(font.getbbox, word), strict=True)]
    return (math.floor(min(b[0] for b in boxes)), min(b[1] for b in boxes), math.ceil(max(b[2] for b in boxes)),
            max(b[3] for b in boxes)), xs


def draw_tracked(draw: ImageDraw.ImageDraw, xy: tuple[float, float], word: str, font, fill,
                 xs: list[float] | None) -> None:
    """``draw.text``, each character at ``xs`` (:func:`tracked`; None: one call, as Pillow sets the word)."""
    if xs is None:
        draw.text(xy, word, font=font, fill=fill)
        return
    for x, char in zip(xs, word, strict=True):
        draw.text((xy[0] + x, xy[1]), char, font=font, fill=fill)


def _box(x0: float, y0: float, x1: float, y1: float) -> list[list[float]]:
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1]]  # clockwise on screen from top-left, as docTR


def paper_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    """A light, slightly tinted page."""
    paper = int(rng.integers(200, 256))
    return tuple(int(v) for v in np.clip(paper + rng.integers(-15, 16, 3), 0, 255))


def ink_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    """Dark, slightly tinted print."""
    return tuple(int(c) for c in np.clip(rng.integers(0, 90) + rng.integers(-10, 11, 3), 0, 255))


def sensor_noise(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    """Grey Gaussian noise of a random strength (sigma up to 8 levels)."""
    noisy = np.asarray(img, dtype=np.float32)
    noisy = noisy + rng.normal(0, rng.uniform(0, 8), (*noisy.shape[:2], 1)).astype(np.float32)
    return Image.fromarray(noisy.clip(0, 255).astype(np.uint8))


def page_turn(rng: np.random.Generator) -> float:
    """Degrees a page is turned by: most pages a little (up to ``MAX_ANGLE``), some not at all."""
    return float(rng.uniform(-MAX_ANGLE, MAX_ANGLE)) if rng.random() < 0.7 else 0.0


def render_page_word(word: str, rng: np.random.Generator, fonts: tuple[str, ...],
                     spacing: tuple[float, float] = (0.0, 0.0)) -> Image.Image:
    """``word`` as page OCR cuts it from a synthetic page: the page's sizes, paper and ink, turned with
    the page by up to ``MAX_ANGLE`` degrees, with its noise, cut along an upright box that strays from the
    ink box as a trained detector's does (``BOX_ERROR_*``), plus page OCR's padding."""
    from scale_ocr.boxes.crop import crop_words
    from scale_ocr.data.det_transforms import rotate_page

    path = str(rng.choice(fonts)) if fonts else None  # drawn before the size, as every record's words were
    size = int(rng.integers(TEXT_HEIGHT[0], TEXT_HEIGHT[1] + 1))
    font = _font(path, size)
    paper, ink = paper_colour(rng), ink_colour(rng)
    tracking = float(rng.uniform(*spacing)) * size if spacing != (0.0, 0.0) else 0.0
    (left, top, right, bottom), xs = tracked(font, word, tracking)
    margin = max(8, 2 * (bottom - top))  # room for the turn and the box's error
    img = Image.new("RGB", (right - left + 2 * margin, bottom - top + 2 * margin), paper)
    draw_tracked(ImageDraw.Draw(img), (margin - left, margin - top), word, font, ink, xs)
    ink_box = np.float32([_box(margin, margin, margin + right - left, margin + bottom - top)])
    img, turned = rotate_page(img, ink_box, page_turn(rng), paper, expand=False)
    img = sensor_noise(img, rng)
    (x0, y0), (x1, y1) = turned[0].min(axis=0), turned[0].max(axis=0)
    error = (BOX_ERROR_MEAN + BOX_ERROR_STD * rng.standard_normal(4).clip(-2, 2)) * max(1, bottom - top)
    left, top = x0 - error[0], y0 - error[1]
    box = _box(left, top, max(x1 + error[2], left + 1), max(y1 + error[3], top + 1))
    (crop,) = crop_words(img, [box])
    return crop


WORD_STYLES = {"line": render_word, "page": render_page_word, "text": render_word}
TEXTS = {"line": random_word, "page": random_word, "text": random_text}  # what each style draws
# Rendered words a dataset keeps (per process, as uint8 tensors: 12 KiB at 32x128, so about 21,000 words) when
# its transform's first stage is deterministic, so later epochs and evaluations do not render them again.
KEEP_BYTES = 256 * 2**20


class SyntheticWords(Dataset):
    """``num_samples`` rendered words of ``charset`` in ``style`` (``line`` or ``page``); sample ``i`` depends only
    on ``(seed, i)``.

    Rendering is most of a word's loading time. With a :class:`~scale_ocr.data.transforms.WordTransform`
    whose first stage is deterministic (no augmentation before resizing: recognition's default), that
    stage's uint8 result is kept, up to ``KEEP_BYTES``, and later reads of the sample only finish the
    transform: the same tensor, bit for bit, without drawing the word again.
    """

    def __init__(self, charset: str, num_samples: int, min_chars: int, max_chars: int, seed: int,
                 transform=None, style: str = "line", fonts: FontSet | None = None) -> None:
        self.charset = charset
        self.num_samples = num_samples
        self.min_chars, self.max_chars = min_chars, max_chars
        self.seed = seed
        self.transform = transform
        # the faces and letter spacing words are drawn in (scale_ocr.data.fonts); None: `classic`, as the records
        self.fonts, self.spacing = (fonts.paths, fonts.spacing) if fonts else (system_fonts(), (0.0, 0.0))
        self.render, self.text = WORD_STYLES[style], TEXTS[style]
        if style == "text" and " " not in charset:
            raise UserError("--synthetic-words text parts words with spaces, which the vocabulary lacks; read crops "
                            "at their own width (--max-width adds the space) or give a vocabulary with it")
        self.kept: dict[int, tuple] = {}
        self.kept_bytes = 0

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int) -> tuple[Image.Image, str]:
        """The raw image and its word."""
        rng = np.random.default_rng([self.seed, index])
        word = self.text(rng, self.charset, self.min_chars, self.max_chars)
        return self.render(word, rng, self.fonts, spacing=self.spacing), word

    def label(self, index: int) -> str:
        """The word of sample ``index`` (without rendering it)."""
        rng = np.random.default_rng([self.seed, index])
        return self.text(rng, self.charset, self.min_chars, self.max_chars)

    def __getitem__(self, index: int):
        kept = self.kept.get(index)
        if kept is not None:
            return self.transform.tensor(kept[0]), kept[1]
        img, word = self.sample(index)
        if not getattr(self.transform, "deterministic", False):
            return (self.transform(img) if self.transform else img), word
        fixed = self.transform.pil(img)
        if self.kept_bytes + fixed.nbytes <= KEEP_BYTES:
            self.kept[index] = (fixed, word)
            self.kept_bytes += fixed.nbytes
        return self.transform.tensor(fixed), word
