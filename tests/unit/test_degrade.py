"""Degradations real scans and renders show (scale_ocr/data/degrade.py, ``--degrade NAME=P ...``)."""

import numpy as np
import pytest
import torch

from scale_ocr.cli.args import parse_config
from scale_ocr.config import ModelConfig
from scale_ocr.data import degrade
from scale_ocr.data.synthetic import render_word, system_fonts
from scale_ocr.errors import UserError
from scale_ocr.tasks import create_task


def test_each_degradation_changes_a_word_as_seeded_and_only_at_its_probability():
    """Each named degradation, at probability 1, changes a rendered word (the size kept, a turn aside) the same way
    under the same torch seed; at 0 nothing is drawn or changed; a recognizer's training transform applies them
    first and is then no longer cached; a name, a probability, or a geometric degradation on pages (text would
    leave its boxes) that cannot work is refused in one line, when the run's config is read."""
    word = render_word("Degrade", np.random.default_rng(0), system_fonts())
    base = np.asarray(word)
    for name in degrade.NAMES:
        ops = degrade.Degrade(degrade.parse([f"{name}=1"]))
        torch.manual_seed(3)
        once = np.asarray(ops(word))
        torch.manual_seed(3)
        assert np.array_equal(once, np.asarray(ops(word))), name
        assert once.shape == base.shape or name == "rotate", name
        assert once.shape != base.shape or np.abs(once.astype(int) - base).mean() > 0.5, name
    off = degrade.Degrade(degrade.parse(["blur=0", "jpeg=0"]))
    assert not off and off(word) is word
    task = create_task(ModelConfig(arch="crnn_mobilenet_v3_small"))
    plain, degraded = task.transform(train=True, augment=False), task.transform(True, False, ("noise=1", "jpeg=0.5"))
    assert plain.deterministic and not degraded.deterministic
    assert degraded(word).shape == plain(word).shape == (3, 32, 128)
    for flags, words in (
            (["--degrade", "smudge=0.2"], "no degradation 'smudge'; give NAME=PROBABILITY with NAME one of ink, "),
            (["--degrade", "blur=2"], "the probability it is applied to an image, from 0 to 1"),
            (["--degrade", "blur"], "the probability it is applied"),
            (["db_mobilenet_v3_large", "--degrade", "rotate=0.2"], "a page's words would leave their labelled boxes")):
        with pytest.raises(UserError, match=words):
            parse_config(flags)
    assert parse_config(["db_mobilenet_v3_large", "--degrade", "blur=0.2", "jpeg=0.1"]).data.degrade == (
        "blur=0.2", "jpeg=0.1")
