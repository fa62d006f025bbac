"""docTR's recognition format: ``DIR/images/*`` and ``DIR/labels.json`` = ``{"file.png": "word"}``."""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from scale_ocr.errors import UserError
from scale_ocr.models.recognition.ctc import ctc_frames, ctc_frames_needed
from scale_ocr.vocab import Vocab

# A word (or line) crop is resized to the model's input, e.g. 32x128, so anything near a page's size
# is a wrong file. 8192 px a side leaves room for long line crops; 2**24 pixels (4096x4096, 50 MB
# as RGB) bounds the memory the scan and each loader worker spend decoding one image. Both sit well
# below Pillow's own decompression-bomb limit (about 89 Mpx), which is treated as an error too.
MAX_SIDE = 8192
MAX_PIXELS = 2**24
LIMITS = f"at most {MAX_SIDE} px a side and {MAX_PIXELS / 1e6:.1f} megapixels"
DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError)


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


class BadImage(Exception):
    """An image that cannot be used: ``reason`` is the skip-count key, the message says why."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason


def load_image(path: Path) -> Image.Image:
    """Decode ``path`` fully to RGB, refusing images larger than a word crop can be.

    ``verify()`` alone passes a PNG whose pixel data is cut short, so the start-up scan decodes
    every image with this same function the loader uses; the size is checked from the header first.

    Raises:
        BadImage: ``too_large`` or ``corrupt_image``.
    """
    try:
        with warnings.catch_warnings():
            # Pillow only warns between 89 and 179 Mpx; a bomb is refused whatever its size.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as im:
                w, h = im.size
                if max(w, h) > MAX_SIDE or w * h > MAX_PIXELS:
                    raise BadImage("too_large", f"is {w}x{h} pixels, larger than a word crop can be ({LIMITS})")
                return im.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise BadImage("too_large", f"declares a decompression bomb's size, far larger than a word crop can be ({LIMITS})") from None
    except DECODE_ERRORS as exc:
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}" if str(exc).strip() else type(exc).__name__
        raise BadImage("corrupt_image", f"cannot be read as an image ({detail})") from None


def _image_path(path: Path, name: str) -> tuple[Path | None, tuple[str, str] | None]:
    """The resolved image a labels.json key names, or (None, problem) when it leaves ``DIR/images``.

    The key is judged as text first (absolute, ``..``), then resolved: following symlinks reads
    links but opens no file, so a label file cannot make the scan or the loader open, decode or
    test for a file outside its own dataset.
    """
    labels = path / "labels.json"
    if not name or "\x00" in name:
        return None, ("bad_name", f"{labels}: the key {name!r} is not a file name; "
                                  "name each image relative to images/, e.g. \"img_0001.png\", "
                                  "or pass --on-bad-sample skip")
    images = path / "images"
    outside = (None, ("outside_folder", f"{labels}: the key {name!r} points outside {images}; keep every "
                                        "image inside it and name it relative to it, or pass --on-bad-sample skip"))
    if Path(name).is_absolute() or ".." in Path(name).parts:
        return outside
    try:
        resolved = (images / name).resolve()
        inside = resolved.is_relative_to(images.resolve())
    except (OSError, RuntimeError):  # a symlink loop; RuntimeError before Python 3.13
        return None, ("bad_name", f"{labels}: the key {name!r} is a symlink loop under {images}; "
                                  "fix the link or pass --on-bad-sample skip")
    return (resolved, None) if inside else outside


def _label_problem(path: Path, name: str, word: object, vocab: Vocab,
                   input_size: tuple[int, int] | None) -> tuple[str, str] | None:
    """(reason, sentence) when the label cannot be trained on, else None."""
    labels = path / "labels.json"
    if not isinstance(word, str):
        return "bad_label", f"{labels}: the label of {name!r} is not a string; labels map file names to words"
    if not word:
        return "empty_label", f"{labels}: {name!r} has an empty label; remove it or pass --on-bad-sample skip"
    unknown = vocab.unknown_chars(word)
    if unknown:
        return "unknown_chars", (
            f"{labels}: the label {word!r} of {name!r} has characters {unknown!r} outside the "
            "vocabulary; add them with --vocab/--vocab-file or pass --on-bad-sample skip"
        )
    need = ctc_frames_needed(word)
    if input_size is not None and need > ctc_frames(input_size):
        return "too_long", (
            f"{labels}: the label {word!r} of {name!r} needs {need} CTC frames ({len(word)} characters + "
            f"{need - len(word)} repeats) but a {input_size[1]}-pixel-wide input gives {ctc_frames(input_size)}; "
            "shorten it, widen --input-size or pass --on-bad-sample skip"
        )
    return None


def _check(path: Path, name: str, word: object, vocab: Vocab,
           input_size: tuple[int, int] | None) -> tuple[Path | None, tuple[str, str] | None]:
    """The image to read for one labels.json entry, or (None, (reason, sentence)) for a bad sample."""
    img_path, problem = _image_path(path, name)
    problem = problem or _label_problem(path, name, word, vocab, input_size)
    if problem:
        return None, problem
    shown = path / "images" / name  # as the user wrote it, not as symlinks resolve
    if not img_path.is_file():
        return None, ("missing_image", f"{shown} is listed in {path / 'labels.json'} but does not exist; "
                                       "fix the label file or pass --on-bad-sample skip")
    try:
        load_image(img_path)
    except BadImage as exc:
        return None, (exc.reason, f"{shown} {exc}; replace or remove it, or pass --on-bad-sample skip")
    return img_path, None


def scan_folder(path: Path, vocab: Vocab, on_bad_sample: str, report: ScanReport,
                input_size: tuple[int, int] | None = None) -> list[tuple[Path, str]]:
    """Check every labelled sample of a folder and return the usable ``(image path, word)`` pairs.

    Args:
        path: the docTR folder.
        vocab: labels must use only its characters.
        on_bad_sample: ``"error"`` raises a :class:`UserError` at the first bad sample, ``"skip"``
            counts it in ``report`` under its reason.
        report: collects kept and skipped counts.
        input_size: the model's ``(H, W)``; labels needing more CTC frames than it gives are bad
            (None skips that check).
    """
    if not path.is_dir():
        raise UserError(f"{path} is not a directory; pass a docTR folder holding images/ and labels.json")
    labels_file = path / "labels.json"
    if not labels_file.is_file():
        raise UserError(f"{labels_file} is missing; a docTR recognition folder needs images/ and labels.json")
    try:
        labels = json.loads(labels_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{labels_file} is not valid JSON ({exc}); it must map image file names to words") from None
    if not isinstance(labels, dict):
        raise UserError(f"{labels_file} must be a JSON object mapping image file names to words")
    samples = []
    for name, word in labels.items():
        img_path, problem = _check(path, name, word, vocab, input_size)
        if problem is None:
            samples.append((img_path, word))
            report.kept += 1
        elif on_bad_sample == "skip":
            report.skip(problem[0])
        else:
            raise UserError(problem[1])
    return samples


class RecognitionFolder(Dataset):
    """Word crops from one or more docTR recognition folders.

    Args:
        paths: folders, each with ``images/`` and ``labels.json``.
        vocab: labels must use only its characters (or be skipped, see ``on_bad_sample``).
        on_bad_sample: ``"error"`` stops at the first bad sample, ``"skip"`` drops and counts them.
        transform: applied to each PIL image.
        input_size: the model's ``(H, W)``, to refuse labels longer than its CTC frames can hold.
    """

    def __init__(self, paths: tuple[str, ...], vocab: Vocab, on_bad_sample: str = "error", transform=None,
                 input_size: tuple[int, int] | None = None) -> None:
        self.report = ScanReport()
        self.samples: list[tuple[Path, str]] = []
        for p in paths:
            self.samples += scan_folder(Path(p), vocab, on_bad_sample, self.report, input_size)
        if not self.samples:
            raise UserError(f"no usable samples in {', '.join(paths)}; check labels.json and images/")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def label(self, index: int) -> str:
        return self.samples[index][1]

    def __getitem__(self, index: int):
        path, word = self.samples[index]
        try:
            img = load_image(path)
        except BadImage as exc:  # it decoded at start-up, so the file changed during the run
            raise UserError(f"{path} {exc} although it passed the start-up check; it changed during the run, "
                            "restore it and resume from the last checkpoint") from None
        return (self.transform(img) if self.transform else img), word
