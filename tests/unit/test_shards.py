"""Shard sets: the converter's round trip, and an exact data position across world sizes, workers and batches.

Real shard files and real DataLoader workers; every rank of a job is played in this process (the position is
arithmetic plus readers, no process group)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import make_folder
from PIL import Image
from torch.utils.data import DataLoader

from scale_ocr.cli.main import main as cli
from scale_ocr.cli.make_shards import make_shards
from scale_ocr.data import position as pos
from scale_ocr.data.detection import DetectionFolder
from scale_ocr.data.shard_reader import ShardTrain, ShardVal
from scale_ocr.data.shards import ShardWriter, open_set


class Key:
    """Decodes a member to its key only: what the position test counts."""

    def __call__(self, member, where):
        return member.key


def keys(batch):
    return batch


def _bytes_label(folder: Path) -> Counter:
    labels = json.loads((folder / "labels.json").read_text())
    return Counter(((folder / "images" / k).read_bytes(), v) for k, v in labels.items())


def test_words_round_trip(tmp_path):
    """Every crop of two folders comes back from the shards with the same bytes and word, once."""
    a = make_folder(tmp_path / "a", {f"{i}.png": w for i, w in enumerate(["one", "two", "three", "four", "five"])})
    b = make_folder(tmp_path / "b", {f"{i}.png": w for i, w in enumerate(["six", "seven", "eight"])})
    n, k, _ = make_shards([a, b], tmp_path / "set", None, 3, seed=1, on_bad="error")
    assert (n, k) == (8, 3)
    got = ShardVal(open_set(tmp_path / "set", "recognition"), lambda m, where: (m.image, m.label.decode()))
    assert Counter(got[i] for i in range(len(got))) == _bytes_label(a) + _bytes_label(b)
    again = tmp_path / "again"  # deterministic: the same folders and seed give the same bytes
    make_shards([a, b], again, None, 3, seed=1, on_bad="error")
    digest = [hashlib.sha256((d / "shard-000001.tar").read_bytes()).digest() for d in (tmp_path / "set", again)]
    assert digest[0] == digest[1]


def test_bad_samples_are_skipped_and_counted(tmp_path, capsys):
    """``--on-bad-sample skip``: a missing image is left out, counted in the summary line and in the index."""
    folder = make_folder(tmp_path / "w", {"a.png": "ab", "b.png": "cd", "gone.png": "ef"}, {"gone.png": None})
    assert cli(["make-shards", str(folder), str(tmp_path / "set"), "--on-bad-sample", "skip"]) == 0
    assert 'skipped 1 bad samples {"missing_image": 1}' in capsys.readouterr().out
    index = json.loads((tmp_path / "set" / "shards.json").read_text())
    assert index["total"] == 2 and index["skipped"] == {"missing_image": 1}


def test_folder_position_resumes_a_count(word_folder):
    """A folder run's position is a count of the epoch's global order, and an old checkpoint's count resumes it."""
    from scale_ocr.data.loader import FolderPosition, ResumableSampler
    from scale_ocr.data.recognition import RecognitionFolder
    from scale_ocr.vocab import Vocab

    ds = RecognitionFolder((str(word_folder),), Vocab("abcdefghijklmnopqrstuvwxyzTCO0123456789"))
    whole = list(ResumableSampler(ds, num_replicas=1, rank=0, seed=2, drop_last=True))
    p = FolderPosition(ResumableSampler(ds, num_replicas=1, rank=0, seed=2, drop_last=True), batch=2)
    p.set_epoch(0)
    assert p.state(0, 1) == {"kind": "folder", "epoch": 0, "samples_in_epoch": 2}
    p.restore(0, 6, None)  # a checkpoint from before data_position: samples_in_epoch only
    p.set_epoch(0)
    assert list(p.sampler) == whole[6:]


def _pages(root: Path, n: int) -> Path:
    (root / "images").mkdir(parents=True)
    labels = {}
    for i in range(n):
        Image.new("RGB", (64, 48), (40 * i, 90, 200)).save(root / "images" / f"p{i}.png")
        labels[f"p{i}.png"] = {"img_dimensions": [48, 64], "polygons": [[1.5, 2.25, 30, 20 + i]], "words": [f"w{i}"]}
    (root / "labels.json").write_text(json.dumps(labels))
    return root


def test_pages_round_trip(tmp_path):
    """A detection folder's pages come back with the same image bytes, polygons (float32 exactly) and words."""
    root = _pages(tmp_path / "pages", 3)
    make_shards([root], tmp_path / "set", None, 2, seed=0, on_bad="error")
    folder = DetectionFolder((str(root),))
    want = Counter((p.path.read_bytes(), p.polygons.tobytes(), tuple(p.words)) for p in folder.pages)
    got = ShardVal(open_set(tmp_path / "set", "detection"), lambda m, where: m)
    seen = Counter()
    for i in range(len(got)):
        m = got[i]
        label = json.loads(m.label)
        seen[(m.image, np.asarray(label["polygons"], np.float32).tobytes(), tuple(label["words"]))] += 1
        assert label["img_dimensions"] == [48, 64]
    assert seen == want


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    """103 tiny samples in shards of 7 (the last one 5): uneven on purpose."""
    out = tmp_path_factory.mktemp("shards") / "set"
    w = ShardWriter(out, "recognition", 7)
    png = (Path(__file__).parent / "no_such").name.encode()  # any bytes: the test's decoder never decodes them
    for i in range(103):
        w.add(f"k{i:04d}", png, "png", "w")
    w.close()
    return open_set(out, "recognition")


def _run(shards, state, epoch, world, workers, batch, m=None):
    """Every rank's first ``m`` batches (all when None) of the epoch's segment; the keys and the position after."""
    ds = ShardTrain(shards, Key())
    seen, states = [], []
    for rank in range(world):
        p = ds.position(seed=5, world=world, rank=rank, workers=workers, batch=batch, main=False)
        if state is not None:
            p.restore(epoch, state.get("samples_in_epoch", 0), state)
        p.set_epoch(epoch)
        loader = DataLoader(ds, batch_sampler=p, num_workers=workers, collate_fn=keys)
        take = len(p) if m is None else m
        for i, b in enumerate(loader):
            if i == take:
                break
            assert len(b) == batch
            seen += b
        states.append(p.state(epoch, take))
    assert all(s == states[0] for s in states)  # every rank computes the same position, without communicating
    return seen, states[0]


# (world, workers, batch) before the save -> after it: other world size, worker count, batch size.
CASES = [((2, 2, 4), (1, 0, 4)), ((1, 2, 2), (3, 2, 3)), ((4, 0, 2), (2, 2, 5))]


@pytest.mark.parametrize("before,after", CASES, ids=[f"{a}-to-{b}" for a, b in CASES])
def test_resume_at_another_world_size_sees_each_sample_once(shard_set, before, after):
    first, state = _run(shard_set, None, 0, *before, m=3)
    assert len(first) == 3 * before[0] * before[2]
    json.dumps(state)  # what the checkpoint stores: plain JSON
    rest, end = _run(shard_set, state, 0, *after)
    seen = Counter(first + rest)
    assert max(seen.values()) == 1
    left = pos.total([tuple(r) for r in end["pending"]])
    assert left == (103 - len(first)) % (after[0] * after[2])  # only the final segment's tail, less than a batch
    assert len(seen) + left == 103
    # The next epoch starts afresh with another order and covers the set again.
    nxt, _ = _run(shard_set, None, 1, *after)
    assert len(set(nxt)) == len(nxt) == 103 - 103 % (after[0] * after[2]) and nxt != sorted(nxt)


def test_old_checkpoint_counted_samples_only(shard_set):
    """A state with only ``samples_in_epoch`` (a folder run's, or older) skips that many of the epoch's order."""
    whole, _ = _run(shard_set, None, 0, 1, 0, 4)
    rest, _ = _run(shard_set, {"samples_in_epoch": 40}, 0, 1, 0, 4)
    assert rest == whole[40:40 + len(rest)]


@pytest.mark.parametrize("task", ["recognition", "detection"])
def test_tasks_build_loaders_from_a_set(task, tmp_path, word_folder):
    """Each task's build_data opens a set (train: the position's batches; validation: every sample, padded)."""
    import torch

    from scale_ocr.cli.args import parse_config
    from scale_ocr.distributed.process_group import DistInfo
    from scale_ocr.tasks import create_task

    if task == "recognition":
        make_shards([word_folder], tmp_path / "set", None, 3, seed=0, on_bad="error")
        flags = ["crnn_mobilenet_v3_small"]
    else:
        _pages(tmp_path / "pages", 5)
        make_shards([tmp_path / "pages"], tmp_path / "set", None, 2, seed=0, on_bad="error")
        flags = ["db_mobilenet_v3_large", "--input-size", "64x64"]
    cfg = parse_config([*flags, "-b", "2", "--train-path", str(tmp_path / "set"), "--val-path",
                        str(tmp_path / "set"), "--workers", "1", "--output-dir", str(tmp_path / "run")])
    t = create_task(cfg.model)
    data = t.build_data(cfg.data, 2, 0, DistInfo(1, 2, 1, 2, torch.device("cpu"), "gloo", "python"))
    data.position.set_epoch(0)
    batches = list(data.train_loader)
    assert len(batches) == len(data.train_loader) == data.num_train // 4 and all(len(b) == 2 for b in batches)
    val = [b for b in data.val_loader]
    assert sum(int(b.valid.sum()) for b in val) == data.num_val // 2  # rank 1's share of an odd count, padded
