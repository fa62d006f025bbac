"""Training and validation from a shard set (:mod:`scale_ocr.data.shards`), and the one data-source opener.

Training hands each loader worker a contiguous piece of the epoch (:class:`ShardPosition`), so a worker reads each
shard whole once; validation indexes every member at open and reads each image by its offset, in any order.
"""

from __future__ import annotations

import io
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from scale_ocr.data import position as pos
from scale_ocr.data.files import PAGE_LIMITS, WORD_LIMITS, BadImage, ScanReport, load_image
from scale_ocr.data.shards import (
    INDEX,
    REBUILD,
    SHARD_LIMIT,
    Member,
    ShardSet,
    is_shard_set,
    open_set,
    page_label,
    path_text,
    read_shard,
)
from scale_ocr.disk import open_user_file
from scale_ocr.errors import JSON_ERRORS, UserError, say, shown


def _image(member: Member, where: Path, limits):
    try:
        return load_image(io.BytesIO(member.image), limits)
    except BadImage as exc:
        raise UserError(f"{path_text(where)}: the sample {shown(member.key)} {exc}; {REBUILD}") from None


def _text(member: Member, where: Path) -> str:
    try:
        return member.label.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path_text(where)}: the label of the sample {shown(member.key)} is not UTF-8 text; "
                        f"{REBUILD}") from None


class DecodeWord:
    """A recognition member -> ``(transform(crop), word)``; :meth:`label` checks a word as a folder's scan does
    (not empty, inside ``vocab``, within the CTC frames of ``input_size``), whatever the set's index says."""

    def __init__(self, transform, vocab=None, input_size: tuple[int, int] | None = None,
                 own_width: bool = False) -> None:
        self.transform, self.vocab, self.input_size, self.own_width = transform, vocab, input_size, own_width

    def label(self, member: Member, where: Path) -> str:
        from scale_ocr.models.recognition.ctc import ctc_frames, ctc_frames_needed

        word = _text(member, where)
        of = f"{path_text(where)}: the label {shown(word, 80)} of the sample {shown(member.key)}"
        if not word:
            raise UserError(f"{path_text(where)}: the sample {shown(member.key)} has an empty label; {REBUILD}")
        unknown = self.vocab.unknown_chars(word) if self.vocab is not None else ""
        if unknown:
            raise UserError(f"{of} has characters {shown(unknown)} outside the vocabulary, which the set's {INDEX} "
                            "does not list (it does not describe its shards); add them with --vocab/--vocab-file and "
                            f"{REBUILD}")
        need = ctc_frames_needed(word)
        if self.input_size is not None and need > ctc_frames(self.input_size):
            raise UserError(f"{of} needs {need} CTC frames but a {self.input_size[1]}-pixel-wide input gives "
                            f"{ctc_frames(self.input_size)} (the set's {INDEX} understates its longest label); widen "
                            f"--input-size, and {REBUILD}")
        return word

    def __call__(self, member: Member, where: Path):
        word = self.label(member, where)
        img = _image(member, where, WORD_LIMITS)
        if self.own_width and self.input_size is not None:
            from scale_ocr.data.recognition import own_frames_problem

            if short := own_frames_problem(word, img.size, self.input_size):
                raise UserError(f"{path_text(where)}: the label {shown(word, 80)} of the sample {shown(member.key)} "
                                f"{short}; raise --max-width (a set is checked as a whole)")
        return (self.transform(img) if self.transform else img), word


class DecodePage:
    """A detection member -> ``transform(page, polygons (N, 4, 2) float32, words)``; :meth:`label` checks a page
    label as a folder's scan does (:func:`~scale_ocr.data.detection.stored_page`), the page's size when decoded."""

    def __init__(self, transform) -> None:
        self.transform = transform

    def label(self, member: Member, where: Path):
        text = _text(member, where)
        try:
            entry = json.loads(text)
        except JSON_ERRORS:
            raise UserError(f"{path_text(where)}: the label of {shown(member.key)} is not JSON; {REBUILD}") from None
        return page_label(path_text(where), member.key, entry, f"a set is checked whole: {REBUILD}")

    def __call__(self, member: Member, where: Path):
        polygons, words, (w, h) = self.label(member, where)
        img = _image(member, where, PAGE_LIMITS)
        if (img.width, img.height) != (w, h):
            raise UserError(f"{path_text(where)}: the page {shown(member.key)} is {img.width}x{img.height} but its "
                            f"label says {w}x{h}; {REBUILD}")
        return self.transform(img, polygons, words) if self.transform else (img, polygons, words)


def _checked(members: list[Member], decode, where: Path) -> list[Member]:
    """A shard's members, every label checked by ``decode.label`` (when it has one) before any sample is used."""
    check = getattr(decode, "label", None)
    if check is not None:
        for m in members:
            check(m, where)
    return members


class ShardTrain(Dataset):
    """A shard set for training: items are ``(shard, member)`` pairs, chosen by :class:`ShardPosition`.

    Each loader worker keeps the shard it reads (and the one before, across a piece's boundary) in memory.
    """

    def __init__(self, shards: ShardSet, decode) -> None:
        self.set, self.decode = shards, decode
        self.report = ScanReport(kept=shards.total)
        self._cache: OrderedDict[int, list[Member]] = OrderedDict()

    def __len__(self) -> int:
        return self.set.total

    def _members(self, shard: int) -> list[Member]:
        if shard not in self._cache:
            info = self.set.shards[shard]
            self._cache[shard] = _checked(read_shard(info, self.set.task), self.decode, info.path)
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return self._cache[shard]

    def __getitem__(self, item: tuple[int, int]):
        shard, member = item
        return self.decode(self._members(shard)[member], self.set.shards[shard].path)

    def position(self, seed: int, world: int, rank: int, workers: int, batch: int, main: bool) -> ShardPosition:
        return ShardPosition(self.set, seed, world, rank, workers, batch, main)


class ShardVal(Dataset):
    """A shard set for validation: every member indexed at open (each shard read and checked once)."""

    def __init__(self, shards: ShardSet, decode) -> None:
        self.set, self.decode = shards, decode
        self.report = ScanReport(kept=shards.total)
        self.items: list[tuple[int, Member, int]] = []  # (shard, member without its image, image bytes)
        for i, info in enumerate(shards.shards):
            for m in _checked(read_shard(info, shards.task), decode, info.path):
                self.items.append((i, Member(m.key, m.ext, b"", m.label, m.offset), len(m.image)))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        shard, m, size = self.items[index]
        info = self.set.shards[shard]
        # checked whole at open; a file changed since fails to decode, in one line
        with open_user_file(info.path, what="the shard", limit=SHARD_LIMIT) as f:
            f.seek(m.offset)
            image = f.read(size)
        return self.decode(Member(m.key, m.ext, image, m.label, m.offset), info.path)


class ShardPosition:
    """The training position over a shard set (:class:`~scale_ocr.data.loader.Position`), and this rank's batch
    sampler (see :mod:`scale_ocr.data.position`)."""

    def __init__(self, shards: ShardSet, seed: int, world: int, rank: int, workers: int, batch: int,
                 main: bool) -> None:
        self.set, self.seed, self.world, self.rank, self.workers, self.batch = shards, seed, world, rank, workers, batch
        self.main, self.reported_tail = main, 0
        self.restored: tuple[int, list[pos.Range]] | None = None
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Start the epoch, or its rest when a restored position belongs to it."""
        self.epoch = epoch
        self._orders.clear()
        if self.restored is not None and self.restored[0] == epoch:
            pending = self.restored[1]
        else:
            pending = pos.epoch_ranges(self.set.counts, self.seed, epoch)
        self.restored = None
        self.segment = pos.Segment(pending, self.world, self.workers, self.batch)
        self.pieces = self.segment.worker_pieces(self.rank)
        tail = self.segment.tail
        if tail and tail != self.reported_tail and self.main:
            say(f"scale-ocr: note: {tail} samples of the epoch's {pos.total(pending)} do not fill a global batch "
                f"of {self.world * self.batch} and are left out of it (as DistributedSampler's drop_last)", err=True)
        self.reported_tail = tail

    def _order(self, shard: int) -> np.ndarray:
        if shard not in self._orders:
            self._orders[shard] = pos.sample_order(self.set.counts[shard], self.seed, self.epoch, shard)
            while len(self._orders) > 4 * max(1, self.workers):
                self._orders.popitem(last=False)
        return self._orders[shard]

    def __len__(self) -> int:
        return self.segment.batches

    def __iter__(self):
        for worker, b in self.segment.batch_order(self.rank):
            ranges = pos.cut(self.pieces[worker], b * self.batch, (b + 1) * self.batch)
            yield [(s, int(self._order(s)[p])) for s, lo, hi in ranges for p in range(lo, hi)]

    def state(self, epoch: int, consumed_batches: int) -> dict:
        """What is left of the epoch after this segment's first ``consumed_batches`` batches (world-size free)."""
        if epoch != self.epoch:  # the next epoch, not started yet: all of it
            return {"kind": "shards", "set": self.set.digest, "epoch": epoch, "samples_in_epoch": 0}
        rest = self.segment.remaining(consumed_batches)
        return {"kind": "shards", "set": self.set.digest, "epoch": self.epoch, "pending": [list(r) for r in rest],
                "samples_in_epoch": self.set.total - pos.total(rest)}

    def restore(self, epoch: int, samples_in_epoch: int, state: dict | None) -> None:
        """Continue ``epoch`` where a checkpoint left it; a position from another set is refused."""
        if state and state.get("kind") == "shards" and "pending" in state and state.get("epoch") == epoch:
            if state.get("set") != self.set.digest:
                raise UserError(f"the checkpoint's data position belongs to another shard set than {self.set.root} "
                                f"(its {INDEX} differs); resume with the set it trained on, or pass --resume none")
            pending = _pending(state["pending"], self.set.counts)
        else:  # a checkpoint of a folder run, or from before positions: the epoch's first samples were consumed
            whole = pos.epoch_ranges(self.set.counts, self.seed, epoch)
            pending = pos.cut(whole, samples_in_epoch, pos.total(whole))
        self.restored = (epoch, pending)


def _pending(ranges: object, counts: list[int]) -> list[pos.Range]:
    """A checkpoint's pending ranges of this set, each ``[shard, lo, hi]`` inside its shard (the set's digest
    matched, so another value means an edited trainer.json)."""
    def fits(r: object) -> bool:
        return (isinstance(r, list) and len(r) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in r)
                and 0 <= r[0] < len(counts) and 0 <= r[1] <= r[2] <= counts[r[0]])

    if not isinstance(ranges, list) or not all(fits(r) for r in ranges):
        raise UserError("the checkpoint's data position (pending in trainer.json) names samples this shard set does "
                        "not hold; it was edited: resume from another checkpoint, or pass --resume none")
    return [(r[0], r[1], r[2]) for r in ranges]


def _open_shards(paths: tuple[str, ...], task: str) -> ShardSet | None:
    """The shard set ``paths`` name, None for docTR folders; a mix or several sets are refused."""
    sets = [p for p in paths if is_shard_set(p)]
    if not sets:
        for p in paths:
            if Path(p).is_dir() and not (Path(p) / "labels.json").exists():
                raise UserError(f"{p} holds neither labels.json (a docTR folder) nor {INDEX} (a shard set); pass one "
                                "of those")
        return None
    if len(paths) > 1:
        raise UserError(f"{', '.join(paths)}: give one shard set, or docTR folders, not several sets or a mix; "
                        "`scale-ocr make-shards` writes several folders into one set")
    return open_set(paths[0], task)


def open_words(paths: tuple[str, ...], vocab, on_bad_sample: str, transform, input_size, train: bool,
               own_width: bool = False) -> Dataset:
    """Word or line crops from docTR recognition folders or a recognition shard set (its labels checked as a whole;
    ``own_width``: each crop's frames at its own width too)."""
    from scale_ocr.data.recognition import RecognitionFolder
    from scale_ocr.models.recognition.ctc import ctc_frames

    shards = _open_shards(paths, "recognition")
    if shards is None:
        return RecognitionFolder(paths, vocab, on_bad_sample, transform, input_size, own_width)
    unknown = vocab.unknown_chars(shards.meta["chars"])  # typed by open_set; each label is checked when read
    if unknown:
        raise UserError(f"{path_text(shards.root)}: its labels use characters {shown(unknown)} outside the vocabulary "
                        "(a set is checked as a whole, --on-bad-sample cannot skip inside it); add them with "
                        "--vocab/--vocab-file")
    need = shards.meta["ctc_frames"]
    if input_size is not None and need > ctc_frames(input_size):
        raise UserError(f"{path_text(shards.root)}: its longest label needs {need} CTC frames but a "
                        f"{input_size[1]}-pixel-wide input gives {ctc_frames(input_size)}; widen --input-size")
    return (ShardTrain if train else ShardVal)(shards, DecodeWord(transform, vocab, input_size, own_width))


def open_pages(paths: tuple[str, ...], on_bad_sample: str, transform, train: bool) -> Dataset:
    """Pages from docTR detection folders or a detection shard set."""
    from scale_ocr.data.detection import DetectionFolder

    shards = _open_shards(paths, "detection")
    if shards is None:
        return DetectionFolder(paths, on_bad_sample, transform)
    return (ShardTrain if train else ShardVal)(shards, DecodePage(transform))
