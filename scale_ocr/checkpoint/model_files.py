"""Whole-model files from a strategy's pieces: ``last_model.pt`` and ``best_model.pt``, one tensor at a time.

A fault on rank 0 (a full disk, a file that is a link, a tensor holding NaN) stops its writing but not its
fetching, so the other ranks are never left waiting in a collective; it is raised once every piece went by.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch

from scale_ocr.checkpoint.piecewise import TensorSpec, TorchFile
from scale_ocr.disk import atomic_file
from scale_ocr.strategies.base import ModelPiece


class NonFiniteWeights(Exception):
    """A piece held NaN or inf: no file was written (the previous one, if any, is kept)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def specs_of(pieces: Sequence[ModelPiece]) -> list[TensorSpec]:
    return [TensorSpec(p.name, tuple(p.shape), p.dtype) for p in pieces]


def whole_bytes(pieces: Sequence[ModelPiece]) -> tuple[int, int]:
    """``(bytes of the whole model as written, bytes of its largest piece)``."""
    sizes = [s.nbytes for s in specs_of(pieces)] or [0]
    return sum(sizes), max(sizes)


def write_whole_model(pieces: Sequence[ModelPiece], paths: Sequence[Path], is_main: bool, *, kept: str) -> None:
    """Fetch every piece (every rank, in order) and write them, on rank 0, as the torch file ``{name: tensor}`` at
    each of ``paths``, each whole or not at all; ``kept``: what a failed write leaves intact, for the message.

    Raises:
        NonFiniteWeights: a floating-point piece held NaN/inf (nothing written).
        DiskFault: a write met a full disk (nothing written); other faults as raised.
    """
    specs = specs_of(pieces)
    needed = sum(s.nbytes for s in specs)
    with ExitStack() as stack:
        files: list[TorchFile] = []
        problem: BaseException | None = None
        if is_main:
            try:
                for path in paths:
                    f = stack.enter_context(atomic_file(path, what="the model", kept=kept, needed=needed))
                    files.append(TorchFile(f, specs))
            except Exception as exc:  # noqa: BLE001 - raised below, once the other ranks' collectives are done
                problem = exc
        for piece in pieces:
            tensor = piece.fetch()
            if tensor is None or problem is not None:
                continue
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                problem = NonFiniteWeights(piece.name)
                continue
            try:
                for f in files:
                    f.put(tensor)
            except Exception as exc:  # noqa: BLE001 - as above
                problem = exc
            del tensor
        if problem is not None:
            raise problem  # through each atomic file: its temp file goes, a disk fault becomes one line
        for f in files:
            f.close()
