"""What a PDF page yields: its image at a chosen dpi and the words of its text layer, boxed in that image's pixels.

pypdfium2 (PDFium, Apache-2.0/BSD, installed with docTR) both renders the page and reads its text layer: one engine,
so a word's box is mapped to pixels by the same page-to-device transform PDFium renders with (CropBox, ``/Rotate``,
the bitmap's rounding), without a second parser's idea of the page. Words are PDFium's characters grouped at white
space, line ends and turns, boxed by their tight glyph boxes. What is kept is :mod:`scale_ocr.data.make_dataset`'s.
"""

from __future__ import annotations

import ctypes
import math
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pypdfium2 as pdfium
import pypdfium2.raw as pdfium_c
from PIL import Image

from scale_ocr.disk import GiB, open_user_file
from scale_ocr.errors import UserError, shown

POINTS_PER_INCH = 72.0
MAGNIFY = 1024  # FPDF_PageToDevice returns whole pixels: mapped at 1024x, a corner is exact to 1/1024 px
TURN_TOLERANCE = 2.0  # degrees a baseline may stray from a quarter turn and still count as that turn
HYPHEN = 0x02  # PDFium's code for a hyphen that ends a line: the word ends there
LIGATURES = {"\ufb00": "ff", "\ufb01": "fi", "\ufb02": "fl", "\ufb03": "ffi", "\ufb04": "ffl", "\ufb05": "st",
             "\ufb06": "st"}  # drawn as separate letters to a reader, so labelled as them
INVISIBLE_MODES = (3, 7)  # text render modes that draw nothing (an OCR layer over a scan, clipping text)


@dataclass
class PdfWord:
    """One word of the text layer on the rendered page.

    Attributes:
        text: the word as the text layer spells it (ligatures expanded, a line-end hyphen as ``-``).
        box: ``(x0, y0, x1, y1)`` in the page image's pixels; may reach past the page (text drawn off it).
        turn: clockwise quarter turns (0-3) that make its glyphs upright; None when slanted.
        line_height: pixels across its line from its font's ascent to descent: how large it is set, whatever its
            glyphs (a ``.`` has a flat box on a line of ordinary height).
    """

    text: str
    box: tuple[float, float, float, float]
    turn: int | None
    invisible: bool
    line_height: float = 0.0


@dataclass
class PdfPage:
    """What one page yields: its RGB image and its words, in the text layer's order."""

    image: Image.Image
    words: list[PdfWord]


def _load_error(path: Path, exc: pdfium.PdfiumError) -> UserError:
    if getattr(exc, "err_code", None) == pdfium_c.FPDF_ERR_PASSWORD:
        return UserError(f"{shown(path)} is encrypted; decrypt it first (e.g. `qpdf --decrypt --password=PW IN OUT`) "
                         "or leave it out")
    return UserError(f"{shown(path)} cannot be read as a PDF ({str(exc).rstrip('.')}); pass only PDF files, or repair "
                     "it (e.g. `qpdf IN OUT`)")


# The most bytes a PDF given to make-dataset may hold: a born-digital book is a few MB to a few hundred; beyond this
# a file is a scan or not what it claims (a device, a disk image), refused before a byte is read.
PDF_LIMIT = 2 * GiB
# What may come before ``%PDF-``: white space and a UTF-8 byte order mark, which some tools write. PDF 32000-1
# (7.5.2) puts the header on the file's first line; readers accept it within 1024 bytes, so an archive holding a
# PDF near its start (a zip of PDFs named .pdf) would pass a search of the first kilobyte, and PDFium would read
# its first member: the file is refused instead.
_LEAD = b" \t\r\n\f\x00\xef\xbb\xbf"
_CONTAINERS = {b"PK\x03\x04": "a zip archive", b"\x1f\x8b": "a gzip file", b"7z\xbc\xaf": "a 7z archive",
               b"Rar!": "a RAR archive", b"BZh": "a bzip2 file", b"\xfd7zXZ": "an xz file"}


def check_header(path: str | Path, head: bytes) -> None:
    """Refuse a file whose first bytes (``head``) are not a PDF header, naming what it is when known."""
    at = head.find(b"%PDF-")
    if at >= 0 and not head[:at].strip(_LEAD):
        return
    kind = next((k for magic, k in _CONTAINERS.items() if head.startswith(magic)), None)
    if kind is None and at > 0:
        kind = f"another kind of file ({at} bytes before its %PDF- header)"
    what = (f"is {kind} holding a PDF" if at > 0 and kind in _CONTAINERS.values() else f"is {kind}" if kind
            else "does not start with a %PDF- header")
    raise UserError(f"{shown(str(path))} is not a PDF: it {what}; pass only PDF files (take a PDF out of an archive "
                    "first)")


def open_file(path: str | Path) -> BinaryIO:
    """The PDF at ``path`` as an open binary file (at its start), once it is known to be a regular file of at most
    :data:`PDF_LIMIT` bytes whose first line is a PDF header; else one line saying why not."""
    f = open_user_file(path, what="the PDF", limit=PDF_LIMIT, follow=True)
    try:
        check_header(path, f.read(1024))
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f


def load(path: str | Path, f: BinaryIO) -> pdfium.PdfDocument:
    """The document in ``f`` (from :func:`open_file`; closed with the document), or one line saying it is damaged
    or encrypted."""
    try:
        return pdfium.PdfDocument(f, autoclose=True)
    except pdfium.PdfiumError as exc:
        f.close()
        raise _load_error(Path(path), exc) from None


def open_pdf(path: str | Path) -> pdfium.PdfDocument:
    """The document at ``path``, or one line saying it is no PDF, damaged or encrypted."""
    return load(path, open_file(path))


def pixel_size(page: pdfium.PdfPage, dpi: float) -> tuple[int, int]:
    """``(width, height)`` of the page rendered at ``dpi``: PDFium's size after ``/Rotate``, rounded up."""
    scale = dpi / POINTS_PER_INCH
    return math.ceil(page.get_width() * scale), math.ceil(page.get_height() * scale)


class _Device:
    """The affine map from page space (points) to the rendered image's pixels, taken from PDFium itself."""

    def __init__(self, page: pdfium.PdfPage, size: tuple[int, int]) -> None:
        def to_device(x: float, y: float) -> np.ndarray:
            dx, dy = ctypes.c_int(), ctypes.c_int()
            if not pdfium_c.FPDF_PageToDevice(page, 0, 0, size[0] * MAGNIFY, size[1] * MAGNIFY, 0, x, y, dx, dy):
                raise pdfium.PdfiumError("FPDF_PageToDevice failed")
            return np.array([dx.value, dy.value], dtype=np.float64) / MAGNIFY

        origin = to_device(0.0, 0.0)
        self.linear = np.stack([(to_device(1000.0, 0.0) - origin) / 1000.0,
                                (to_device(0.0, 1000.0) - origin) / 1000.0], axis=1)  # columns: images of x, y
        self.origin = origin

    def points(self, xy: np.ndarray) -> np.ndarray:
        return xy @ self.linear.T + self.origin

    def box(self, left: float, bottom: float, right: float, top: float) -> tuple[float, float, float, float]:
        """The pixel box covering a page-space box (exact for any quarter-turned page)."""
        pts = self.points(np.array([[left, bottom], [right, bottom], [right, top], [left, top]]))
        (x0, y0), (x1, y1) = pts.min(axis=0), pts.max(axis=0)
        return float(x0), float(y0), float(x1), float(y1)

    def turn(self, a: float, b: float) -> int | None:
        """Clockwise quarter turns making a baseline of page-space direction ``(a, b)`` upright, or None."""
        dx, dy = self.linear @ np.array([a, b])
        if dx == 0 and dy == 0:
            return None
        angle = math.degrees(math.atan2(-dy, dx)) % 360  # counter-clockwise as seen on the image
        turns = round(angle / 90)
        return turns % 4 if abs(angle - 90 * turns) <= TURN_TOLERANCE else None


@dataclass
class _Char:
    text: str
    box: tuple[float, float, float, float] | None  # pixels; None for a glyph without extent (a space)
    turn: int | None
    invisible: bool
    ends_word: bool
    line: tuple[float, float] = (0.0, 0.0)  # its extent across the line (pixels): font ascent to descent, and glyph

    @property
    def line_height(self) -> float:
        return self.line[1] - self.line[0]


_INSIDE = object()  # a zero-width format character (joiner, BOM): no glyph and no boundary


def _char(textpage: pdfium.PdfTextPage, device: _Device, i: int) -> _Char | object | None:
    """Character ``i`` in pixels; None for white space, control codes and PDFium's generated separators (a word
    boundary); :data:`_INSIDE` for a format character, which neither shows nor ends a word."""
    code = pdfium_c.FPDFText_GetUnicode(textpage, i)
    text = "-" if code == HYPHEN else chr(code) if 0 < code < 0x110000 else ""
    if text and unicodedata.category(text) == "Cf":
        return _INSIDE
    if not text or not text.isprintable() or text.isspace() or pdfium_c.FPDFText_IsGenerated(textpage, i) == 1:
        return None
    left, bottom, right, top = textpage.get_charbox(i)
    box = device.box(left, bottom, right, top) if right > left and top > bottom else None
    matrix = pdfium_c.FS_MATRIX()
    turn = device.turn(matrix.a, matrix.b) if pdfium_c.FPDFText_GetMatrix(textpage, i, matrix) else None
    obj = pdfium_c.FPDFText_GetTextObject(textpage, i)
    invisible = bool(obj) and pdfium_c.FPDFTextObj_GetTextRenderMode(obj) in INVISIBLE_MODES
    loose = device.box(*textpage.get_charbox(i, loose=True))
    a, b = (1, 3) if turn in (0, 2, None) else (0, 2)
    # The glyph's own extent too: some fonts (math symbols, Type 3) declare no ascent or descent.
    line = (min(loose[a], box[a]), max(loose[b], box[b])) if box else (loose[a], loose[b])
    return _Char(LIGATURES.get(text, text), box, turn, invisible, code == HYPHEN, line)


def _continues(word: list[_Char], char: _Char) -> bool:
    """Whether ``char`` reads on from ``word`` (same turn, further along the same line); PDFium joins a word
    broken by a line-end hyphen with the next line's, and may omit a space between runs."""
    if char.turn != word[-1].turn or word[-1].ends_word:
        return False
    if char.turn is None:  # slanted: PDFium's own spacing decides
        return True
    prev = next((c.box for c in reversed(word) if c.box is not None), None)
    if prev is None or char.box is None:
        return True
    axis = 0 if char.turn in (0, 2) else 1  # the reading axis on the image
    forward = 1 if char.turn in (0, 3) else -1  # turn 3 (glyphs turned a quarter right, read downward)
    lo, hi = (prev[axis], prev[axis + 2]) if forward > 0 else (-prev[axis + 2], -prev[axis])
    start = char.box[axis] if forward > 0 else -char.box[axis + 2]
    across = 1 - axis
    mid = (char.box[across] + char.box[across + 2]) / 2
    # The word's line, from its fonts' ascent to descent: a flat glyph (".", "-") says nothing of where it lies.
    top, bottom = min(c.line[0] for c in word), max(c.line[1] for c in word)
    on_line = top <= mid <= bottom
    return on_line and start >= lo - 0.5 * (hi - lo) - 1.0


def _word(chars: list[_Char]) -> PdfWord:
    boxes = np.array([c.box for c in chars if c.box is not None]).reshape(-1, 4)
    box = (tuple(float(v) for v in (*boxes[:, :2].min(axis=0), *boxes[:, 2:].max(axis=0)))
           if len(boxes) else (0.0, 0.0, 0.0, 0.0))
    # NFC: an accent the PDF spells as a letter plus a combining mark becomes the one character vocabularies list.
    text = unicodedata.normalize("NFC", "".join(c.text for c in chars))
    return PdfWord(text, box, chars[0].turn, all(c.invisible for c in chars), max(c.line_height for c in chars))


def page_words(page: pdfium.PdfPage, size: tuple[int, int]) -> list[PdfWord]:
    """The words of ``page``'s text layer, boxed in the pixels of the page rendered at ``size``."""
    device = _Device(page, size)
    textpage = page.get_textpage()
    words: list[PdfWord] = []
    current: list[_Char] = []
    for i in range(textpage.count_chars()):
        char = _char(textpage, device, i)
        if char is _INSIDE:
            continue
        if current and (char is None or not _continues(current, char)):
            words.append(_word(current))
            current = []
        if char is not None:
            current.append(char)
    if current:
        words.append(_word(current))
    return words


def render(page: pdfium.PdfPage, size: tuple[int, int], dpi: float) -> Image.Image:
    """The page as RGB at ``dpi``. Annotations and form fields are left out: their text is no part of the text
    layer, so drawing it would put unlabelled words on the page."""
    bitmap = page.render(scale=dpi / POINTS_PER_INCH, draw_annots=False, may_draw_forms=False, rev_byteorder=True)
    image = bitmap.to_pil().convert("RGB")
    if image.size != size:  # pypdfium2 sizes the bitmap as pixel_size does; a change there would shift every box
        raise RuntimeError(f"PDFium rendered {image.size}, expected {size}")
    return image


@contextmanager
def page_errors(path: str | Path, index: int) -> Iterator[None]:
    """PDFium failing on one page (a damaged content stream PDFium cannot repair) as one line naming it."""
    try:
        yield
    except pdfium.PdfiumError as exc:
        raise UserError(f"{shown(str(path))} page {index + 1} cannot be read ({str(exc).rstrip('.')}); repair the PDF "
                        "(e.g. `qpdf IN OUT`) or leave it out") from None


def read_page(document: pdfium.PdfDocument, index: int, dpi: float, path: str | Path = "") -> PdfPage:
    """Page ``index`` (0-based) of ``document`` rendered at ``dpi``, with its text layer's words."""
    with page_errors(path, index):
        page = document[index]
        size = pixel_size(page, dpi)
        return PdfPage(render(page, size, dpi), page_words(page, size))
