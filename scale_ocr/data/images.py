"""One decode rule for every image a task reads: an opened file as users have it -> upright 8-bit RGB.

Every task decodes through :func:`scale_ocr.data.files.load_image`, which applies :func:`to_rgb` here, so a model
trains, is evaluated and predicts on the same pixels. The rules per kind of image: docs/data.md, "Images as users
have them". 16-bit grey maps its declared range 0..65535 (not its own min..max, which would blow a blank page's
scanner noise up to full contrast).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

WHITE = (255, 255, 255)
ORIENTATION_TAG = 0x0112  # EXIF "Orientation"
# EXIF orientation -> the transpose that makes the stored pixels upright (as ImageOps.exif_transpose does).
UPRIGHT = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
           5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
           8: Image.Transpose.ROTATE_90}
HIGH_BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")
ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


def exif_orientation(im: Image.Image) -> int:
    """The image's EXIF orientation, 1 (as stored) when it has none or an invalid one."""
    value = im.getexif().get(ORIENTATION_TAG, 1)
    return value if isinstance(value, int) and value in UPRIGHT else 1


def quarter_turned(orientation: int) -> bool:
    """Whether an orientation swaps width and height (5-8: the stored pixels lie on their side)."""
    return orientation >= 5


def _to_8bit(im: Image.Image) -> Image.Image:
    """A high-bit-depth grey image as ``L`` (or ``LA`` when a grey value is marked transparent)."""
    raw = np.asarray(im)
    if im.mode.startswith("I;16"):
        grey = (raw.astype(np.uint32) * 2 + 257) // 514  # round(v / 257); 257 is odd, so there is no tie
    else:
        with np.errstate(invalid="ignore"):  # a signalling NaN (damaged float pixels) warns as it is cast
            a = raw.astype(np.float64)
        if not np.isfinite(a).all():
            raise ValueError(f"its {im.mode} pixels include NaN or infinity")
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
        if im.mode == "I" and lo >= 0 and hi <= 65535:
            a = a / 257
        elif im.mode == "F" and lo >= 0 and hi <= 1:
            a = a * 255
        elif not (im.mode == "F" and lo >= 0 and hi <= 255) and hi > lo:
            a = (a - lo) * (255 / (hi - lo))
        grey = np.clip(np.rint(a), 0, 255)
    out = Image.fromarray(grey.astype(np.uint8), "L")
    transparent = im.info.get("transparency")
    if isinstance(transparent, int) and not isinstance(transparent, bool):
        out.putalpha(Image.fromarray(np.where(raw == transparent, 0, 255).astype(np.uint8), "L"))
    return out


def to_rgb(im: Image.Image, background: tuple[int, int, int] = WHITE) -> Image.Image:
    """The opened image (its first frame) as upright 8-bit RGB, transparent pixels composited on ``background``.

    Raises ValueError or OSError as Pillow does for pixels it cannot decode or convert (e.g. a ``LAB`` image), and
    ValueError for a float image with NaN or infinity.
    """
    orientation = exif_orientation(im)
    if im.mode in HIGH_BIT_MODES:
        im = _to_8bit(im)
    if im.mode in ALPHA_MODES or "transparency" in im.info:
        paper = Image.new("RGBA", im.size, (*background, 255))
        im = Image.alpha_composite(paper, im.convert("RGBA"))
    rgb = im.convert("RGB")
    return rgb.transpose(UPRIGHT[orientation]) if orientation in UPRIGHT else rgb
