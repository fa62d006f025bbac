"""docTR's recognition format: ``DIR/images/*`` and ``DIR/labels.json`` = ``{"file.png": "word"}``."""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

from scale_ocr.config import FRAME_WIDTH
from scale_ocr.data.files import (
    WORD_LIMITS,
    BadImage,
    ScanReport,
    decode_listed,
    load_image,
    read_labels,
    reject,
    reload_image,
    resolve_image,
)
from scale_ocr.errors import UserError, shown
from scale_ocr.models.recognition.ctc import ctc_frames, ctc_frames_needed
from scale_ocr.vocab import Vocab

# Re-exported: other modules (the loader, tests) import these from here.
__all__ = ["BadImage", "RecognitionFolder", "ScanReport", "load_image", "scan_folder"]


def _label_problem(path: Path, name: str, word: object, vocab: Vocab,
                   input_size: tuple[int, int] | None) -> tuple[str, str] | None:
    """(reason, sentence) when the label cannot be trained on, else None."""
    labels = path / "labels.json"
    if not isinstance(word, str):
        return "bad_label", f"{labels}: the label of {shown(name)} is not a string; labels map file names to words"
    if not word:
        return "empty_label", f"{labels}: {shown(name)} has an empty label; remove it or pass --on-bad-sample skip"
    unknown = vocab.unknown_chars(word)
    if unknown:
        return "unknown_chars", (
            f"{labels}: the label {shown(word)} of {shown(name)} has characters {shown(unknown)} outside the "
            "vocabulary; add them with --vocab/--vocab-file or pass --on-bad-sample skip"
        )
    need = ctc_frames_needed(word)
    if input_size is not None and need > ctc_frames(input_size):
        return "too_long", (
            f"{labels}: the label {shown(word)} of {shown(name)} needs {need} CTC frames ({len(word)} characters + "
            f"{need - len(word)} repeats) but a {input_size[1]}-pixel-wide input gives {ctc_frames(input_size)}; "
            "shorten it, widen --input-size or pass --on-bad-sample skip"
        )
    return None


def own_frames_problem(word: str, size: tuple[int, int], input_size: tuple[int, int]) -> str | None:
    """Why a ``(width, height)`` crop read at its own width (``--max-width``) gives CTC too few frames for ``word``;
    None when it gives enough."""
    from scale_ocr.data.transforms import ResizeHeight

    width = ResizeHeight(*input_size).width(size)
    need, frames = ctc_frames_needed(word), width // FRAME_WIDTH
    if need <= frames:
        return None
    return (f"needs {need} CTC frames, but its {size[0]}x{size[1]}-pixel crop, read at height {input_size[0]}, is "
            f"{width} pixels wide and gives {frames}")


def _check(path: Path, name: str, word: object, vocab: Vocab, input_size: tuple[int, int] | None,
           own_width: bool = False) -> tuple[tuple[Path, tuple[int, int]] | None, tuple[str, str] | None]:
    """The image to read for one labels.json entry and its size, or (None, (reason, sentence)) for a bad sample."""
    img_path, problem = resolve_image(path, name)
    problem = problem or _label_problem(path, name, word, vocab, input_size)
    if problem:
        return None, problem
    img, problem = decode_listed(path, name, img_path, WORD_LIMITS)
    if problem:
        return None, problem
    if own_width and input_size is not None and (short := own_frames_problem(word, img.size, input_size)):
        return None, ("too_long", f"{path / 'labels.json'}: the label {shown(word)} of {shown(name)} {short}; "
                                  "raise --max-width or pass --on-bad-sample skip")
    return (img_path, img.size), None


def scan_folder(path: Path, vocab: Vocab, on_bad_sample: str, report: ScanReport,
                input_size: tuple[int, int] | None = None, own_width: bool = False,
                sizes: list[tuple[int, int]] | None = None) -> list[tuple[Path, str]]:
    """Check every labelled sample of a folder and return the usable ``(image path, word)`` pairs (``sizes``, when
    given, gets each one's ``(width, height)``).

    A bad sample (characters outside ``vocab``, more CTC frames than ``input_size`` gives, or than the crop's own
    width gives when ``own_width``, a bad image) raises a :class:`UserError` (``on_bad_sample="error"``) or is
    counted in ``report`` (``"skip"``).
    """
    labels = read_labels(path, "recognition", "words")
    samples = []
    for name, word in labels.items():
        found, problem = _check(path, name, word, vocab, input_size, own_width)
        if found is not None:
            samples.append((found[0], word))
            if sizes is not None:
                sizes.append(found[1])
            report.kept += 1
        else:
            reject(problem, on_bad_sample, report)
    return samples


class RecognitionFolder(Dataset):
    """Word crops from one or more docTR recognition folders, checked by :func:`scan_folder`."""

    def __init__(self, paths: tuple[str, ...], vocab: Vocab, on_bad_sample: str = "error", transform=None,
                 input_size: tuple[int, int] | None = None, own_width: bool = False) -> None:
        self.report = ScanReport()
        self.samples: list[tuple[Path, str]] = []
        self.sizes: list[tuple[int, int]] = []  # each sample's (width, height), as the scan decoded it
        for p in paths:
            self.samples += scan_folder(Path(p), vocab, on_bad_sample, self.report, input_size, own_width, self.sizes)
        if not self.samples:
            raise UserError(f"no usable samples in {', '.join(paths)}; check labels.json and images/")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def label(self, index: int) -> str:
        return self.samples[index][1]

    def __getitem__(self, index: int):
        path, word = self.samples[index]
        img = reload_image(path, WORD_LIMITS)
        return (self.transform(img) if self.transform else img), word
