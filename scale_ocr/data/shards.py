"""Shard sets: many samples in a few tar files as WebDataset writes them, plus an index (``shards.json``) listing
each shard's name, sample count, byte size and SHA-256 (docs/data.md, "Shards").

Members are image bytes, UTF-8 text and JSON: nothing in a set runs code when read. The tars are read here, not
with webdataset's loader, whose resumption is approximate (:mod:`scale_ocr.data.position` is exact).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from scale_ocr.data.files import PATH_LIMIT
from scale_ocr.errors import JSON_ERRORS, UserError, json_problem, shown
from scale_ocr.models.recognition.ctc import ctc_frames_needed

INDEX = "shards.json"
FORMAT = "scale-ocr-shards"
VERSION = 1
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp", "tif", "tiff", "bmp")
LABEL_EXT = {"recognition": "txt", "detection": "json"}
REBUILD = "rebuild it with `scale-ocr make-shards`"


@dataclass(frozen=True)
class ShardInfo:
    """One shard as the index describes it."""

    name: str
    path: Path
    samples: int
    bytes: int
    sha256: str


@dataclass
class ShardSet:
    """An opened, checked shard set (see :func:`open_set`)."""

    root: Path
    task: str
    shards: list[ShardInfo]
    digest: str  # SHA-256 of the index file: a checkpoint's position belongs to this set
    meta: dict = field(default_factory=dict)

    @property
    def counts(self) -> list[int]:
        return [s.samples for s in self.shards]

    @property
    def total(self) -> int:
        return sum(self.counts)


def path_text(path: Path) -> str:
    """A shard's path for a message (long paths are shortened, odd characters escaped)."""
    return shown(path, PATH_LIMIT)


def is_shard_set(path: str | Path) -> bool:
    return (Path(path) / INDEX).is_file()


def _bad_index(index: Path, why: str) -> UserError:
    return UserError(f"{index} {why}; {REBUILD}")


def _shard_path(root: Path, index: Path, name: object) -> Path:
    """The shard file an index entry names, refused when it is no plain file name inside the set."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        raise UserError(f"{index}: the shard name {shown(name)} is not a file name inside {root}; a set's index names "
                        f"its shards by file name only; {REBUILD}")
    path = root / name
    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except (OSError, RuntimeError):
        inside = False
    if not inside:
        raise UserError(f"{index}: the shard {shown(name)} points outside {root} (a symlink); keep every shard inside "
                        f"the set's folder; {REBUILD}")
    return path


def _entry(root: Path, index: Path, i: int, entry: object) -> ShardInfo:
    keys = {"name": str, "samples": int, "bytes": int, "sha256": str}
    if not isinstance(entry, dict) or any(not isinstance(entry.get(k), t) for k, t in keys.items()):
        raise _bad_index(index, f"has a malformed shard entry {i} ({shown(entry, 80)}; each needs name, samples, bytes "
                                "and sha256)")
    path = _shard_path(root, index, entry["name"])
    try:
        size = path.stat().st_size
    except OSError:
        raise UserError(f"{path_text(path)}, listed in {index}, is missing; copy the whole set, or {REBUILD}") from None
    if size != entry["bytes"]:
        raise UserError(f"{path_text(path)} holds {size} bytes but {index} says {entry['bytes']}: it is truncated or "
                        f"was replaced; copy it again from the original set, or {REBUILD}")
    return ShardInfo(entry["name"], path, entry["samples"], entry["bytes"], entry["sha256"])


def open_set(path: str | Path, task: str) -> ShardSet:
    """Read and check a set's index: format, task, shard names inside the set, each shard present at its size.

    Contents (SHA-256, sample count) are checked when a shard is read (:func:`read_shard`).
    """
    root = Path(path)
    index = root / INDEX
    try:
        raw = index.read_bytes()
        doc = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise UserError(f"{index} is missing; a shard set holds shards.json and its tar files "
                        "(`scale-ocr make-shards` writes them)") from None
    except JSON_ERRORS as exc:
        raise _bad_index(index, f"is not valid JSON ({json_problem(exc)})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad_index(index, f"is not a scale-ocr shard index (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise UserError(f"{index} is format version {shown(doc.get('version'))}; this scale-ocr reads version "
                        f"{VERSION}; {REBUILD}")
    if doc.get("task") != task:
        raise UserError(f"{root} is a {shown(doc.get('task'))} shard set but this model trains {task}; pass a "
                        f"{task} set, or a model of that task")
    entries = doc.get("shards")
    if not isinstance(entries, list) or not entries:
        raise _bad_index(index, "lists no shards")
    shards = [_entry(root, index, i, e) for i, e in enumerate(entries)]
    if doc.get("total") != sum(s.samples for s in shards):
        raise _bad_index(index, f"says {shown(doc.get('total'))} samples but its shards add up to "
                                f"{sum(s.samples for s in shards)}")
    return ShardSet(root, task, shards, hashlib.sha256(raw).hexdigest(), doc)


@dataclass(frozen=True)
class Member:
    """One sample of a shard: its key, image extension and bytes, and its label's bytes."""

    key: str
    ext: str
    image: bytes
    label: bytes
    offset: int = 0  # of the image's bytes in the shard file (random access for validation)


def _split(name: str) -> tuple[str, str]:
    base = name.rsplit("/", 1)[-1]
    key, _, ext = base.partition(".")
    return key, ext.lower()


def parse_shard(data: bytes, info: ShardInfo, task: str) -> list[Member]:
    """A shard's samples in the tar's order, refusing one that is not a well-formed shard of ``info``'s count."""
    label_ext = LABEL_EXT[task]
    parts: dict[str, dict[str, bytes]] = {}
    offsets: dict[str, int] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for ti in tar:
                if not ti.isfile():
                    continue  # directories: webdataset's writers never make them, other tar tools may
                key, ext = _split(ti.name)
                parts.setdefault(key, {})[ext] = tar.extractfile(ti).read()
                if ext in IMAGE_EXTS:
                    offsets[key] = ti.offset_data
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise UserError(f"{path_text(info.path)} is not a readable tar ({exc}); {REBUILD}") from None
    members = []
    for key, got in parts.items():
        images = [e for e in got if e in IMAGE_EXTS]
        if len(images) != 1 or label_ext not in got:
            raise UserError(f"{path_text(info.path)}: the sample {shown(key)} has members {sorted(got)}; a {task} "
                            f"sample is one image and a .{label_ext} label; {REBUILD}")
        members.append(Member(key, images[0], got[images[0]], got[label_ext], offsets[key]))
    if len(members) != info.samples:
        raise UserError(f"{path_text(info.path)} holds {len(members)} samples but the index says {info.samples}; "
                        f"{REBUILD}")
    return members


def read_shard(info: ShardInfo, task: str) -> list[Member]:
    """Read a whole shard (one sequential read), check its SHA-256 against the index, and parse it."""
    try:
        data = info.path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path_text(info.path)} cannot be read ({exc.strerror}); copy the set again") from None
    if hashlib.sha256(data).hexdigest() != info.sha256:
        raise UserError(f"{path_text(info.path)} does not match the SHA-256 its index lists: it was damaged or "
                        f"replaced after the set was written; copy it again from the original set, or {REBUILD}")
    return parse_shard(data, info, task)


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Add a file with fixed metadata, so the same samples always give the same bytes."""
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
    tar.addfile(ti, io.BytesIO(data))


class ShardWriter:
    """Writes a shard set into ``out`` (new or empty): ``add`` samples in order, ``close`` writes the index.

    Each shard is written to a temporary name and renamed when complete, the index last (atomically), so an
    interrupted conversion leaves no index and is never mistaken for a set. ``meta``: extra fields for the index.
    """

    def __init__(self, out: str | Path, task: str, samples_per_shard: int, meta: dict | None = None) -> None:
        if samples_per_shard < 1:
            raise UserError(f"--samples-per-shard {samples_per_shard}: use 1 or more")
        self.out, self.task, self.per_shard, self.meta = Path(out), task, samples_per_shard, dict(meta or {})
        if self.out.exists() and (not self.out.is_dir() or any(self.out.iterdir())):
            raise UserError(f"{self.out} is not empty; a shard set is written into a new or empty folder, so another "
                            "set or run is never overwritten; pick another path or remove it")
        missing = [p for p in (self.out, *self.out.parents) if not p.exists()]
        self.out.mkdir(parents=True, exist_ok=True)
        self._made = missing  # the folders this writer created, OUT first: removed again by discard()
        self.shards: list[dict] = []
        self.chars: set[str] = set()
        self.frames = 0  # the most CTC frames a word needs (recognition)
        self._tar: tarfile.TarFile | None = None
        self._file = None
        self._count = 0

    def add(self, key: str, image: bytes, ext: str, label: str | dict) -> None:
        """Append one sample: image bytes with their extension (``png``, ``jpg``...) and its label."""
        if not key or "." in key or "/" in key:
            raise ValueError(f"shard key {key!r} must be non-empty without '.' or '/'")
        if ext not in IMAGE_EXTS:
            raise ValueError(f"image extension {ext!r} is not one of {IMAGE_EXTS}")
        if self._tar is None:
            self._open()
        words = [label] if isinstance(label, str) else label.get("words", [])
        for w in words:
            self.chars.update(w)
            self.frames = max(self.frames, ctc_frames_needed(w))
        text = label if isinstance(label, str) else json.dumps(label, ensure_ascii=False, separators=(",", ":"))
        _tar_member(self._tar, f"{key}.{ext}", image)
        _tar_member(self._tar, f"{key}.{LABEL_EXT[self.task]}", text.encode("utf-8"))
        self._count += 1
        if self._count == self.per_shard:
            self._finish_shard()

    def _open(self) -> None:
        self._name = f"shard-{len(self.shards):06d}.tar"
        self._tmp = self.out / f".{self._name}.part"
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed in _finish_shard
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)

    def _finish_shard(self) -> None:
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        data = self._tmp.read_bytes()
        os.replace(self._tmp, self.out / self._name)
        self.shards.append({"name": self._name, "samples": self._count, "bytes": len(data),
                            "sha256": hashlib.sha256(data).hexdigest()})
        self._tar, self._file, self._count = None, None, 0

    def discard(self) -> None:
        """Remove what this writer wrote (a conversion that failed or was stopped): the shard being written, the
        finished shards, and ``out`` (with the folders above it) when it created it. Never raises OSError."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()  # its buffered bytes may fail to flush on a full disk: they are discarded anyway
            self._tar = self._file = None
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
        for shard in self.shards:
            with contextlib.suppress(OSError):
                os.unlink(self.out / shard["name"])
        self.shards = []
        for folder in self._made:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: anything else found there is not ours

    def close(self) -> Path:
        """Finish the last shard and write the index; returns the index's path."""
        if self._tar is not None:
            self._finish_shard()
        if not self.shards:
            raise UserError(f"no samples to write into {self.out}")
        doc = {"format": FORMAT, "version": VERSION, "task": self.task, "total": sum(s["samples"] for s in self.shards),
               "shards": self.shards, "chars": "".join(sorted(self.chars)), "ctc_frames": self.frames, **self.meta}
        from scale_ocr.disk import write_atomic

        index = self.out / INDEX
        write_atomic(index, json.dumps(doc, indent=1, ensure_ascii=False) + "\n", what="the shard set's index",
                     kept=f"the shards written in {self.out} (without an index they are not a set)")
        return index
