"""A resume continues on the data its checkpoint trained on, or is refused.

A checkpoint's trainer state records the digests of its training and validation labels (``labels.json``, or a shard
set's index; :meth:`~scale_ocr.data.loader.Data.identity`). A run resumed after those changed would continue an
epoch position that now indexes other samples, and compare its best score with one measured on another validation
set: it is refused in one line. Seeded synthetic data and image caches record nothing and pass.
"""

from __future__ import annotations

from pathlib import Path

from scale_ocr.disk import read_user_json
from scale_ocr.errors import UserError, shown

_WORDS = {"train_sha256": ("data position belongs to another dataset", "--train-path", "trained on"),
          "val_sha256": ("best score was measured on another validation set", "--val-path", "validated on")}


def recorded_data(meta: dict, checkpoint: Path) -> dict | None:
    """What ``meta`` (a checkpoint's trainer.json) records of its data; for a checkpoint written before it did, the
    training digest its run's config.json holds (read before this run rewrites it)."""
    if isinstance(meta.get("data"), dict):
        return meta["data"]
    try:
        doc = read_user_json(checkpoint.parent.parent / "config.json", what="the run's config.json")
        return {"train_sha256": doc["dataset"]["train_labels_sha256"]}
    except (UserError, KeyError, TypeError):
        return None


def _short(digest: str) -> str:
    """A digest's first 12 hex digits for a message; anything else (a damaged record) quoted and escaped."""
    return f"{digest[:12]}..." if digest and all(c in "0123456789abcdef" for c in digest) else shown(digest[:12])


def same_data(recorded: dict | None, now: dict[str, str | None]) -> None:
    """Refuse to resume on data other than what ``recorded`` (:func:`recorded_data`) names; ``now``: this run's."""
    for key, (what, flag, did) in _WORDS.items():
        then = recorded.get(key) if isinstance(recorded, dict) else None
        if isinstance(then, str) and then and now.get(key) != then:
            now_text = f"now {_short(now[key])}" if now.get(key) else "this run has none"
            raise UserError(f"the checkpoint's {what}: the labels of {flag} (labels.json, or a shard set's index) "
                            f"changed since it was saved (sha256 {_short(then)}, {now_text}); resume with the "
                            f"data it {did}, or pass --resume none to start afresh")
