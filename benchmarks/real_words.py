"""A small "real-looking" word-crop set for the convergence benchmark, unlike anything scale_ocr trains on.

    python -m benchmarks.real_words OUT_DIR --train 4096 --val 512     # OUT_DIR/train, OUT_DIR/val (docTR folders)

Scale_ocr's synthetic words use four upright DejaVu faces on flat backgrounds with Gaussian noise. These
crops are what a scanned or photographed document gives a recognizer instead, and share none of it: the
other DejaVu faces (oblique, condensed, extra-light, serif bold and italic, mono bold), words that look like
text (pseudo-words, names, numbers, dates, prices, punctuation), uneven letter spacing and baseline,
paper with shading and stains, faded ink, fragments of the lines above and below, and capture damage
(low resolution, defocus, JPEG artefacts, dust). Each crop depends only on ``(seed, index)``.
"""

from __future__ import annotations

import argparse
import io
import json
import string
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

FONT_DIR = Path("/usr/share/fonts/truetype/dejavu")
FACES = ("DejaVuSans-Oblique", "DejaVuSans-BoldOblique", "DejaVuSans-ExtraLight", "DejaVuSansCondensed",
         "DejaVuSansCondensed-Bold", "DejaVuSansCondensed-Oblique", "DejaVuSerif-Bold", "DejaVuSerif-Italic",
         "DejaVuSerif-BoldItalic", "DejaVuSerifCondensed", "DejaVuSerifCondensed-Italic", "DejaVuSansMono-Bold",
         "DejaVuSansMono-Oblique")
ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "ch", "cl", "dr",
          "fr", "gr", "pl", "pr", "sh", "st", "str", "th", "tr", "")
VOWELS = ("a", "e", "i", "o", "u", "ea", "ou", "io", "ai", "y")
CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "nt", "st", "rs", "ck", "ng", "x")


def fonts() -> list[str]:
    """The faces this set uses: DejaVu files scale_ocr's synthetic words never draw with."""
    from scale_ocr.data.synthetic import system_fonts

    used = {Path(p).name for p in system_fonts()}
    found = [str(FONT_DIR / f"{face}.ttf") for face in FACES if (FONT_DIR / f"{face}.ttf").is_file()]
    return [p for p in found if Path(p).name not in used]


def pseudo_word(rng: np.random.Generator) -> str:
    syllables = int(rng.choice([1, 2, 3], p=[0.4, 0.45, 0.15]))
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))


def text(rng: np.random.Generator) -> str:
    """Something that looks like a token of a document, 1 to 12 characters."""
    kind = rng.random()
    if kind < 0.45:
        word = pseudo_word(rng)
    elif kind < 0.6:
        word = pseudo_word(rng).capitalize()
    elif kind < 0.65:
        word = pseudo_word(rng).upper()[:5]
    elif kind < 0.72:
        word = f"{rng.integers(0, 100000):,}" if rng.random() < 0.5 else str(rng.integers(0, 1000))
    elif kind < 0.77:
        word = f"{rng.integers(0, 1000)}.{rng.integers(0, 100):02d}" + ("$" if rng.random() < 0.3 else "")
    elif kind < 0.81:
        word = f"{rng.integers(1, 29):02d}/{rng.integers(1, 13):02d}/{rng.integers(1990, 2030)}"
    elif kind < 0.84:
        word = f"{rng.integers(0, 24):02d}:{rng.integers(0, 60):02d}"
    elif kind < 0.88:
        word = "".join(rng.choice(list(string.ascii_uppercase + string.digits), rng.integers(3, 8)))
    else:
        word = pseudo_word(rng) + str(rng.choice(list(",.;:!?)")))
        if rng.random() < 0.3:
            word = str(rng.choice(list("(\"'"))) + word
    return word[:12] or "a"


def _paper(w: int, h: int, rng: np.random.Generator) -> np.ndarray:
    """Paper: a tint, a shading gradient and soft stains, as float RGB."""
    base = rng.uniform(175, 250) + rng.uniform(-18, 18, 3)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    shade = (np.cos(angle) * xx / max(w, 1) + np.sin(angle) * yy / max(h, 1)) * rng.uniform(-45, 45)
    stains = np.asarray(Image.fromarray((rng.random((4, 6)) * 255).astype(np.uint8)).resize((w, h), Image.BICUBIC),
                        dtype=np.float32) / 255 - 0.5
    paper = base[None, None, :] + (shade + stains * rng.uniform(0, 30))[..., None]
    return paper.clip(0, 255)


def render(word: str, rng: np.random.Generator, faces: list[str]) -> Image.Image:
    """One crop of ``word``."""
    font = ImageFont.truetype(str(rng.choice(faces)), int(rng.integers(18, 45)))
    ascent, descent = font.getmetrics()
    line = ascent + descent
    spacing = rng.uniform(-0.06, 0.2) * line / 2  # tracking between glyphs, px
    widths = [font.getlength(c) for c in word]
    ink_w = int(sum(widths) + spacing * (len(word) - 1)) + 2
    mx, my = int(rng.integers(0, line // 2 + 1)), int(rng.integers(0, line // 3 + 1))
    w, h = max(8, ink_w + 2 * mx), line + 2 * my
    mask = Image.new("L", (w, h), 0)
    draw = ImageDraw.Draw(mask)
    x, wobble = float(mx), rng.uniform(0, 0.06) * line
    for c, cw in zip(word, widths, strict=True):
        draw.text((x, my + rng.normal(0, wobble)), c, font=font, fill=255)
        x += cw + spacing
    for dy in (-1, 1):  # the line above or below, cut by the crop
        if rng.random() < 0.25:
            other = " ".join(pseudo_word(rng) for _ in range(4))
            draw.text((rng.uniform(-w / 2, 0), my + dy * line * rng.uniform(0.85, 1.05)), other, font=font, fill=255)
    mask = mask.rotate(float(rng.normal(0, 1.5)), resample=Image.BILINEAR, fillcolor=0)
    if rng.random() < 0.3:  # ink spreading into the paper
        mask = mask.filter(ImageFilter.MaxFilter(3))
    alpha = np.asarray(mask, dtype=np.float32)[..., None] / 255 * rng.uniform(0.55, 1.0)  # faded ink
    ink = rng.uniform(0, 70) + np.array([0, 0, rng.uniform(0, 60)]) * (rng.random() < 0.3)  # black, grey or blue
    img = _paper(w, h, rng) * (1 - alpha) + ink[None, None, :] * alpha
    if rng.random() < 0.4:  # dust and specks
        specks = rng.random((h, w)) < rng.uniform(0.001, 0.01)
        img[specks] = rng.uniform(0, 90)
    img = Image.fromarray(img.clip(0, 255).astype(np.uint8))
    if rng.random() < 0.5:  # captured at low resolution
        f = rng.uniform(0.35, 0.8)
        img = img.resize((max(4, int(w * f)), max(4, int(h * f))), Image.BILINEAR).resize((w, h), Image.BILINEAR)
    if rng.random() < 0.4:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.2)))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=int(rng.integers(25, 90)))
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def write(folder: Path, n: int, seed: int) -> Path:
    """``n`` crops as a docTR recognition folder (images/, labels.json); written once, then reused."""
    if (folder / "labels.json").is_file():
        return folder
    faces = fonts()
    if not faces:
        raise SystemExit(f"real_words: none of the DejaVu faces it draws with are in {FONT_DIR} "
                         "(apt-get install fonts-dejavu-extra)")
    tmp = folder.with_name(folder.name + ".tmp")
    (tmp / "images").mkdir(parents=True, exist_ok=True)
    labels = {}
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        word = text(rng)
        name = f"{i:06d}.jpg"
        render(word, rng, faces).save(tmp / "images" / name, quality=95)
        labels[name] = word
    (tmp / "labels.json").write_text(json.dumps(labels, ensure_ascii=False), encoding="utf-8")
    tmp.replace(folder)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--train", type=int, default=4096)
    p.add_argument("--val", type=int, default=512)
    p.add_argument("--seed", type=int, default=2026)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    write(a.out / "train", a.train, a.seed)
    write(a.out / "val", a.val, a.seed + 1)
    print(f"real_words: {a.train} training and {a.val} validation crops in {a.out}")


if __name__ == "__main__":
    main()
