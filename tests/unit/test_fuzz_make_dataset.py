"""Property-based fuzzing of what ``scale-ocr make-dataset`` reads from a PDF (docs/faults.md, "Fuzzing").

A small valid PDF (two pages of known words, tests/helpers/pdfs.py) is damaged: bytes flipped, a span overwritten,
the file cut short, junk put before its header or after its end, a number in it replaced by another (page sizes,
object offsets, lengths, counts). Each goes with options (--dpi, a vocabulary, --reco-width) through the command's
reading: the survey of the document (:func:`~scale_ocr.data.make_dataset._survey_one`), the size check, then each
page read, filtered and encoded as a worker does (:func:`~scale_ocr.data.make_dataset.run_page`). It ends in
samples or in one UserError line (:mod:`test_fuzz_oracle`), never another exception.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from conftest import SURFACE_EXAMPLES
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_fuzz_oracle import outcome

from scale_ocr.data import make_dataset as md
from scale_ocr.data.files import PAGE_LIMITS
from tests.helpers.pdfs import Layout, write_pdf


def _valid_pdf() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.pdf"
        write_pdf(path, [Layout([(40, 60, 24, "Hello"), (200, 140, 12, "World")]),
                         Layout([(40, 80, 20, "Rotated")], rotate=90)], 72)
        return path.read_bytes()


PDF = _valid_pdf()
NUMBERS = [m.span() for m in re.finditer(rb"\d+", PDF)]


@st.composite
def damaged(draw) -> bytes:
    data = bytearray(PDF)
    how = draw(st.sampled_from(["flip", "span", "truncate", "prefix", "append", "number"]))
    if how == "flip":
        for at in draw(st.lists(st.integers(0, len(data) - 1), min_size=1, max_size=6)):
            data[at] ^= draw(st.integers(1, 255))
    elif how == "span":
        at = draw(st.integers(0, len(data) - 1))
        patch = draw(st.binary(min_size=1, max_size=32))
        data[at:at + len(patch)] = patch
    elif how == "truncate":
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif how == "prefix":  # white space (allowed), a zip's magic, or anything
        data = bytearray(draw(st.sampled_from([b"\n", b"\xef\xbb\xbf", b"PK\x03\x04", b""]))
                         + draw(st.binary(max_size=40))) + data
    elif how == "append":
        data += draw(st.binary(min_size=1, max_size=64))
    else:
        start, end = draw(st.sampled_from(NUMBERS))
        value = draw(st.one_of(st.integers(0, 20), st.integers(10**3, 10**6), st.integers(0, 2**64)))
        data = data[:start] + str(value).encode() + data[end:]
    return bytes(data)


def _read(path: Path, dpi: int, vocab: str, width: int) -> int:
    """What make-dataset does with one document, in this process: the number of word crops it gives."""
    doc = md._survey_one(str(path))
    md.check_sizes([doc], dpi)
    crops = 0
    try:
        for i, (_, _, has_text) in enumerate(doc.pages[:3]):
            if not has_text:
                continue
            samples = md.run_page(md.PageJob(str(path), doc.id, i, "train", dpi, vocab))
            md.drop_long_words(samples, width)
            if samples.page_png is not None:
                h, w = samples.page_label["img_dimensions"]
                assert max(h, w) <= PAGE_LIMITS.max_side and h * w <= PAGE_LIMITS.max_pixels
            crops += len(samples.crops)
    finally:
        md.close_documents()
    return crops


@settings(max_examples=SURFACE_EXAMPLES, deadline=None)
@given(data=damaged(), dpi=st.integers(50, 90), vocab=st.sampled_from(["HeloWrd", "abcdefghijklmnopqrstuvwxyzR"]),
       width=st.sampled_from([0, 32, 128]))
@example(data=b"PK\x03\x04" + b"\x00" * 26 + PDF, dpi=72, vocab="HeloWrd", width=0)  # a zip holding the PDF
@example(data=PDF.replace(b"/MediaBox[ 0 0 400 300]", b"/MediaBox[ 0 0 20000 20000]"), dpi=50,
         vocab="HeloWrd", width=0)  # larger than a page image at any allowed --dpi
def test_damaged_pdf(data, dpi, vocab, width):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.pdf"
        path.write_bytes(data)
        crops, _ = outcome(_read, path, dpi, vocab, width)
        assert crops is None or crops >= 0
