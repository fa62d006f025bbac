"""A shard set that is damaged, misnamed or of the other task is one line naming the problem and the fix
(docs/faults.md rows 110-117)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from conftest import make_folder

from scale_ocr.cli import make_shards as make_shards_module
from scale_ocr.cli.main import main as cli
from scale_ocr.cli.make_shards import make_shards
from scale_ocr.data import shards
from scale_ocr.data.shard_reader import DecodeWord, ShardTrain, open_pages, open_words
from scale_ocr.data.shards import INDEX, open_set
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
    _fails(lambda: _open(shard_set), "points outside")


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
