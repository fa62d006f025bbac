"""Pre-rendered word images held in memory (``--data-cache FILE``), so data loading never limits a benchmark.

The file holds one fp16 tensor of validation-transformed words and their labels only, read with ``weights_only``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset

from scale_ocr.errors import UserError
from scale_ocr.vocab import Vocab


def build_cache(path: str | Path, n: int, input_size: tuple[int, int], chars: str, min_chars: int = 3,
                max_chars: int = 8, seed: int = 0, transform=None) -> Path:
    """Render ``n`` words into ``path`` (written atomically) through ``transform`` (default: scale_ocr's
    validation transform); returns the path."""
    from scale_ocr.data.synthetic import SyntheticWords
    from scale_ocr.data.transforms import build_transform

    words = SyntheticWords(chars, n, min_chars, max_chars, seed, transform or build_transform(input_size, train=False))
    images = torch.empty(n, 3, *input_size, dtype=torch.float16)
    labels = []
    for i in range(n):
        image, word = words[i]
        images[i] = image.to(torch.float16)
        labels.append(word)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    torch.save({"images": images, "labels": labels, "input_size": list(input_size), "chars": chars}, tmp)
    tmp.replace(path)
    return path


class TensorWords(Dataset):
    """The words of a cache file; sample ``i`` is ``(image tensor (3, H, W), word)``."""

    def __init__(self, path: str | Path, vocab: Vocab, input_size: tuple[int, int]) -> None:
        try:
            data = torch.load(path, weights_only=True)
            self.images, self.labels = data["images"], list(data["labels"])
        except FileNotFoundError:
            raise UserError(f"--data-cache {path} does not exist; build it with `python -m "
                            "scale_ocr.data.cache`") from None
        except Exception as exc:  # noqa: BLE001 - truncated or foreign files raise several types
            raise UserError(f"--data-cache {path} is not a scale-ocr image cache ({type(exc).__name__})") from None
        if tuple(self.images.shape[2:]) != tuple(input_size):
            raise UserError(f"--data-cache {path} holds {self.images.shape[2]}x{self.images.shape[3]} images, this run "
                            f"uses --input-size {input_size[0]}x{input_size[1]}; rebuild the cache or change the size")
        unknown = sorted({c for w in self.labels for c in w} - set(vocab.chars))
        if unknown:
            raise UserError(f"--data-cache {path} has characters outside the vocabulary: {''.join(unknown)!r}")

    def __len__(self) -> int:
        return len(self.labels)

    def label(self, index: int) -> str:
        return self.labels[index]

    def __getitem__(self, index: int):
        return self.images[index].float(), self.labels[index]


def main(argv: list[str] | None = None) -> int:
    import argparse

    from scale_ocr.vocab import VOCABS

    p = argparse.ArgumentParser(prog="python -m scale_ocr.data.cache", description="Render a synthetic image cache.")
    p.add_argument("path")
    p.add_argument("-n", type=int, default=1024)
    p.add_argument("--input-size", default="32x128")
    p.add_argument("--vocab", default="latin", choices=sorted(VOCABS))
    args = p.parse_args(argv)
    h, w = (int(v) for v in args.input_size.split("x"))
    print(build_cache(args.path, args.n, (h, w), VOCABS[args.vocab]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
