"""Vocabularies: named character sets and the CTC encoding of words."""

from __future__ import annotations

import string

import torch

from scale_ocr.disk import KiB, read_user_text
from scale_ocr.errors import UserError

VOCAB_FILE_LIMIT = 64 * KiB  # a vocabulary of characters: the largest in use has about 200

_LATIN = string.digits + string.ascii_letters + string.punctuation
VOCABS: dict[str, str] = {
    "digits": string.digits,
    "ascii_letters": string.ascii_letters,
    "punctuation": string.punctuation,
    "latin": _LATIN,
    "english": _LATIN + "°£€¥¢฿",
    "french": _LATIN + "°£€¥¢฿" + "àâéèêëîïôùûüçÀÂÉÈÊËÎÏÔÙÛÜÇ",
}


def resolve_vocab(vocab: str, vocab_file: str | None = None, names: dict[str, str] | None = None) -> str:
    """Return the characters of a vocabulary given by name (in ``names``, default :data:`VOCABS`), by its
    characters, or by a file.

    Duplicates are dropped (first occurrence kept) so that encoding is a bijection.
    """
    if vocab_file is not None:
        text = read_user_text(vocab_file, what="--vocab-file", limit=VOCAB_FILE_LIMIT, follow=True)
        chars = text.replace("\n", "").replace("\r", "")
    else:
        chars = (VOCABS if names is None else names).get(vocab, vocab)
    chars = "".join(dict.fromkeys(chars))
    if not chars:
        raise UserError("the vocabulary is empty; pass --vocab NAME or --vocab-file FILE")
    return chars


class Vocab:
    """Maps characters to CTC class indices; index 0 is the blank."""

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self._index = {c: i + 1 for i, c in enumerate(chars)}

    def __len__(self) -> int:
        return len(self.chars)

    @property
    def num_classes(self) -> int:
        """Characters plus the CTC blank."""
        return len(self.chars) + 1

    def unknown_chars(self, word: str) -> str:
        """The characters of ``word`` that the vocabulary lacks, in order of appearance."""
        return "".join(dict.fromkeys(c for c in word if c not in self._index))

    def encode(self, word: str) -> torch.Tensor:
        """Class indices of ``word`` (all characters must be known)."""
        return torch.tensor([self._index[c] for c in word], dtype=torch.long)

    def decode(self, indices: list[int]) -> str:
        """Characters of a sequence of class indices, blanks skipped."""
        return "".join(self.chars[i - 1] for i in indices if i > 0)
