"""Pre-rendered word images held in memory (``--data-cache FILE``), so data loading never limits a benchmark.

The file holds one fp16 tensor of validation-transformed words and their labels only, read with ``weights_only``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from scale_ocr.disk import GiB, open_user_file, write_atomic
from scale_ocr.errors import UserError, shown
from scale_ocr.vocab import Vocab

if TYPE_CHECKING:
    from scale_ocr.data.fonts import FontSet

CACHE_LIMIT = 256 * GiB  # far above any cache that fits in a host's memory, which the whole file must


def build_cache(path: str | Path, n: int, input_size: tuple[int, int], chars: str, min_chars: int = 3,
                max_chars: int = 8, seed: int = 0, transform=None, style: str = "line",
                fonts: FontSet | None = None) -> Path:
    """Render ``n`` words (:class:`~scale_ocr.data.synthetic.SyntheticWords` of ``style`` in ``fonts``; None: the
    records' classic faces) into ``path`` through ``transform`` (default: scale_ocr's validation transform), written
    whole or not at all; returns the path."""
    from scale_ocr.data.synthetic import SyntheticWords
    from scale_ocr.data.transforms import build_transform

    words = SyntheticWords(chars, n, min_chars, max_chars, seed, transform or build_transform(input_size, train=False),
                           style, fonts)
    images = torch.empty(n, 3, *input_size, dtype=torch.float16)
    labels = []
    for i in range(n):
        image, word = words[i]
        images[i] = image.to(torch.float16)
        labels.append(word)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cache = {"images": images, "labels": labels, "input_size": list(input_size), "chars": chars}
    write_atomic(path, lambda f: torch.save(cache, f), what="the image cache", kept="no cache was written")
    return path


class TensorWords(Dataset):
    """The words of a cache file; sample ``i`` is ``(image tensor (3, H, W), word)``."""

    def __init__(self, path: str | Path, vocab: Vocab, input_size: tuple[int, int]) -> None:
        name = f"--data-cache {shown(path)}"
        try:
            with open_user_file(path, what="--data-cache", limit=CACHE_LIMIT, follow=True,
                                missing=f"{name} does not exist; build it with `scale-ocr make-cache`") as f:
                data = torch.load(f, weights_only=True)
            self.images, self.labels = data["images"], list(data["labels"])
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - truncated or foreign files raise several types
            raise UserError(f"{name} is not a scale-ocr image cache ({type(exc).__name__})") from None
        if not (isinstance(self.images, torch.Tensor) and self.images.is_floating_point() and self.images.dim() == 4
                and self.images.shape[0] == len(self.labels) and all(isinstance(w, str) for w in self.labels)):
            raise UserError(f"{name} is not a scale-ocr image cache (one float tensor of N images, 3 x H x W, and N "
                            "words expected); rebuild it with `scale-ocr make-cache`")
        if tuple(self.images.shape[2:]) != tuple(input_size):
            raise UserError(f"{name} holds {self.images.shape[2]}x{self.images.shape[3]} images, this run "
                            f"uses --input-size {input_size[0]}x{input_size[1]}; rebuild the cache or change the size")
        finite = torch.isfinite(self.images).flatten(1).all(1)  # one pass over the cache, at load
        if not bool(finite.all()):
            bad = (~finite).nonzero().flatten()
            raise UserError(f"{name} holds {len(bad)} of {len(finite)} images with NaN or inf pixels (the first: "
                            f"image {int(bad[0])}); a model cannot train on them: rebuild the cache with "
                            "`scale-ocr make-cache`")
        unknown = sorted({c for w in self.labels for c in w} - set(vocab.chars))
        if unknown:
            raise UserError(f"{name} has characters outside the vocabulary: {shown(''.join(unknown))}")

    def __len__(self) -> int:
        return len(self.labels)

    def label(self, index: int) -> str:
        return self.labels[index]

    def __getitem__(self, index: int):
        return self.images[index].float(), self.labels[index]
