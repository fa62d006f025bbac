"""A shard set that is damaged, misnamed or of the other task is one line naming the problem and the fix
(docs/faults.md rows 110-117)."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import math
import os
import tarfile
from pathlib import Path

import pytest
from conftest import make_folder
from PIL import Image

from scale_ocr.cli import make_shards as make_shards_module
from scale_ocr.cli.main import main as cli
from scale_ocr.cli.make_shards import make_shards
from scale_ocr.data import shards
from scale_ocr.data.shard_reader import DecodePage, DecodeWord, ShardTrain, ShardVal, open_pages, open_words
from scale_ocr.data.shards import INDEX, ShardWriter, open_set
from scale_ocr.errors import Terminated, UserError
from scale_ocr.vocab import Vocab


@pytest.fixture
def shard_set(tmp_path) -> Path:
    folder = make_folder(tmp_path / "words", {f"{i}.png": w for i, w in enumerate(["ab", "cd", "ef", "gh", "ij"])})
    make_shards([folder], tmp_path / "set", None, 2, seed=0, on_bad="error")
    return tmp_path / "set"


def _index(path: Path, **change) -> None:
    doc = json.loads((path / INDEX).read_text())
    doc.update(change)
    (path / INDEX).write_text(json.dumps(doc))


def _open(path: Path, vocab: str = "abcdefghij") -> None:
    open_words((str(path),), Vocab(vocab), "error", None, (32, 128), train=True)


def _fails(call, *words: str) -> str:
    with pytest.raises(UserError) as info:
        call()
    text = str(info.value)
    assert "\n" not in text and all(w in text for w in words), text
    return text


def test_missing_or_corrupt_index_is_one_line(shard_set):
    (shard_set / INDEX).rename(shard_set / "index.bak")
    _fails(lambda: _open(shard_set), "neither labels.json", "shards.json")
    (shard_set / INDEX).write_text("{not json")
    _fails(lambda: _open(shard_set), "is not valid JSON", "make-shards")
    (shard_set / INDEX).write_text(json.dumps({"format": "other"}))
    _fails(lambda: _open(shard_set), "not a scale-ocr shard index")


def test_set_of_the_other_task_or_version(shard_set):
    _fails(lambda: open_pages((str(shard_set),), "error", None, train=True), "a 'recognition' shard set",
           "trains detection")
    _index(shard_set, version=7)
    _fails(lambda: _open(shard_set), "format version 7")


def test_shard_path_escaping_the_set(shard_set, tmp_path):
    doc = json.loads((shard_set / INDEX).read_text())
    doc["shards"][0]["name"] = "../outside.tar"
    (shard_set / INDEX).write_text(json.dumps(doc))
    _fails(lambda: _open(shard_set), "'../outside.tar' is not a file name inside")
    os.replace(shard_set / "shard-000000.tar", tmp_path / "elsewhere.tar")
    os.symlink(tmp_path / "elsewhere.tar", shard_set / "shard-000000.tar")
    doc["shards"][0]["name"] = "shard-000000.tar"
    (shard_set / INDEX).write_text(json.dumps(doc))
    _fails(lambda: _open(shard_set), "is a symbolic link", "put the file itself there")


def test_truncated_or_missing_shard(shard_set):
    tar = shard_set / "shard-000001.tar"
    tar.write_bytes(tar.read_bytes()[:1000])
    _fails(lambda: _open(shard_set), "shard-000001.tar holds 1000 bytes", "truncated")
    tar.unlink()
    _fails(lambda: _open(shard_set), "is missing")


def test_shard_whose_sha256_differs(shard_set):
    tar = shard_set / "shard-000002.tar"
    data = bytearray(tar.read_bytes())
    data[700] ^= 0xFF  # inside the image's bytes: same size, other content
    tar.write_bytes(bytes(data))
    ds = ShardTrain(open_set(shard_set, "recognition"), DecodeWord(None))
    _fails(lambda: ds[(2, 0)], "does not match the SHA-256")


def test_shard_whose_count_or_members_differ(shard_set):
    doc = json.loads((shard_set / INDEX).read_text())
    doc["shards"][0]["samples"], doc["shards"][2]["samples"] = 1, 2  # the total still adds up
    (shard_set / INDEX).write_text(json.dumps(doc))
    ds = ShardTrain(open_set(shard_set, "recognition"), DecodeWord(None))
    _fails(lambda: ds[(0, 0)], "holds 2 samples but the index says 1")


def test_labels_outside_the_vocabulary_or_input(shard_set):
    _fails(lambda: _open(shard_set, vocab="abcdef"), "characters 'ghij' outside the vocabulary", "--vocab")
    _index(shard_set, ctc_frames=40)
    _fails(lambda: _open(shard_set), "needs 40 CTC frames", "widen --input-size")


def test_make_shards_refuses_a_non_empty_output_and_a_mix(shard_set, tmp_path, capsys):
    words = tmp_path / "words"
    assert cli(["make-shards", str(words), str(shard_set)]) == 2
    assert "is not empty" in capsys.readouterr().err
    mix = (str(shard_set), str(words))
    _fails(lambda: open_words(mix, Vocab("abcdefghij"), "error", None, None, train=True), "give one shard set")


def test_resume_from_another_sets_position(shard_set, tmp_path):
    """A checkpoint's position names its set (the index's SHA-256): resuming it on another set is refused."""
    ds = ShardTrain(open_set(shard_set, "recognition"), DecodeWord(None))
    p = ds.position(seed=0, world=1, rank=0, workers=0, batch=1, main=False)
    state = {**p.state(0, 1), "set": "0" * 64}
    _fails(lambda: p.restore(0, 1, state), "belongs to another shard set", "--resume none")


def _reindex(path: Path) -> None:
    """What a tool that edits a shard does: each shard's bytes and SHA-256 re-made in the index."""
    doc = json.loads((path / INDEX).read_text())
    for s in doc["shards"]:
        data = (path / s["name"]).read_bytes()
        s["bytes"], s["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (path / INDEX).write_text(json.dumps(doc))


def _replace_member(path: Path, shard: str, ext: str, data: bytes) -> None:
    """The first sample's ``ext`` member of ``shard`` replaced by ``data``, the index re-made to agree."""
    with tarfile.open(path / shard) as tar:
        members = [(ti, tar.extractfile(ti).read()) for ti in tar]
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        first = members[0][0].name.split(".")[0]
        for ti, old in members:
            new = data if ti.name == f"{first}.{ext}" else old
            ti.size = len(new)
            tar.addfile(ti, io.BytesIO(new))
    (path / shard).write_bytes(out.getvalue())
    _reindex(path)


def _entry(path: Path, i: int, **change) -> None:
    doc = json.loads((path / INDEX).read_text())
    doc["shards"][i].update(change)
    doc["total"] = sum(s["samples"] if isinstance(s["samples"], int) else 0 for s in doc["shards"])
    (path / INDEX).write_text(json.dumps(doc))


@pytest.mark.parametrize("change,words", [
    ({"samples": 10**12}, ["10000", "samples in", "bytes", "1 or more"]),  # S08: no permutation of that size
    ({"samples": 0}, ["with 0 samples"]),  # S09: a shard never read would never be checked
    ({"samples": -5}, ["with -5 samples"]),
    ({"samples": True}, ["malformed shard entry 0"]),
    ({"sha256": "x" * 64}, ["not a SHA-256 hex digest"]),
    ({"name": "shard-000001.tar"}, ["lists the shard 'shard-000001.tar' twice"]),
    ({"name": "\ud800.tar"}, ["is not a file name inside"]),
    ({"name": "a" * 300}, ["is not a file name inside"]),
], ids=["huge", "zero", "negative", "bool", "sha256", "twice", "surrogate", "long"])
def test_index_entries_are_typed_and_bounded_before_anything_is_allocated(shard_set, change, words):
    _entry(shard_set, 0, **change)
    _fails(lambda: open_set(shard_set, "recognition"), *words)


@pytest.mark.parametrize("raw,words", [
    ('"ctc_frames": "abc"', ["\"ctc_frames\" 'abc'", "whole number"]),  # S11
    ('"ctc_frames": Infinity', ["not valid JSON", "Infinity"]),
    ('"ctc_frames": null', ["\"ctc_frames\" None"]),
    ('"chars": 5', ["\"chars\" 5", "one string"]),
    ('"chars": [null]', ["\"chars\" [None]"]),
    ('"total": 5.0', ["says 5.0 samples"]),
], ids=["frames-str", "frames-inf", "frames-null", "chars-int", "chars-list", "total-float"])
def test_index_fields_of_the_wrong_type_are_one_line(shard_set, raw, words):
    doc = json.loads((shard_set / INDEX).read_text())
    key = raw.split('"')[1]
    del doc[key]
    (shard_set / INDEX).write_text(json.dumps(doc)[:-1] + ", " + raw + "}")
    _fails(lambda: _open(shard_set), *words)


def test_index_and_shards_are_read_as_themselves(shard_set, tmp_path):
    """No link is followed inside a set, and a FIFO never blocks the read."""
    os.replace(shard_set / INDEX, tmp_path / "elsewhere.json")
    os.symlink(tmp_path / "elsewhere.json", shard_set / INDEX)
    _fails(lambda: _open(shard_set), "is a symbolic link")
    os.replace(tmp_path / "elsewhere.json", shard_set / INDEX)
    (shard_set / "shard-000001.tar").unlink()
    os.mkfifo(shard_set / "shard-000001.tar")
    _fails(lambda: _open(shard_set), "is a named pipe")


def _read_every_shard(path: Path, vocab: str = "abcdefghij", input_size=(32, 128)) -> None:
    ds = open_words((str(path),), Vocab(vocab), "error", None, input_size, train=True)
    for s in range(len(ds.set.shards)):
        ds[(s, 0)]


def test_labels_the_index_leaves_out_are_refused_when_read(shard_set):
    """S14: an index whose "chars" omits a label's character passes the start, then its shard is refused whole
    when read, naming the shard, the sample and the character (never a KeyError in the vocabulary)."""
    _index(shard_set, chars="abcdefghi")
    _fails(lambda: _read_every_shard(shard_set, vocab="abcdefghi"), ".tar: the label 'ij' of the sample",
           "characters 'j' outside the vocabulary", "make-shards")


def test_labels_longer_than_the_index_says_are_refused_when_read(shard_set):
    """S15: an index understating the longest label: refused when read, never trained with a zero CTC loss."""
    _index(shard_set, ctc_frames=1)
    _fails(lambda: _read_every_shard(shard_set, input_size=(32, 4)), "needs 2 CTC frames", "gives 1",
           "widen --input-size")


def test_a_label_that_is_not_utf8_is_one_line(shard_set):
    """Z03: a label member of bytes that are not UTF-8 (the index re-made to agree)."""
    _replace_member(shard_set, "shard-000000.tar", "txt", b"\x80\xff")
    _fails(lambda: _read_every_shard(shard_set), "shard-000000.tar: the label of the sample", "is not UTF-8 text")
    _fails(lambda: ShardVal(open_set(shard_set, "recognition"), DecodeWord(None)), "is not UTF-8 text")


def _page_png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), "white").save(buf, format="PNG")
    return buf.getvalue()


GOOD_PAGE = {"polygons": [[[2, 2], [20, 2], [20, 10], [2, 10]]], "words": ["ab"], "img_dimensions": [24, 32]}
BAD_PAGES = {  # S22, S24: what the folder path refuses (faults rows F26, F28)
    "nan": ({"polygons": [[[math.nan, 2], [20, 2], [20, math.inf], [2, 10]]]}, "non-finite coordinate"),
    "dims": ({"img_dimensions": 5}, "\"img_dimensions\" of '000000001' is 5"),
    "no-dims": ({"img_dimensions": None}, "not [height, width]"),
    "outside": ({"polygons": [[[-500, -500], [9000, -500], [9000, 9000], [-500, 9000]]]}, "outside the 32x24 image"),
    "words": ({"words": ["a", "b"]}, "has 2 words for 1 polygons"),
}


def _page_set(path: Path, bad: dict | None = None) -> Path:
    w = ShardWriter(path, "detection", 2)
    for i in range(3):
        w.add(f"{i:09d}", _page_png(), "png", {**GOOD_PAGE, **(bad or {})} if i == 1 else GOOD_PAGE)
    w.close()
    return path


@pytest.mark.parametrize("bad", BAD_PAGES, ids=list(BAD_PAGES))
def test_shard_writer_checks_page_labels_as_a_folder_does(tmp_path, bad):
    change, words = BAD_PAGES[bad]
    _fails(lambda: _page_set(tmp_path / "set", change), "ShardWriter into", words)


def test_shard_writer_refuses_a_word_that_is_no_text(tmp_path):
    w = ShardWriter(tmp_path / "set", "recognition", 2)
    for label in ("", None, {"word": "a"}, "\ud800"):
        _fails(lambda label=label: w.add("k", b"png", "png", label), "a recognition label is a non-empty word")


@pytest.mark.parametrize("bad", BAD_PAGES, ids=list(BAD_PAGES))
def test_hand_made_page_labels_are_refused_when_read(tmp_path, bad):
    """A shard written by another tool is checked when read, as ShardWriter checks it."""
    change, words = BAD_PAGES[bad]
    path = _page_set(tmp_path / "set")
    label = {**GOOD_PAGE, **change}
    if "img_dimensions" in change and change["img_dimensions"] is None:
        del label["img_dimensions"]
    _replace_member(path, "shard-000000.tar", "json", json.dumps(label).encode())
    words = words.replace("000000001", "000000000")
    _fails(lambda: ShardVal(open_set(path, "detection"), DecodePage(None)), "shard-000000.tar", words, "make-shards")
    ds = ShardTrain(open_set(path, "detection"), DecodePage(None))
    _fails(lambda: ds[(0, 1)], words)  # the whole shard is checked before any of its pages is used


def test_resume_from_an_edited_position(shard_set):
    """A checkpoint's pending ranges outside the set's shards (trainer.json edited) are one line, not an IndexError
    or a permutation of an unchecked size."""
    ds = ShardTrain(open_set(shard_set, "recognition"), DecodeWord(None))
    p = ds.position(seed=0, world=1, rank=0, workers=0, batch=1, main=False)
    for pending in ([[0, 0, 10**12]], [[9, 0, 1]], [[0, 2, 1]], [["0", 0, 1]], "x"):
        state = {**p.state(0, 1), "pending": pending}
        _fails(lambda state=state: p.restore(0, 1, state), "names samples this shard set does not hold",
               "--resume none")


def _words(tmp_path: Path) -> Path:
    return make_folder(tmp_path / "words", {f"{i}.png": w for i, w in enumerate(["ab", "cd", "ef", "gh", "ij"])})


def test_make_shards_full_disk_removes_the_partial_set(tmp_path, capsys, monkeypatch):
    """S20: the disk fills while the second shard is written (one shard done, one .part open): one line, exit 74,
    and nothing of the set is left (OUT was new, so it goes too)."""
    words, calls = _words(tmp_path), []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shards.os, "fsync", fsync)
    assert cli(["make-shards", str(words), str(tmp_path / "new" / "set"), "--samples-per-shard", "2"]) == 74
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "could not write the shard set" in err and "(ENOSPC" in err, err
    assert "nothing is kept (the partial set" in err and sorted(p.name for p in tmp_path.iterdir()) == ["words"]


@pytest.mark.parametrize(("stop", "code", "line"), [(KeyboardInterrupt, 130, "interrupted (Ctrl-C); nothing is kept"),
                                                    (Terminated, 143, "stopped: SIGTERM received; nothing is kept")])
def test_make_shards_stopped_removes_the_partial_set(stop, code, line, tmp_path, capsys, monkeypatch):
    """S21: Ctrl-C or SIGTERM midway (shards written, one open): one line, its code, and an empty OUT the user made
    is left empty, as found."""
    words, read = _words(tmp_path), make_shards_module._image_bytes
    (tmp_path / "set").mkdir()

    def image_bytes(path: Path):
        if path.name == sorted((words / "images").iterdir())[-1].name:  # some shards are written by then
            raise stop()
        return read(path)

    monkeypatch.setattr(make_shards_module, "_image_bytes", image_bytes)
    assert cli(["make-shards", str(words), str(tmp_path / "set"), "--samples-per-shard", "1"]) == code
    err = capsys.readouterr().err.strip()
    assert err == f"scale-ocr: {line}: the partial set in {tmp_path / 'set'} was removed", err
    assert list((tmp_path / "set").iterdir()) == []
