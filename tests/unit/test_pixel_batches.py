"""Micro-batches filled to a pixel budget (scale_ocr.data.pixel_batches): full, balanced across ranks, deterministic,
and resumable at another world size with every sample trained once."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

from scale_ocr.data.pixel_batches import PixelPlan, PixelPosition, bucketed
from scale_ocr.errors import UserError
from scale_ocr.train import main as train_main

HEIGHT, BUDGET = 32, 32 * 1024 * 16  # 16 of the widest lines


@pytest.fixture(scope="module")
def widths() -> np.ndarray:
    return np.random.default_rng(0).integers(8, 257, 3000) * 4  # lines 32 to 1,028 pixels wide


def test_micro_batches_fill_the_budget_and_ranks_get_near_equal_pixels(widths):
    plan = PixelPlan(widths, HEIGHT, BUDGET, world=2, seed=3, pool=1024)
    rounds, tail = plan.rounds(0)
    pixels = np.array([[plan.pixels(b) for b in r] for r in rounds])
    assert pixels.max() <= BUDGET and pixels.mean() > 0.95 * BUDGET
    assert np.median(abs(pixels[:, 0] - pixels[:, 1]) / pixels.max(axis=1)) < 0.02
    used = sum(int(widths[i]) * HEIGHT for r in rounds for b in r for i in b)
    assert used / pixels.sum() > 0.95  # padding: a few percent, where a batch of 16 in random order pads ~45%
    assert sum(len(b) for r in rounds for b in r) + tail == len(widths)
    assert plan.rounds(0) == (rounds, tail) and plan.rounds(1)[0] != rounds  # seeded per epoch


def test_a_resume_at_another_world_size_trains_every_sample_once(widths):
    two = PixelPlan(widths, HEIGHT, BUDGET, world=2, seed=3, pool=1024)
    rounds, _ = two.rounds(0)
    bitmap = two.consumed(two.positions(0, rounds[:17]))
    one = PixelPlan(widths, HEIGHT, BUDGET, world=1, seed=3, pool=1024)
    rest, tail = one.rounds(0, one.expand(bitmap))
    before = [i for r in rounds[:17] for b in r for i in b]
    after = [i for r in rest for b in r for i in b]
    assert len(before) + len(after) + tail == len(set(before + after)) + tail == len(widths)


def test_micro_batches_pad_to_width_buckets_so_their_shapes_are_few(widths):
    """Planned from bucketed widths, a round's micro-batches come in a few dozen (samples, columns) shapes, not one
    per width; the collate pads each to the bucket the plan counted, never past the model's widest input, and keeps
    every crop's own width for the masks."""
    from scale_ocr.tasks.recognition import Collate
    from scale_ocr.vocab import Vocab

    def shapes(plan_widths) -> set[tuple[int, int]]:
        plan = PixelPlan(plan_widths, HEIGHT, BUDGET, world=2, seed=3, pool=1024)
        return {(len(b), max(plan_widths[i] for i in b)) for r in plan.rounds(0)[0] for b in r}

    padded = [bucketed(int(w), 1024, 32) for w in widths]  # --width-bucket 32
    assert set(padded) == set(range(32, 1025, 32))  # 32 widths, the last one the cap
    few, many = shapes(padded), shapes([int(w) for w in widths])
    assert len(few) <= 2 * len(set(padded)) and 2 * len(few) < len(many), (len(few), len(many))  # 33 and 88
    pad = functools.partial(bucketed, widest=1000, bucket=32)
    images = [torch.zeros(3, HEIGHT, w) for w in (70, 100)]
    batch = Collate(Vocab("ab"), own_width=True, pad=pad)([(im, "ab", True) for im in images])
    assert batch.images.shape[-1] == 128 and batch.widths.tolist() == [70, 100]
    assert pad(999) == 1000  # a bucket past the widest input stops at it


def test_a_budget_below_the_widest_sample_is_refused(widths):
    with pytest.raises(ValueError, match="cannot hold the widest sample's"):
        PixelPlan(widths, HEIGHT, 1000, world=2, seed=0)


def test_the_position_continues_at_another_world_size_and_counts_each_steps_samples(widths):
    """What a checkpoint stores (a bitmap of the consumed crops) takes a 1-rank job on from where 2 ranks stopped;
    each step's samples are what every rank took; a checkpoint of -b batches mid-epoch is refused in one line."""
    two = PixelPosition(PixelPlan(widths, HEIGHT, BUDGET, world=2, seed=3, pool=1024), rank=1)
    two.set_epoch(0)
    assert two.samples(0, 2) == sum(len(b) for rnd in two.rounds[:2] for b in rnd)
    state = json.loads(json.dumps(two.state(0, 5)))  # as trainer.json holds it
    assert state["samples_in_epoch"] == two.samples(0, 5) and len(state["consumed"]) == 4 * -(-len(widths) // 24)
    one = PixelPosition(PixelPlan(widths, HEIGHT, BUDGET, world=1, seed=3, pool=1024), rank=0)
    one.restore(0, state["samples_in_epoch"], state)
    one.set_epoch(0)
    before = {i for rnd in two.rounds[:5] for b in rnd for i in b}
    after = [i for b in one for i in b]
    assert not before & set(after) and len(before) + len(after) + one.tail == len(widths)
    with pytest.raises(UserError, match="batches of -b samples, whose order --batch-pixels does not continue"):
        one.restore(0, 64, {"kind": "folder", "epoch": 0, "samples_in_epoch": 64})


@pytest.mark.parametrize("argv, says", [
    (["--batch-pixels", "40000"], "which --max-width PX turns on"),
    (["--max-width", "256", "--batch-pixels", "40000"], "synthetic words and mixes do not"),
    (["--max-width", "256", "--batch-pixels", "40000", "--noise-every", "5"], "compares batches of fixed sizes"),
    (["--max-width", "256", "--batch-pixels", "0"], "--batch-pixels 0: use 1 or more"),
    (["--max-width", "256", "--batch-pixels", "40000", "--width-bucket", "6"], "--width-bucket 6: use a multiple of 4"),
    (["--max-width", "256", "--width-bucket", "32"], "--width-bucket pads the micro-batches --batch-pixels fills"),
    (["--max-width", "256", "--batch-pixels", "1000", "--train-path", "FOLDER"], "cannot hold the widest training"),
])
def test_what_pixel_batches_cannot_do_is_refused_in_one_line(argv, says, word_folder, tmp_path, capsys):
    argv = [str(word_folder) if a == "FOLDER" else a for a in argv]
    assert train_main([*argv, "--output-dir", str(tmp_path / "run"), "--wandb-mode", "disabled"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
