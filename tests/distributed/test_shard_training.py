"""Training from a shard set under real 2-rank jobs, and a mid-epoch resume at world size 1 that neither repeats
nor skips a sample of the epoch (the keys each rank trained on are recorded by tests/helpers/keyed_train.py)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, fixture_dir, make_folder, python_train, read_metrics, torchrun_train

from scale_ocr.cli.make_shards import make_shards

KEYED = REPO / "tests" / "helpers" / "keyed_train.py"
SAMPLES = 38  # 2 ranks x 4: 4 batches a rank and a tail of 6; 2 steps, then world size 1 takes 5 batches, tail 2
BASE = ["-b", "4", "--log-every", "1", "--epochs", "1", "--sched", "constant", "--lr", "1e-3", "--wandb-mode",
        "disabled", "--workers", "1"]


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory) -> Path:
    with fixture_dir(tmp_path_factory, "shards") as root:
        folder = make_folder(root / "words", {f"{i}.png": f"w{i % 10}" for i in range(SAMPLES)})
        make_shards([folder], root / "set", None, 9, seed=3, on_bad="error")
        yield root / "set"


def _keys(run_dir: Path) -> list[str]:
    return [k for f in sorted(run_dir.glob("keys-rank*.txt")) for k in f.read_text().split()]


@pytest.mark.slow
def test_shards_resume_at_world_size_1(shard_set, tmp_path):
    """FSDP at 2 ranks trains 2 steps and saves; DDP in one process finishes the epoch from that checkpoint
    (validation from a set is the other tests')."""
    data = ["--train-path", str(shard_set), "--val-path", str(shard_set), "--no-eval"]
    first = tmp_path / "first"
    proc = torchrun_train([str(first), "--strategy", "fsdp", *BASE, *data, "--max-steps", "2", "--save-every", "2",
                           "--output-dir", str(first)], script=KEYED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("6 samples of the epoch's 38") == 1  # the tail, said once
    second = tmp_path / "second"
    proc = python_train([str(second), "--strategy", "ddp", *BASE, *data, "--workers", "2", "--output-dir", str(second),
                         "--resume", str(first / "checkpoints" / "step_00000002")], script=KEYED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _keys(first), _keys(second)
    assert len(a) == 16 and len(b) == 20
    assert len(set(a + b)) == 36  # each sample once; only the last segment's tail of 2 is left out
    assert read_metrics(second)["steps"] > 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_shards_train_under(strategy, shard_set, tmp_path):
    proc = torchrun_train([str(tmp_path), "--strategy", strategy, *BASE, "--train-path", str(shard_set),
                           "--val-path", str(shard_set), "--max-steps", "2", "--output-dir", str(tmp_path / "run")],
                          script=KEYED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    keys = _keys(tmp_path)
    assert len(keys) == len(set(keys)) == 16 and read_metrics(tmp_path / "run")["steps"] == 2


@pytest.mark.slow
def test_a_mix_trains_under_zero2_and_ddp_and_resumes_at_world_size_1_where_every_source_stood(shard_set, tmp_path):
    """A folder, the shard set and synthetic words at 1/2, 1/4, 1/4 (an epoch of 20 + 38 + 30 = 88 samples: 44, 22
    and 22 draws): ZeRO-2 at 2 ranks trains 2 steps and saves; DDP in one process finishes the epoch from there.
    Between them they train every draw once: each folder sample 2 or 3 times (its passes), 22 distinct shard samples;
    both runs say the mix, and the second reports what the run drew from each source. Every crop is read at its own
    width (--max-width: batches of several widths, padded), so the resume holds for own-width reading too."""
    folder = make_folder(tmp_path / "real", {f"{i}.png": f"fold{i:06d}" for i in range(20)})
    data = ["--train-path", f"{folder}=2", f"{shard_set}=1", "synthetic=1", "--train-samples", "30", "--max-chars",
            "4", "--no-eval", "--max-width", "128"]
    first = tmp_path / "first"
    proc = torchrun_train([str(first), "--strategy", "zero2", *BASE, *data, "--max-steps", "2", "--save-every", "2",
                           "--output-dir", str(first)], script=KEYED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training mix of 3 sources, 88 samples an epoch" in proc.stdout
    second = tmp_path / "second"
    proc = python_train([str(second), "--strategy", "ddp", *BASE, *data, "--output-dir", str(second),
                         "--resume", str(first / "checkpoints" / "step_00000002")], script=KEYED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _keys(first), _keys(second)
    assert len(a) == 16 and len(b) == 72
    real = Counter(k for k in a + b if k.startswith("fold"))
    shards = [k for k in a + b if k.isdigit() and len(k) == 9]
    assert sum(real.values()) == 44 and set(real.values()) <= {2, 3} and len(real) == 20
    assert len(shards) == len(set(shards)) == 22 and len(a + b) - 44 - 22 == 22  # the rest: synthetic words
    drawn = {str(folder): 44, str(shard_set): 22, "synthetic": 22}
    assert read_metrics(second)["data_drawn"] == drawn and "drawn=[" in proc.stdout
    sources = json.loads((second / "config.json").read_text())["dataset"]["sources"]
    assert [(s["source"], s["weight"], s["draws_per_epoch"]) for s in sources] == [
        (str(folder), 0.5, 44), (str(shard_set), 0.25, 22), ("synthetic", 0.25, 22)]


@pytest.mark.slow
def test_pixel_batches_resume_at_world_size_1_with_every_line_once(tmp_path):
    """--batch-pixels: crops 77 to 256 px wide (at height 32) in micro-batches of up to 32 x 1,024 pixels. DDP at 2
    ranks trains 2 steps and saves; one process finishes the epoch from that checkpoint. Each rank took its
    micro-batch of each round of the plan, and between them the runs trained every crop the epoch's plan deals out
    once: the plan at 2 ranks for the first 2 rounds, then the plan at 1 rank over the crops not yet trained."""
    from PIL import Image

    from scale_ocr.data.pixel_batches import PixelPlan
    from scale_ocr.data.transforms import ResizeHeight

    labels = {f"{i}.png": ("ab" * 6)[: 2 + i % 11] + f"{i:03d}" for i in range(60)}  # 5 to 16 characters
    folder = make_folder(tmp_path / "lines", labels)
    data = ["--train-path", str(folder), "--no-eval", "--max-width", "256", "--batch-pixels", str(32 * 1024)]
    first = tmp_path / "first"
    proc = torchrun_train([str(first), "--strategy", "ddp", *BASE, *data, "--max-steps", "2", "--save-every", "2",
                           "--output-dir", str(first)], script=KEYED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--batch-pixels 32768: " in proc.stdout and "crops a micro-batch on average" in proc.stdout
    second = tmp_path / "second"
    proc = python_train([str(second), "--strategy", "ddp", *BASE, *data, "--output-dir", str(second),
                         "--resume", str(first / "checkpoints" / "step_00000002")], script=KEYED)
    assert proc.returncode == 0, proc.stderr[-3000:]

    names = list(labels)
    widths = [ResizeHeight(32, 256).width(Image.open(folder / "images" / n).size) for n in names]
    two = PixelPlan(widths, 32, 32 * 1024, world=2, seed=0)
    rounds = two.rounds(0)[0][:2]
    for rank in range(2):
        took = (first / f"keys-rank{rank}.txt").read_text().split()
        assert took == [labels[names[i]] for rnd in rounds for i in rnd[rank]]
    one = PixelPlan(widths, 32, 32 * 1024, world=1, seed=0)
    rest, tail = one.rounds(0, two.positions(0, rounds))
    assert _keys(second) == [labels[names[i]] for rnd in rest for i in rnd[0]]
    trained = _keys(first) + _keys(second)
    assert len(trained) == len(set(trained)) == 60 - tail and tail < 10
