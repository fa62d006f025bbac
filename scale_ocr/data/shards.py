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
import re
import tarfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from scale_ocr.data.detection import SKIP, stored_page
from scale_ocr.data.files import BadSample
from scale_ocr.disk import JSON_LIMIT, GiB, open_user_file, read_user_bytes, refuse_json_constant
from scale_ocr.errors import JSON_ERRORS, UserError, json_problem, printable, shown
from scale_ocr.models.recognition.ctc import ctc_frames_needed

INDEX = "shards.json"
FORMAT = "scale-ocr-shards"
VERSION = 1
IMAGE_EXTS = ("png", "jpg", "jpeg", "webp", "tif", "tiff", "bmp")
LABEL_EXT = {"recognition": "txt", "detection": "json"}
REBUILD = "rebuild it with `scale-ocr make-shards`"
SHARD_LIMIT = 16 * GiB  # a shard is read whole into a loader worker's memory; make-shards writes a few MB each
MIN_SAMPLE_BYTES = 1024  # two tar members (an image and a label), each at least its 512-byte header


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
    return shown(path)  # a path: up to errors.PATH_LIMIT characters


def is_shard_set(path: str | Path) -> bool:
    """``path`` holds an index (a link or FIFO named shards.json too: :func:`open_set` refuses it in one line)."""
    return os.path.lexists(Path(path) / INDEX)


def _bad_index(index: Path, why: str) -> UserError:
    return UserError(f"{path_text(index)} {why}; {REBUILD}")


def _count(value: object) -> bool:
    """A JSON whole number (not a bool, not a float)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _shard_path(root: Path, index: Path, name: object) -> Path:
    """The shard file an index entry names, refused when it is no plain file name inside the set."""
    plain = (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\x00")
             and _encodable(name) and len(os.fsencode(name)) <= 255)
    if not plain:
        raise UserError(f"{path_text(index)}: the shard name {shown(name)} is not a file name inside "
                        f"{path_text(root)}; a set's index names its shards by file name only; {REBUILD}")
    return root / name


def _encodable(name: str) -> bool:
    try:
        os.fsencode(name)
    except UnicodeEncodeError:  # a lone surrogate from JSON's \ud800: no file name spells it
        return False
    return True


def _stat_shard(path: Path, index: Path) -> int:
    """The shard's size, from its descriptor: a link, a FIFO, a device or a file over SHARD_LIMIT is refused."""
    missing = f"{path_text(path)}, listed in {path_text(index)}, is missing; copy the whole set, or {REBUILD}"
    with open_user_file(path, what="the shard", limit=SHARD_LIMIT, missing=missing) as f:
        return os.fstat(f.fileno()).st_size


def _entry(root: Path, index: Path, i: int, entry: object) -> ShardInfo:
    """One index entry as a typed record, checked against the file it names (present, its size) before anything
    is allocated from its count."""
    keys = {"name": str, "samples": int, "bytes": int, "sha256": str}
    if not isinstance(entry, dict) or any(not isinstance(entry.get(k), t) or isinstance(entry.get(k), bool)
                                          for k, t in keys.items()):
        raise _bad_index(index, f"has a malformed shard entry {i} ({shown(entry, 80)}; each needs name, samples, bytes "
                                "and sha256)")
    name, samples, size, digest = entry["name"], entry["samples"], entry["bytes"], entry["sha256"]
    path = _shard_path(root, index, name)
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise _bad_index(index, f"lists the shard {shown(name)} with sha256 {shown(digest, 80)}, not a SHA-256 hex "
                                "digest")
    if samples < 1 or samples * MIN_SAMPLE_BYTES > size:
        raise _bad_index(index, f"lists the shard {shown(name)} with {shown(samples, 40)} samples in {shown(size, 40)} "
                                f"bytes; a shard holds 1 or more samples, each at least {MIN_SAMPLE_BYTES} bytes of "
                                "tar (an image and a label member)")
    actual = _stat_shard(path, index)
    if actual != size:
        raise UserError(f"{path_text(path)} holds {actual} bytes but {path_text(index)} says {size}: it is truncated "
                        f"or was replaced; copy it again from the original set, or {REBUILD}")
    return ShardInfo(name, path, samples, size, digest)


def _header(doc: object, root: Path, index: Path, task: str) -> None:
    """The index's format, version and task, and the recognition fields its checks use (``chars``, ``ctc_frames``)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad_index(index, f"is not a scale-ocr shard index (no \"format\": \"{FORMAT}\")")
    if doc.get("version") != VERSION or isinstance(doc.get("version"), bool):
        raise UserError(f"{path_text(index)} is format version {shown(doc.get('version'), 40)}; this scale-ocr reads "
                        f"version {VERSION}; {REBUILD}")
    if doc.get("task") != task:
        raise UserError(f"{path_text(root)} is a {shown(doc.get('task'), 40)} shard set but this model trains {task}; "
                        f"pass a {task} set, or a model of that task")
    if task == "recognition" and not isinstance(doc.get("chars"), str):
        raise _bad_index(index, f"has \"chars\" {shown(doc.get('chars'), 40)}; a recognition set's index lists the "
                                "characters of its labels as one string")
    frames = doc.get("ctc_frames")
    if task == "recognition" and not (_count(frames) and frames > 0):
        raise _bad_index(index, f"has \"ctc_frames\" {shown(frames, 40)}; a recognition set's index gives the most CTC "
                                "frames a label needs, a whole number of 1 or more")


def open_set(path: str | Path, task: str) -> ShardSet:
    """Read and check a set's index as typed records before anything is allocated from it: format, task, its
    fields' types, each shard a plain file inside the set, at its listed size, with 1 or more samples that its size
    can hold, listed once.

    Contents (SHA-256, sample count, labels) are checked when a shard is read (:func:`read_shard`); every listed
    shard holds samples, so every one is read in an epoch.
    """
    root = Path(path)
    index = root / INDEX
    raw = read_user_bytes(index, what="the shard index", limit=JSON_LIMIT,
                          missing=f"{path_text(index)} is missing; a shard set holds shards.json and its tar files "
                          "(`scale-ocr make-shards` writes them)")
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=refuse_json_constant)
    except JSON_ERRORS as exc:
        raise _bad_index(index, f"is not valid JSON ({json_problem(exc)})") from None
    _header(doc, root, index, task)
    entries = doc.get("shards")
    if not isinstance(entries, list) or not entries:
        raise _bad_index(index, "lists no shards")
    names = Counter(e["name"] for e in entries if isinstance(e, dict) and isinstance(e.get("name"), str))
    twice = next((n for n, c in names.items() if c > 1), None)
    if twice is not None:
        raise _bad_index(index, f"lists the shard {shown(twice)} twice; each shard is listed once")
    shards = [_entry(root, index, i, e) for i, e in enumerate(entries)]
    total = sum(s.samples for s in shards)
    if not _count(doc.get("total")) or doc["total"] != total:
        raise _bad_index(index, f"says {shown(doc.get('total'), 40)} samples but its shards add up to {total}")
    return ShardSet(root, task, shards, hashlib.sha256(raw).hexdigest(), doc)


def page_label(where: str, key: str, entry: object, then: str = "") -> tuple[np.ndarray, list[str], tuple[int, int]]:
    """A page label checked as a detection folder's scan checks it (:func:`~scale_ocr.data.detection.stored_page`),
    or one line, ``then`` added to its fix."""
    try:
        return stored_page(where, key, entry)
    except BadSample as exc:
        raise UserError(str(exc).removesuffix(SKIP).rstrip(" ,;") + (f"; {then}" if then else "")) from None


def _label(task: str, where: str, key: str, label: object) -> str | dict:
    """A label ``ShardWriter.add`` was given, as the set stores it, checked as a folder's scan checks it."""
    if task == "recognition":
        if not isinstance(label, str) or not label or not _utf8(label):
            raise UserError(f"{where}: the label of {shown(key)} is {shown(label, 80)}; a recognition label is a "
                            "non-empty word of Unicode text")
        return label
    quads, words, (w, h) = page_label(where, key, label)
    if not all(_utf8(word) for word in words):
        raise UserError(f"{where}: a word of {shown(key)} is not Unicode text (a lone surrogate); fix the label")
    return {"polygons": quads.tolist(), "words": words, "img_dimensions": [h, w]}


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        why = printable(str(exc), 120)
        raise UserError(f"{path_text(info.path)} is not a readable tar ({why}); {REBUILD}") from None
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
        data = read_user_bytes(info.path, what="the shard", limit=SHARD_LIMIT)
    except OSError as exc:  # the read itself failed (EIO): open_user_file's checks passed
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
        """Append one sample: image bytes with their extension (``png``, ``jpg``...) and its label (a word, or a
        page's ``polygons``, ``words`` and ``img_dimensions``), refused in one line where a folder's would be."""
        if not key or "." in key or "/" in key:
            raise ValueError(f"shard key {key!r} must be non-empty without '.' or '/'")
        if ext not in IMAGE_EXTS:
            raise ValueError(f"image extension {ext!r} is not one of {IMAGE_EXTS}")
        label = _label(self.task, f"ShardWriter into {path_text(self.out)}", key, label)
        if self._tar is None:
            self._open()
        words = [label] if isinstance(label, str) else label["words"]
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
        self._file = open(self._tmp, "xb")  # noqa: SIM115 - closed in _finish_shard; x: never through a link
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
