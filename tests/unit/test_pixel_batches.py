"""Micro-batches filled to a pixel budget (scale_ocr.data.pixel_batches): full, balanced across ranks, deterministic,
and resumable at another world size with every sample trained once."""

from __future__ import annotations

import numpy as np
import pytest

from scale_ocr.data.pixel_batches import PixelPlan

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


def test_a_budget_below_the_widest_sample_is_refused(widths):
    with pytest.raises(ValueError, match="cannot hold the widest sample's"):
        PixelPlan(widths, HEIGHT, 1000, world=2, seed=0)
