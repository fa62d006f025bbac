"""The word sets the convergence and scale-accuracy benchmarks train recognizers on, as docTR folders.

``synthetic``: the trainer's own synthetic words (seed 0, validation at the loader's offset); ``real``: the
real-looking crops of :mod:`benchmarks.real_words`; ``crops``: the recognition folders of a ``scale-ocr
make-dataset`` output (word crops from real documents) the user gives. The first two are written once under the
benchmark's scratch folder and reused by every job of the same sizes.
"""

from __future__ import annotations

import json
from pathlib import Path


def word_set(name: str, work: Path, chars: str, train: int, val: int, crops: Path | None) -> tuple[Path, Path]:
    """The set ``name``'s (train, val) folders: ``train`` and ``val`` words (written under ``work`` if not there
    yet) of the vocabulary ``chars``; for ``crops``, the folders of the ``make-dataset`` output ``crops``."""
    if name == "crops":
        return crops_folders(crops)
    if name == "synthetic":
        from benchmarks.harness import write_folder
        from scale_ocr.data.loader import VAL_SEED_OFFSET

        return (write_folder(work / f"synthetic-train-{train}", train, chars, 0),
                write_folder(work / f"synthetic-val-{val}", val, chars, VAL_SEED_OFFSET))
    from benchmarks import real_words

    root = work / f"real-{train}-{val}"
    return real_words.write(root / "train", train, 2026), real_words.write(root / "val", val, 2027)


def crops_folders(path: Path | None) -> tuple[Path, Path]:
    """``PATH/recognition/{train,val}`` of a ``scale-ocr make-dataset`` output (or ``PATH/{train,val}``)."""
    from scale_ocr.errors import UserError

    if path is None:
        raise UserError("--sets crops needs --real-crops DIR: a `scale-ocr make-dataset` output folder")
    root = path / "recognition" if (path / "recognition").is_dir() else path
    for folder in (root / "train", root / "val"):
        if not (folder / "labels.json").is_file():
            raise UserError(f"--real-crops {path}: no {folder}/labels.json; give the folder `scale-ocr make-dataset "
                            "--out` wrote (it holds recognition/train and recognition/val)")
    return root / "train", root / "val"


def count(folder: Path) -> int:
    """Words in a docTR folder."""
    return len(json.loads((folder / "labels.json").read_text(encoding="utf-8")))
