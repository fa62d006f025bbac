"""Test PDFs with known words at known places (fpdf2, Helvetica: PDFium's built-in base-14 font, no system font).

Each word's expected box is computed here from the layout alone (fpdf2's string width, Helvetica's cap height),
independently of PDFium, in the pixels of the page as a viewer shows it (after ``/Rotate`` and the CropBox).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pypdfium2 as pdfium
from fpdf import FPDF
from fpdf.enums import EncryptionMethod, TextMode
from PIL import Image

CAP = 0.718  # Helvetica's cap height and ascender (H, l, d), in ems; the words below have no descender
PAGE = (400.0, 300.0)  # points


@dataclass
class TrueWord:
    """A word the test drew: its page (0-based), text and expected box in rendered pixels at ``dpi`` (the part on the
    page), and whether the page's edge cuts it."""

    page: int
    text: str
    box: tuple[float, float, float, float]
    cut: bool = False


@dataclass
class Layout:
    """What a page holds: ``(x, baseline y, size, text)`` in points from the top-left, and how it is shown."""

    words: list[tuple[float, float, float, str]]
    rotate: int = 0
    crop_left_bottom: tuple[float, float] = (0.0, 0.0)  # the CropBox starts here, so the shown page shrinks
    image_only: bool = False
    invisible: list[tuple[float, float, float, str]] | None = None  # words in render mode 3: no pixels, no truth


def _unrotated_box(pdf: FPDF, x: float, y: float, size: float, text: str) -> tuple[float, float, float, float]:
    pdf.set_font("Helvetica", size=size)
    return x, y - CAP * size, x + pdf.get_string_width(text), y


def _shown(box: tuple[float, ...], layout: Layout, dpi: float) -> tuple[float, float, float, float]:
    """A box in the unrotated page's points (top-left origin) as pixels of the shown, cropped, rotated page."""
    cx, cy = layout.crop_left_bottom
    h = PAGE[1] - cy  # the crop cuts the left and bottom: the top-left origin moves left only
    x0, y0, x1, y1 = box[0] - cx, box[1], box[2] - cx, box[3]
    if layout.rotate == 90:  # clockwise: the left edge becomes the top
        x0, y0, x1, y1 = h - y1, x0, h - y0, x1
    s = dpi / 72
    return x0 * s, y0 * s, x1 * s, y1 * s


def _on_page(word: TrueWord, layout: Layout, dpi: float) -> TrueWord | None:
    """The word clipped to the shown page (``cut`` when clipped), or None when none of it is on the page."""
    w, h = PAGE[0] - layout.crop_left_bottom[0], PAGE[1] - layout.crop_left_bottom[1]
    if layout.rotate == 90:
        w, h = h, w
    w, h = math.ceil(w * dpi / 72), math.ceil(h * dpi / 72)
    x0, y0, x1, y1 = word.box
    clipped = (max(x0, 0), max(y0, 0), min(x1, w), min(y1, h))
    if clipped[2] <= clipped[0] or clipped[3] <= clipped[1]:
        return None
    return TrueWord(word.page, word.text, clipped, clipped != word.box)


def write_pdf(path: Path, layouts: list[Layout], dpi: float) -> list[TrueWord]:
    """Write the pages and return their words' expected boxes at ``dpi``."""
    pdf = FPDF(unit="pt", format=PAGE)
    truth = []
    for index, layout in enumerate(layouts):
        pdf.add_page()
        if layout.image_only:  # text as pixels only: a scan has no text layer
            pdf.image(Image.fromarray(np.full((60, 200), 255, np.uint8)), x=50, y=50, w=200)
        for x, y, size, text in layout.invisible or []:
            with pdf.local_context(text_mode=TextMode.INVISIBLE):  # a local context: fpdf2 would not reset Tr
                pdf.set_font("Helvetica", size=size)
                pdf.text(x, y, text)
        for x, y, size, text in layout.words:
            pdf.set_font("Helvetica", size=size)
            pdf.text(x, y, text)
            word = _on_page(TrueWord(index, text, _shown(_unrotated_box(pdf, x, y, size, text), layout, dpi)),
                            layout, dpi)
            truth += [word] if word else []
    pdf.output(str(path))
    _finish(path, layouts)
    return truth


def _finish(path: Path, layouts: list[Layout]) -> None:
    """``/Rotate`` and CropBox, set with PDFium on the written file."""
    if not any(layout.rotate or layout.crop_left_bottom != (0.0, 0.0) for layout in layouts):
        return
    doc = pdfium.PdfDocument(path.read_bytes())
    for page, layout in zip(doc, layouts, strict=True):
        if layout.rotate:
            page.set_rotation(layout.rotate)
        if layout.crop_left_bottom != (0.0, 0.0):
            page.set_cropbox(*layout.crop_left_bottom, *PAGE)
    doc.save(str(path))
    doc.close()


def write_encrypted(path: Path) -> None:
    pdf = FPDF(unit="pt", format=PAGE)
    pdf.add_page()
    pdf.set_font("Helvetica", size=12)
    pdf.text(50, 50, "Secret")
    pdf.set_encryption(owner_password="owner", user_password="user", encryption_method=EncryptionMethod.RC4)
    pdf.output(str(path))


def write_page_of(path: Path, size_pt: tuple[float, float]) -> None:
    """One page of the given size with one word."""
    pdf = FPDF(unit="pt", format=size_pt)
    pdf.add_page()
    pdf.set_font("Helvetica", size=12)
    pdf.text(50, 50, "Large")
    pdf.output(str(path))
