"""File-safety rules shared by every docTR folder format (recognition, detection).

A folder is ``DIR/images/*`` plus ``DIR/labels.json`` keyed by image file name. Whatever the task,
a key may only name a file inside ``DIR/images`` (symlinks included), every image is fully decoded at
start-up within size limits, and a bad sample is either one :class:`UserError` line or a counted skip.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from scale_ocr.data.images import exif_orientation, to_rgb
from scale_ocr.disk import GiB, read_user_text
from scale_ocr.errors import JSON_ERRORS, UserError, first_line, json_problem, printable, shown

# struct.error: a malformed EXIF block, read for the orientation. TypeError: a TIFF tag of the wrong type (a
# rational where a count belongs), which Pillow's TIFF reader does not check. UserWarning: Pillow read past a damaged
# header by guessing (a tag skipped, EXIF cut short), an error here: the pixels would follow the guess.
DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, struct.error, TypeError,
                 UserWarning)

Problem = tuple[str, str]  # (skip-count reason, the one-line sentence shown under --on-bad-sample error)
LABELS_LIMIT = 2 * GiB  # a labels.json: a million pages with their polygons is well under this
IMAGE_FILE_LIMIT = 2 * GiB  # an image file: 2**26 pixels (a page's bound) in any format is under this


@dataclass(frozen=True)
class ImageLimits:
    """The largest image a task accepts, checked from the header before decoding (``kind``, for messages: "a word
    crop", "a page"); ``max_pixels`` bounds the memory the scan and each loader worker spend on one image."""

    max_side: int
    max_pixels: int
    kind: str

    def __str__(self) -> str:
        return f"at most {self.max_side} px a side and {self.max_pixels / 1e6:.1f} megapixels"


# A word (or line) crop is resized to the model's input, e.g. 32x128, so anything near a page's size
# is a wrong file. 8192 px a side leaves room for long line crops; 2**24 pixels (4096x4096, 50 MB as
# RGB) bounds decoding memory. Pages get 2**26 pixels (8192x8192, 200 MB as RGB): a 600 dpi A3 scan
# fits. Both sit below Pillow's own decompression-bomb limit (about 89 Mpx), treated as an error too.
WORD_LIMITS = ImageLimits(8192, 2**24, "a word crop")
PAGE_LIMITS = ImageLimits(8192, 2**26, "a page")


@dataclass
class ScanReport:
    """What a folder scan kept and what it skipped (with ``--on-bad-sample skip``)."""

    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())


class BadSample(Exception):
    """A sample that cannot be used: ``reason`` is the skip-count key, the message says why."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason

    @property
    def problem(self) -> Problem:
        return self.reason, str(self)


class BadImage(BadSample):
    """An image that cannot be decoded within the limits (``too_large`` or ``corrupt_image``)."""


def load_image(path: Path, limits: ImageLimits = WORD_LIMITS) -> Image.Image:
    """Decode ``path`` fully to upright 8-bit RGB (:func:`scale_ocr.data.images.to_rgb`), refusing images larger
    than ``limits`` (from the header, first: a quarter turn changes neither limit) with :class:`BadImage`
    ``too_large``, others ``corrupt_image``.

    The one decode path of every task. ``verify()`` alone passes a PNG whose pixel data is cut short, so the
    start-up scan decodes every image with this same function the loader uses.
    """
    try:
        with warnings.catch_warnings(record=True) as caught:
            # Pillow only warns between 89 and 179 Mpx; a bomb is refused whatever its size. Its other warnings say
            # it guessed past a damaged header: recorded here, judged by _guessed_pixels.
            warnings.simplefilter("always", UserWarning)
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                w, h = im.size
                if max(w, h) > limits.max_side or w * h > limits.max_pixels:
                    raise BadImage("too_large", f"is {w}x{h} pixels, larger than {limits.kind} can be ({limits})")
                rgb, fmt = to_rgb(im), im.format
        guessed = _guessed_pixels(caught, fmt)
        if guessed is not None:
            raise UserWarning(guessed)
        return rgb
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise BadImage("too_large", f"declares a decompression bomb's size, far larger than {limits.kind} "
                                    f"can be ({limits})") from None
    except DECODE_ERRORS as exc:
        detail = f"{type(exc).__name__}: {printable(first_line(exc), 120)}" if str(exc).strip() else type(exc).__name__
        raise BadImage("corrupt_image", f"cannot be read as an image ({detail})") from None


def _guessed_pixels(caught: list[warnings.WarningMessage], fmt: str | None) -> str | None:
    """The first Pillow warning that says the pixels follow a guess past a damaged header, if any.

    A damaged tag in a JPEG's, PNG's or WebP's EXIF block (a phone's description cut short) is metadata: Pillow
    skips it, reads the other tags (the orientation among them) and the pixels do not depend on it, so the image
    decodes. In a TIFF the same tags describe the pixels themselves.
    """
    for w in caught:
        exif_block = fmt != "TIFF" and Path(w.filename).name == "TiffImagePlugin.py"
        if issubclass(w.category, UserWarning) and not exif_block:
            return str(w.message)
    return None


def _encodable(name: str) -> bool:
    """Whether a file name can spell ``name``: JSON's ``\\ud800`` escape gives a lone surrogate that none can."""
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        return False
    return True


def resolve_image(path: Path, name: str) -> tuple[Path | None, Problem | None]:
    """The resolved image a labels.json key names, or (None, problem) when it leaves ``DIR/images``.

    The key is judged as text first (absolute, ``..``), then resolved: following symlinks reads
    links but opens no file, so a label file cannot make the scan or the loader open, decode or
    test for a file outside its own dataset.
    """
    labels = path / "labels.json"
    if not name or "\x00" in name or not _encodable(name):
        return None, ("bad_name", f"{labels}: the key {shown(name)} is not a file name; "
                                  "name each image relative to images/, e.g. \"img_0001.png\", "
                                  "or pass --on-bad-sample skip")
    images = path / "images"
    outside = (None, ("outside_folder", f"{labels}: the key {shown(name)} points outside {images}; keep every "
                                        "image inside it and name it relative to it, or pass --on-bad-sample skip"))
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return outside
    try:
        resolved = (images / name).resolve()
        inside = resolved.is_relative_to(images.resolve())
    except (OSError, RuntimeError):  # a symlink loop; RuntimeError before Python 3.13
        return None, ("bad_name", f"{labels}: the key {shown(name)} is a symlink loop under {images}; "
                                  "fix the link or pass --on-bad-sample skip")
    return (resolved, None) if inside else outside


def decode_listed(path: Path, name: str, img_path: Path,
                  limits: ImageLimits) -> tuple[Image.Image | None, Problem | None]:
    """Decode the image of an already contained key, or (None, problem) if it is missing or unusable."""
    as_listed = shown(path / "images" / name)  # as the user wrote it, not as symlinks resolve
    try:
        listed = img_path.is_file()
    except OSError as exc:  # ENAMETOOLONG: a name or path longer than the file system allows
        return None, ("bad_name", f"{as_listed} cannot be looked up ({exc.strerror}); fix its key in "
                                  f"{path / 'labels.json'} or pass --on-bad-sample skip")
    if not listed:
        return None, ("missing_image", f"{as_listed} is listed in {path / 'labels.json'} but does not exist; "
                                       "fix the label file or pass --on-bad-sample skip")
    try:
        return load_image(img_path, limits), None
    except BadImage as exc:
        return None, (exc.reason, f"{as_listed} {exc}; replace or remove it, or pass --on-bad-sample skip")


def reload_image(path: Path, limits: ImageLimits) -> Image.Image:
    """Decode an image that passed the start-up scan; a failure now means the file changed mid-run."""
    try:
        return load_image(path, limits)
    except BadImage as exc:
        raise UserError(f"{shown(path)} {exc} although it passed the start-up check; it changed during the "
                        "run, restore it and resume from the last checkpoint") from None


def read_labels(path: Path, task: str, maps_to: str) -> dict:
    """The labels.json object of a docTR folder, or a :class:`UserError` saying what is wrong (``task`` and what
    each file name ``maps_to``, for messages)."""
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; pass a docTR folder holding images/ and labels.json")
    labels_file = path / "labels.json"
    text = read_user_text(labels_file, what="the labels file", limit=LABELS_LIMIT, follow=True,
                          missing=f"{labels_file} is missing; a docTR {task} folder needs images/ and labels.json")
    try:
        labels = json.loads(text)
    except JSON_ERRORS as exc:
        raise UserError(f"{labels_file} is not valid JSON ({json_problem(exc)}); it must map image file names to "
                        f"{maps_to}") from None
    if not isinstance(labels, dict):
        raise UserError(f"{labels_file} must be a JSON object mapping image file names to {maps_to}")
    return labels


def reject(problem: Problem, on_bad_sample: str, report: ScanReport) -> None:
    """Count a bad sample under ``--on-bad-sample skip``; otherwise stop with its one line."""
    if on_bad_sample != "skip":
        raise UserError(problem[1])
    report.skip(problem[0])


def open_rgb(name: str, limits: ImageLimits = PAGE_LIMITS) -> Image.Image:
    """An image file decoded as training decodes it (:func:`load_image`), or one line naming the file."""
    try:
        return load_image(Path(name), limits)
    except BadImage as exc:
        raise UserError(f"{name} {exc}") from None


def orientation_of(path: Path) -> int:
    """The EXIF orientation of an image file that decoded before (its header only), for messages about its size;
    1 if it cannot be read now: only a message's hint depends on it."""
    try:
        with Image.open(path) as im:
            return exif_orientation(im)
    except DECODE_ERRORS:
        return 1
