"""Key renaming between a model's state dict and its twin's (docTR's layout): prefixes swapped, nothing else."""

from __future__ import annotations

import torch


def key_prefix(key: str, names: dict[str, str]) -> str:
    """The prefix of ``names`` that ``key`` starts with (a KeyError when none does)."""
    found = next((p for p in names if key.startswith(p)), None)
    if found is None:
        raise KeyError(key)
    return found


def rename_prefixes(state: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """``state`` with each key's prefix replaced by its value in ``names`` (every key must have one)."""
    out = {}
    for k, v in state.items():
        prefix = key_prefix(k, names)
        out[names[prefix] + k[len(prefix):]] = v
    return out
