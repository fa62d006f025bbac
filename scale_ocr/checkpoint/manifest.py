"""``manifest.json``: the size and SHA-256 of every file of a checkpoint, to refuse damaged copies.

Checked before anything else is parsed. It guards integrity, not authenticity: whoever can edit a checkpoint can
rewrite its manifest too, which is why loading never executes code either (:mod:`scale_ocr.checkpoint.safe_dcp`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from scale_ocr.disk import open_user_file, read_user_json
from scale_ocr.errors import UserError, say

CHECKPOINT_FILE_LIMIT = 1 << 40  # a file of one rank's checkpoint: any real one; what is not a file is refused first

MANIFEST = "manifest.json"
FORMAT = "scale-ocr-manifest/1"
_CHUNK = 1 << 20  # 1 MiB reads: hashing speed is flat above this and memory stays small


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open_user_file(path, what="the checkpoint file", limit=CHECKPOINT_FILE_LIMIT) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> Path:
    """List every file of ``folder`` (except the manifest) with its size and SHA-256."""
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    out = folder / MANIFEST
    out.write_text(json.dumps({"format": FORMAT, "files": files}, indent=1) + "\n", encoding="utf-8")
    return out


def _read(folder: Path) -> dict[str, dict]:
    try:
        manifest = read_user_json(folder / MANIFEST, what="the checkpoint's manifest")
        files = manifest["files"]
        ok = manifest["format"] == FORMAT and all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in files.values())
    except (UserError, KeyError, TypeError, AttributeError) as exc:
        why = str(exc) if isinstance(exc, UserError) else type(exc).__name__
        raise UserError(f"checkpoint {folder} cannot be read: its {MANIFEST} is unreadable ({why}); "
                        "the checkpoint is damaged: use an earlier checkpoints/step_N") from None
    if not ok:
        raise UserError(f"checkpoint {folder} cannot be read: its {MANIFEST} has format "
                        f"{manifest.get('format')!r}, not {FORMAT!r}; upgrade scale-ocr or use another checkpoint")
    for name in files:  # names are plain file names: a manifest never points outside its folder
        if not name or Path(name).name != name or name in (".", ".."):
            raise UserError(f"checkpoint {folder} cannot be read: its {MANIFEST} names {name!r}, "
                            "which is not a file of the folder; the checkpoint is damaged or crafted")
    return files


def verify_manifest(folder: Path, warn: bool = True) -> set[str] | None:
    """Check every file the manifest of the ``step_N`` ``folder`` lists; the names it lists, or None for an older
    checkpoint without one (``warn``: print the "no manifest" line; only rank 0 does, so it shows once)."""
    if not (folder / MANIFEST).is_file():
        if warn:
            say(f"scale-ocr: warning: checkpoint {folder} has no {MANIFEST} (written by an older scale-ocr); "
                  "its integrity is not checked", err=True)
        return None
    files = _read(folder)
    earlier = "use an earlier checkpoints/step_N"
    # Sizes first, all of them: a half-copied folder is reported as such, whatever file comes first.
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            raise UserError(f"checkpoint {folder} cannot be read: {name} is missing (its {MANIFEST} lists it); "
                            f"copy the whole folder again or {earlier}")
        if path.stat().st_size != entry["size"]:
            raise UserError(f"checkpoint {folder} cannot be read: {name} is {path.stat().st_size} bytes, its "
                            f"{MANIFEST} says {entry['size']} (truncated or half-copied); copy it again or {earlier}")
    for name, entry in files.items():
        actual = sha256(folder / name)
        if actual != entry["sha256"]:
            raise UserError(f"checkpoint {folder} cannot be read: {name} has SHA-256 {actual[:16]}..., its {MANIFEST} "
                            f"says {entry['sha256'][:16]}...: the file is damaged; {earlier}")
    return set(files)
