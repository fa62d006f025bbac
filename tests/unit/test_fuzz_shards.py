"""Property-based fuzzing of shard sets, through what a training run does with one (docs/faults.md, "Fuzzing").

Tiny sets are written once (make-shards' :class:`~scale_ocr.data.shards.ShardWriter`); each example copies one,
then replaces a field of ``shards.json`` (or of a shard's entry) by any JSON value (NaN and Infinity included),
mutates a shard's bytes with the index re-made to agree (as a tool that edits a set would), or hands a page label
of any JSON value to the writer and, hand-made, to the reader. Opening the set and reading every shard, for
training and for validation, returns or raises one UserError line (:mod:`test_fuzz_oracle`), never anything else.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
from conftest import SURFACE_EXAMPLES, make_folder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from test_fuzz_oracle import outcome
from test_shards_faults import _reindex

from scale_ocr.cli.make_shards import make_shards
from scale_ocr.data.shard_reader import ShardVal, open_pages, open_words
from scale_ocr.data.shards import INDEX, ShardWriter
from scale_ocr.vocab import Vocab

VOCAB = Vocab("abcdefgh")
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                    max_leaves=8)
FIELDS = ("format", "version", "task", "total", "shards", "chars", "ctc_frames", "seed", "shards.0.name",
          "shards.0.samples", "shards.0.bytes", "shards.0.sha256", "shards.1")
PAGE = {"polygons": [[[2, 2], [20, 2], [20, 10], [2, 10]]], "words": ["ab"], "img_dimensions": [24, 32]}
SLOW = settings(max_examples=SURFACE_EXAMPLES, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), "white").save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz_shards")
    words = make_folder(root / "words", {f"{i}.png": w for i, w in enumerate(["ab", "cd", "ef", "gh"])})
    make_shards([words], root / "recognition", None, 2, seed=0, on_bad="error")
    w = ShardWriter(root / "detection", "detection", 2)
    for i in range(3):
        w.add(f"{i:09d}", _png(), "png", PAGE)
    w.close()
    return {"recognition": root / "recognition", "detection": root / "detection"}


def _exercise(path: Path, task: str) -> None:
    """What training does with the set: open it, read every shard (train), index it (validation), decode."""
    for train in (True, False):
        ds = (open_words((str(path),), VOCAB, "error", None, (32, 128), train) if task == "recognition"
              else open_pages((str(path),), "error", None, train))
        if isinstance(ds, ShardVal):
            for i in range(len(ds)):
                ds[i]
        else:
            for s in range(len(ds.set.shards)):
                ds[(s, 0)]


def _run(sets: dict[str, Path], task: str, mutate) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "set"
        shutil.copytree(sets[task], path)
        mutate(path)
        outcome(_exercise, path, task)


@SLOW
@given(field=st.sampled_from(FIELDS), value=JSON, task=st.sampled_from(("recognition", "detection")))
def test_index_fields_of_any_value(sets, field, value, task):
    def mutate(path: Path) -> None:
        doc = json.loads((path / INDEX).read_text())
        *parents, key = field.split(".")
        target = doc
        for p in parents:
            target = target[int(p)] if p.isdigit() else target[p]
        if isinstance(target, list):
            target[int(key)] = value
        else:
            target[key] = value
        (path / INDEX).write_text(json.dumps(doc))  # NaN and Infinity as Python writes them
    _run(sets, task, mutate)


@SLOW
@given(offset=st.integers(0, 10**6), data=st.binary(min_size=1, max_size=64), cut=st.booleans(),
       task=st.sampled_from(("recognition", "detection")))
def test_shard_bytes_mutated_with_the_index_remade(sets, offset, data, cut, task):
    def mutate(path: Path) -> None:
        shard = path / "shard-000000.tar"
        b = bytearray(shard.read_bytes())
        at = offset % len(b)
        if cut:
            del b[at:]
            b += data
        else:
            b[at:at + len(data)] = data
        shard.write_bytes(bytes(b))
        _reindex(path)
    _run(sets, task, mutate)


@SLOW
@given(field=st.sampled_from(("polygons", "words", "img_dimensions", "img_hash")), value=JSON,
       text=st.none() | st.binary(max_size=16))
def test_page_labels_of_any_value_written_or_hand_made(sets, field, value, text):
    label = {**PAGE, field: value}
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter(Path(tmp) / "written", "detection", 2)
        outcome(writer.add, "000000000", _png(), "png", label)

    def mutate(path: Path) -> None:  # the first page's label member replaced, as another tool would write it
        shard = path / "shard-000000.tar"
        with tarfile.open(shard) as tar:
            members = [(ti, tar.extractfile(ti).read()) for ti in tar]
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for ti, old in members:
                new = (json.dumps(label).encode() if text is None else text) if ti.name == "000000000.json" else old
                ti.size = len(new)
                tar.addfile(ti, io.BytesIO(new))
        shard.write_bytes(out.getvalue())
        _reindex(path)
    _run(sets, "detection", mutate)
