"""docTR's recognition format: ``DIR/images/*`` and ``DIR/labels.json`` = ``{"file.png": "word"}``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from scale_ocr.errors import UserError
from scale_ocr.vocab import Vocab


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


def _problem(path: Path, name: str, word: object, vocab: Vocab) -> tuple[str, str] | None:
    """(reason, sentence) for a bad sample, or None when it is usable."""
    img_path = path / "images" / name
    if not isinstance(word, str):
        return "bad_label", f"{path / 'labels.json'}: the label of {name!r} is not a string; labels map file names to words"
    if not word:
        return "empty_label", f"{path / 'labels.json'}: {name!r} has an empty label; remove it or pass --on-bad-sample skip"
    unknown = vocab.unknown_chars(word)
    if unknown:
        return "unknown_chars", (
            f"{path / 'labels.json'}: the label {word!r} of {name!r} has characters {unknown!r} outside the "
            "vocabulary; add them with --vocab/--vocab-file or pass --on-bad-sample skip"
        )
    if not img_path.is_file():
        return "missing_image", (
            f"{img_path} is listed in {path / 'labels.json'} but does not exist; "
            "fix the label file or pass --on-bad-sample skip"
        )
    try:
        with Image.open(img_path) as im:
            im.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        return "corrupt_image", (
            f"{img_path} cannot be read as an image ({type(exc).__name__}); "
            "replace or remove it, or pass --on-bad-sample skip"
        )
    return None


def scan_folder(path: Path, vocab: Vocab, on_bad_sample: str, report: ScanReport) -> list[tuple[Path, str]]:
    """Check every labelled sample of a folder and return the usable ``(image path, word)`` pairs."""
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
        problem = _problem(path, name, word, vocab)
        if problem is None:
            samples.append((path / "images" / name, word))
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
    """

    def __init__(self, paths: tuple[str, ...], vocab: Vocab, on_bad_sample: str = "error", transform=None) -> None:
        self.report = ScanReport()
        self.samples: list[tuple[Path, str]] = []
        for p in paths:
            self.samples += scan_folder(Path(p), vocab, on_bad_sample, self.report)
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
            with Image.open(path) as im:
                img = im.convert("RGB")
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            raise UserError(f"{path} cannot be decoded ({type(exc).__name__}: {exc}); replace or remove it") from None
        return (self.transform(img) if self.transform else img), word
