"""Property-based fuzzing of image files, through the one decode path of every task (docs/faults.md, "Fuzzing").

Small valid PNG, JPEG (with an EXIF orientation), TIFF, GIF, BMP and WebP files, in the modes users have (RGB,
grey, palette, RGBA, 16-bit, float), are damaged: header bytes overwritten, the file cut short, bytes flipped
anywhere, junk appended, or the declared width and height set to anything up to 2**32 - 1 (decompression bombs,
zero sizes). Each is decoded by :func:`scale_ocr.data.files.open_rgb`, the decode of ``predict`` and page OCR
over :func:`~scale_ocr.data.files.load_image`, which the training start-up scan and the loaders call too. It ends in
upright 8-bit RGB within the limits or in one UserError line (:mod:`test_fuzz_oracle`).
"""

from __future__ import annotations

import io
import struct
import tempfile
import warnings
import zlib
from pathlib import Path

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st
from PIL import Image
from test_fuzz_oracle import outcome

from scale_ocr.data.files import PAGE_LIMITS, WORD_LIMITS, open_rgb


def _save(mode: str, fmt: str, **kw) -> bytes:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8), "RGB")
    im = {"RGB": rgb, "L": rgb.convert("L"), "P": rgb.convert("P"), "RGBA": rgb.convert("RGBA"),
          "I;16": Image.fromarray(rng.integers(0, 65536, (12, 16), dtype=np.uint16)),
          "F": Image.fromarray(rng.random((12, 16), dtype=np.float32))}[mode]
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _exif_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: a quarter turn
    return _save("RGB", "JPEG", exif=exif.tobytes())


FILES = {
    "png-rgb": _save("RGB", "PNG"), "png-p": _save("P", "PNG"), "png-rgba": _save("RGBA", "PNG"),
    "png-16": _save("I;16", "PNG"), "jpeg-exif": _exif_jpeg(), "jpeg-l": _save("L", "JPEG"),
    "tiff-rgb": _save("RGB", "TIFF"), "tiff-f": _save("F", "TIFF"),
    "tiff-lzw": _save("RGB", "TIFF", compression="tiff_lzw"),
    "gif": _save("P", "GIF"), "bmp": _save("RGB", "BMP"), "bmp-p": _save("P", "BMP"), "webp": _save("RGB", "WEBP"),
}


def _signalling_nan_tiff() -> bytes:
    """A float TIFF whose first pixel is a signalling NaN, as damaged float pixels may be."""
    pixels = np.full((4, 4), 0.5, np.float32)
    pixels.view(np.uint32)[0, 0] = 0x7FA00000
    buf = io.BytesIO()
    Image.fromarray(pixels, "F").save(buf, format="TIFF")
    return buf.getvalue()


def _flipped(name: str, at: int, bits: int) -> tuple[str, bytes]:
    data = bytearray(FILES[name])
    data[at] ^= bits
    return f"{name}:flip", bytes(data)


def _png_size(data: bytes, w: int, h: int) -> bytes:
    """A PNG declaring ``w`` x ``h`` in its IHDR chunk, its CRC made valid so the decoder believes it."""
    ihdr = data[12:16] + struct.pack(">II", w, h) + data[24:29]
    return data[:8] + data[8:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]


def _declared(name: str, data: bytes, w: int, h: int) -> bytes:
    """The file with its header's width and height replaced, where each format keeps them."""
    if name.startswith("png"):
        return _png_size(data, w, h)
    if name.startswith("bmp"):
        return data[:18] + struct.pack("<ii", min(w, 2**31 - 1), min(h, 2**31 - 1)) + data[26:]
    if name == "gif":  # the logical screen, then the first image descriptor
        w16, h16 = min(w, 65535), min(h, 65535)
        out = bytearray(data[:6] + struct.pack("<HH", w16, h16) + data[10:])
        at = out.find(b"\x2c")
        if at > 0:
            out[at + 5:at + 9] = struct.pack("<HH", w16, h16)
        return bytes(out)
    if name.startswith("jpeg"):  # the SOF0 marker holds height, then width
        at = data.find(b"\xff\xc0")
        return data[:at + 5] + struct.pack(">HH", min(h, 65535), min(w, 65535)) + data[at + 9:] if at > 0 else data
    return data


@st.composite
def damaged(draw) -> tuple[str, bytes]:
    name = draw(st.sampled_from(sorted(FILES)))
    data = bytearray(FILES[name])
    how = draw(st.sampled_from(["header", "truncate", "flip", "append", "size"]))
    if how == "header":  # the first 64 bytes: magic numbers, chunk lengths, dimensions, IFD offsets
        at = draw(st.integers(0, min(63, len(data) - 1)))
        patch = draw(st.binary(min_size=1, max_size=8))
        data[at:at + len(patch)] = patch
    elif how == "truncate":
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif how == "flip":
        for at in draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=4)):
            data[at] ^= draw(st.integers(1, 255))
    elif how == "append":
        data += draw(st.binary(min_size=1, max_size=64))
    else:
        side = st.one_of(st.integers(0, 20), st.integers(8000, 70000), st.integers(0, 2**32 - 1))
        data = bytearray(_declared(name, bytes(data), draw(side), draw(side)))
    return f"{name}:{how}", bytes(data)


@given(image=damaged(), page=st.booleans())
@example(image=("png-rgb:size", _png_size(FILES["png-rgb"], 2**31 - 1, 2**31 - 1)), page=True)  # 4.6e18 pixels
@example(image=("png-rgb:size", _png_size(FILES["png-rgb"], 0, 0)), page=False)  # no pixels at all
@example(image=("png-rgb:size", _png_size(FILES["png-rgb"], 8192, 8192)), page=True)  # at the limit, no data
@example(image=("tiff-f:snan", _signalling_nan_tiff()), page=False)  # numpy warned as it cast the pixels
@example(image=_flipped("tiff-f", 72, 1), page=False)  # a rational where a count belongs: TypeError in Pillow
@example(image=_flipped("tiff-f", 8, 128), page=False)  # IFD cut short: Pillow warns and guesses
def test_damaged_image(image, page):
    limits = PAGE_LIMITS if page else WORD_LIMITS
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "img"
        path.write_bytes(image[1])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            img, _ = outcome(open_rgb, str(path), limits)
        # Pillow's warnings (a tag skipped, EXIF cut short) are the file's damage, refused as such, not two stray
        # lines on the terminal above an image decoded from a guess.
        assert not caught, [f"{w.category.__name__}: {w.message}" for w in caught]
        if img is not None:
            w, h = img.size
            assert img.mode == "RGB" and w >= 1 and h >= 1, (img.mode, img.size)
            assert max(w, h) <= limits.max_side and w * h <= limits.max_pixels, img.size
            assert np.asarray(img).shape == (h, w, 3)  # the pixels were decoded, not only the header
