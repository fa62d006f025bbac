"""Property-based fuzzing of ``scale-ocr summary RUN_DIR`` (docs/faults.md, "Fuzzing"; probe cases U02, U06).

A run directory is a user's input: one field of config.json or metrics.json (or the whole document) replaced by
any JSON value, the files as arbitrary bytes, metrics.jsonl as any lines. The command's ``main`` runs in this
process; it returns 0 having printed only printable lines, or raises one UserError line (:mod:`test_fuzz_oracle`).
The plot is not drawn here (a render takes 0.2 s): what would be plotted is checked instead, every point a finite
value of bounded size against a whole step.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import tempfile
from pathlib import Path

import pytest
from conftest import SURFACE_EXAMPLES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_oracle import outcome
from test_summary import CONFIG, CURVES, METRICS, write_run

from scale_ocr.cli import summary

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70), st.floats(),
                    st.sampled_from([1e308, -0.0, 2**63, 2**64, "", "\x1b[2J\nscale-ocr: FAKE\x07", "\u202e", "$x^$",
                                     "vitstr_tiny", "db_resnet50", "\ud800"]), st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=6)
CONFIG_KEYS = ["", "model", "model.arch", "task", "num_params", "argv", "world_size", "output", "output.output_dir",
               "logging", "logging.wandb_mode", "lr_plan", "lr_plan.line", "dataset", "dataset.num_val"]
METRIC_KEYS = ["", "strategy", "world_size", "global_batch", "steps", "epochs", "wall_seconds", "samples_per_sec",
               "exact_match", "best_exact_match", "ci_match", "cer", "launcher", "backend", "device"]
SETTINGS = settings(max_examples=SURFACE_EXAMPLES, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture
def no_drawing(monkeypatch):
    """summary's plot replaced by a check of what it would draw."""

    def check(curves, run, out):
        for steps, values in curves.series.values():
            assert len(steps) == len(values)
            assert all(isinstance(s, int) and 0 <= s < summary.STEP_LIMIT for s in steps)
            assert all(math.isfinite(v) and abs(v) <= summary.VALUE_LIMIT for v in values)
        return out

    monkeypatch.setattr(summary, "plot_curves", check)


def _put(doc: object, dotted: str, value: object) -> object:
    """``doc`` with the field ``dotted`` set to ``value`` (the whole document for ``""``)."""
    if not dotted:
        return value
    node = doc
    *parents, last = dotted.split(".")
    for p in parents:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[last] = value
    return doc


def _summary_of(config: bytes, metrics: bytes, curves: bytes) -> None:
    """``summary.main`` on a run holding these files: returns, printing only printable lines, or one UserError."""
    with tempfile.TemporaryDirectory() as tmp:
        run = write_run(Path(tmp) / "run", curves=curves)
        (run / "config.json").write_bytes(config)
        (run / "metrics.json").write_bytes(metrics)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code, _ = outcome(summary.main, [str(run)])
        for line in out.getvalue().splitlines():
            assert line.isprintable(), f"printed raw: {line[:200]!r}"
        assert code in (0, None)


def _dumps(doc: object) -> bytes:
    return json.dumps(doc).encode("utf-8", "surrogatepass")


def _curves() -> bytes:
    return b"".join(_dumps(r) + b"\n" for r in CURVES)


@SETTINGS
@given(key=st.sampled_from(CONFIG_KEYS), value=JSON)
def test_summary_of_any_config_field(no_drawing, key, value):
    _summary_of(_dumps(_put(copy.deepcopy(CONFIG), key, value)), _dumps(METRICS), _curves())


@SETTINGS
@given(key=st.sampled_from(METRIC_KEYS), value=JSON)
def test_summary_of_any_metrics_field(no_drawing, key, value):
    _summary_of(_dumps(CONFIG), _dumps(_put(copy.deepcopy(METRICS), key, value)), _curves())


LINES = st.one_of(JSON.map(_dumps), st.binary(max_size=40),
                  st.fixed_dictionaries({"step": SCALARS, "train/loss": SCALARS, "val/exact_match": SCALARS,
                                         "val/val_loss": JSON}).map(_dumps))


@SETTINGS
@given(lines=st.lists(LINES, max_size=6), torn=st.booleans())
def test_summary_of_any_metrics_jsonl(no_drawing, lines, torn):
    curves = b"\n".join(lines) + (b"" if torn else b"\n")
    _summary_of(_dumps(CONFIG), _dumps(METRICS), curves)


@SETTINGS
@given(which=st.sampled_from(["config", "metrics"]), data=st.binary(max_size=200) | JSON.map(_dumps).map(
    lambda b: b[: len(b) // 2]))
def test_summary_of_run_files_of_any_bytes(no_drawing, which, data):
    config, metrics = _dumps(CONFIG), _dumps(METRICS)
    _summary_of(data if which == "config" else config, data if which == "metrics" else metrics, _curves())
