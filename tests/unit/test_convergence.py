"""The convergence benchmark's pieces: its real-looking words, curves, thresholds and verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks import convergence, real_words
from scale_ocr.data.synthetic import system_fonts
from scale_ocr.vocab import resolve_vocab


def test_real_looking_words_use_none_of_the_synthetic_fonts_and_stay_in_the_vocabulary(tmp_path):
    faces = real_words.fonts()
    assert faces and not {Path(f).name for f in faces} & {Path(f).name for f in system_fonts()}
    latin = set(resolve_vocab("latin", None))
    for i in range(200):
        word = real_words.text(np.random.default_rng([0, i]))
        assert 1 <= len(word) <= 12 and set(word) <= latin, word
    folder = real_words.write(tmp_path / "train", 6, seed=3)
    labels = json.loads((folder / "labels.json").read_text())
    again = real_words.write(tmp_path / "again", 6, seed=3)
    assert labels == json.loads((again / "labels.json").read_text())  # depends only on (seed, index)
    assert (folder / "images" / "000000.jpg").read_bytes() == (again / "images" / "000000.jpg").read_bytes()


def _row(set_name, recipe, ems, every=10):
    curve = [{"step": every * (i + 1), "seconds": 5.0 * (i + 1), "exact_match": em} for i, em in enumerate(ems)]
    return {"set": set_name, "recipe": recipe, "status": "ok", "curve": curve, "epochs": 2, "steps": every * len(ems),
            "train_words": 100, "wall_seconds": 60.0, "world_size": 2, "threads_per_rank": 1, "batch_size": 4,
            "eval_every": every, "arch": "crnn", "hardware": {"cpu": "x"}, "versions": {"git": "abc"}}


def test_report_gives_steps_to_each_threshold_and_the_verdicts(tmp_path):
    rows = [_row("synthetic", "defaults", [0.2, 0.6, 0.85, 0.91]), _row("synthetic", "bare", [0.1, 0.5, 0.9, 0.95]),
            _row("real", "defaults", [0.3, 0.7]), _row("real", "bare", [0.4, 0.72])]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert convergence.reached(rows[0]["curve"], 0.8)["step"] == 30
    assert convergence.reached(rows[2]["curve"], 0.9) is None
    text = convergence.build_report(tmp_path).read_text()
    assert "| synthetic (100 words) | defaults | 2 (40) | 20 (10 s) | 30 (15 s) | 40 (20 s) | 0.910 | 0.910 |" in text
    assert "defaults reach 90% at step 40, the bare loop at 30: FAIL" in text
    assert "defaults 0.700 vs bare 0.720: FAIL" in text
    assert (tmp_path / "curves.png").is_file()
    rows[1]["curve"][2]["exact_match"] = 0.89  # the bare loop now reaches 90% at step 40, as the defaults do
    assert "PASS" in convergence.verdicts(rows)[0]
    for r in rows[2:]:  # neither recipe learned the real-looking set: nothing to compare, never a pass
        r["curve"][-1]["exact_match"] = 0.0
    assert "INCONCLUSIVE" in convergence.verdicts(rows)[1]


def test_curves_are_read_from_the_trainers_metrics_and_the_hand_loops_file(tmp_path):
    trainer = tmp_path / "metrics.jsonl"
    trainer.write_text("\n".join(json.dumps(r) for r in [
        {"step": 10, "time": 105.0, "train/loss": 3.0}, {"step": 64, "time": 130.0, "val/exact_match": 0.25}]))
    hand = tmp_path / "curve.jsonl"
    hand.write_text(json.dumps({"step": 64, "time": 120.5, "exact_match": 0.5}) + "\n")
    assert convergence.read_curve(trainer, 100.0) == [{"step": 64, "seconds": 30.0, "exact_match": 0.25}]
    assert convergence.read_curve(hand, 100.0) == [{"step": 64, "seconds": 20.5, "exact_match": 0.5}]
