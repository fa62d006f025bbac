"""Shared fixtures: slow-test gating, tiny docTR folders, and launching real training processes."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

from scale_ocr.distributed.extensions import use_environment_extensions
from scale_ocr.distributed.process_group import free_port

REPO = Path(__file__).resolve().parents[1]
use_environment_extensions()  # DeepSpeed's ops as `make install` built them, in-process and in every job
TRAIN = REPO / "scale_ocr" / "train.py"
HOOKED_TRAIN = REPO / "tests" / "helpers" / "hooked_train.py"  # train.py with test hooks (see its docstring)
BIN = Path(sys.executable).parent

# Tiny, fast settings shared by every launched run. The rate is pinned: runs are compared across engines to float
# noise, which Adam magnifies in proportion to it, so it must not move with the model's recommended default.
TINY = ["--max-steps", "6", "--train-samples", "64", "--val-samples", "16", "-b", "4", "--log-every", "2",
        "--max-chars", "5", "--lr", "1e-3"]


def _full() -> bool:
    return os.environ.get("SCALE_OCR_FULL_TESTS", "0") not in ("", "0")


# Hypothesis profiles for the property-based fuzz tests (tests/unit/test_fuzz_*.py, docs/faults.md "Fuzzing"):
# "fast" in `make test`, "full" (5x the examples) under SCALE_OCR_FULL_TESTS=1, as CI runs. Both derandomize: the
# examples are a function of each test's source, so a red CI run is the same run on any machine (CI keeps no
# example database to replay from) and a green one stays green until the code or the test changes. To hunt for
# new inputs: `pytest --hypothesis-profile explore tests/unit/test_fuzz_*.py` (random, many; failures kept under
# $TMPDIR/scale-ocr-hypothesis, outside the tree).
# No deadline: a shared 2-core machine times examples too noisily for one.
settings.register_profile("fast", max_examples=60, deadline=None, derandomize=True, database=None, print_blob=True)
settings.register_profile("full", settings.get_profile("fast"), max_examples=150)
settings.register_profile("explore", max_examples=2000, deadline=None, print_blob=True,
                          database=DirectoryBasedExampleDatabase(Path(tempfile.gettempdir()) / "scale-ocr-hypothesis"))
settings.load_profile("full" if _full() else "fast")
# The fuzz targets of the commands' own input surfaces (make-dataset, shards, summary, estimate-memory, the
# launcher's environment, training's inputs; issue 55) run in-process and fast: 60 examples a property in `make
# test`, the 2,000 under FULL=1 (about 100 s for the six files; the whole suite took 16 minutes on 2 cores,
# 2026-12-07). SCALE_OCR_SURFACE_EXAMPLES sets another count (docs/faults.md "Fuzzing").
SURFACE_EXAMPLES = int(os.environ.get("SCALE_OCR_SURFACE_EXAMPLES", "0")) or (2000 if _full() else 60)


# The most the suite holds on disk at once: each passing test's folder goes when it ends (pyproject's
# tmp_path_retention_policy), each shared fixture's when its tests are done (`fixture_dir`). Measured: 0.74 GiB at
# the peak of `make test FULL=1` (df, every 2 s, 2026-12-06), against 7.1 GB kept before (CI ran out of disk).
PEAK_GIB = {"fast": 0.5, "full": 1.0}


def pytest_sessionstart(session):
    """Refuse to start, in one line, where the temporary folder has less room than the suite's peak: out of disk,
    every later test fails by the dozen and pytest's own capture file ends the run with an internal error."""
    where = Path(tempfile.gettempdir())
    need = PEAK_GIB["full" if _full() else "fast"]  # the measured peak and a quarter GiB more for pytest's own files
    free = shutil.disk_usage(where).free / 2**30
    if free < need:
        pytest.exit(f"only {free:.1f} GiB free in {where}; the tests need about {need:.1f} GiB there: free some "
                    f"space, or point TMPDIR at a disk with room", returncode=2)
    # A shell starts a background job (`make test &`, `nohup`) with Ctrl-C ignored, every process it starts inherits
    # that, and Python then leaves it ignored: the tests that send SIGINT to a command (and expect its exit 130)
    # would find it ignored, the command finishing as if never interrupted. Their commands get Ctrl-C back.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextmanager
def fixture_dir(factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A shared (module or session) fixture's folder, removed when the fixture ends: pytest keeps those to the
    end of the session, and a full run's would add up to gigabytes."""
    path = factory.mktemp(name)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if _full():
        return
    skip = pytest.mark.skip(reason="slow: run with `make test FULL=1` (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # Collection imported torch, DeepSpeed, docTR and every test module: about a million objects that live as long
    # as the session. Frozen, they are left out of every later full collection, each of which would walk them all
    # again (0.5-0.7 s each, dozens in a session); the tests' own objects are collected as before.
    gc.collect()
    gc.freeze()


def _shm_buffers() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("deepspeed_allreduce_buffer_*")} if shm.is_dir() else set()


@pytest.fixture(autouse=True)
def leaves_shm_as_found():
    """Every job, finished or killed, leaves /dev/shm as it found it (DeepSpeed's CPU all-reduce files)."""
    before = _shm_buffers()
    yield
    left = sorted(_shm_buffers() - before)
    assert not left, f"DeepSpeed shared-memory files left behind: {left}"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = str(REPO)
    env.pop("OMP_NUM_THREADS", None)  # each rank takes cores / local ranks (a user's value would be honoured)
    env.setdefault("WANDB_MODE", "disabled")
    return env


def run_cmd(cmd: list[str], timeout: int = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repository root and capture its output."""
    return subprocess.run(cmd, cwd=REPO, env=env or _env(), capture_output=True, text=True, timeout=timeout)


def python_train(args: list[str], script: Path = TRAIN, **kw) -> subprocess.CompletedProcess:
    """``python scale_ocr/train.py ARGS`` as a user types it (``script``: a launcher in its place)."""
    return run_cmd([sys.executable, str(script), *args], **kw)


def torchrun_train(args: list[str], nproc: int = 2, script: Path = TRAIN, **kw) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N scale_ocr/train.py ARGS``: real ranks over gloo on 127.0.0.1."""
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script), *args]
    return run_cmd(cmd, **kw)


def deepspeed_train(args: list[str], ngpus: int = 2, **kw) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus N scale_ocr/train.py ARGS`` (CPU ranks when there is no GPU)."""
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(ngpus), "--master_port", str(free_port()), str(TRAIN), *args]
    return run_cmd(cmd, **kw)


def read_metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def read_jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def make_folder(root: Path, labels: dict[str, object], images: dict[str, bytes | None] | None = None) -> Path:
    """A docTR recognition folder; words in ``labels`` are rendered unless ``images`` overrides them."""
    import numpy as np

    from scale_ocr.data.synthetic import render_word, system_fonts

    (root / "images").mkdir(parents=True, exist_ok=True)
    images = images or {}
    for i, (name, word) in enumerate(labels.items()):
        if name in images:
            if images[name] is not None:
                (root / "images" / name).write_bytes(images[name])
            continue
        render_word(str(word) or "x", np.random.default_rng(i), system_fonts()).save(root / "images" / name)
    (root / "labels.json").write_text(json.dumps(labels), encoding="utf-8")
    return root


@pytest.fixture
def word_folder(tmp_path: Path) -> Path:
    words = ["hello", "world", "scale", "ocr42", "Text", "CTC", "gloo", "rank"]
    return make_folder(tmp_path / "words", {f"{i}.png": w for i, w in enumerate(words)})


# Runs that save and resume: a constant learning rate makes a run stopped at step 4 identical to the first
# 4 steps of a longer one.
CKPT_BASE = ["--train-samples", "64", "--val-samples", "16", "-b", "4", "--log-every", "2", "--max-chars", "5",
             "--epochs", "2", "--max-steps", "6", "--wandb-mode", "disabled", "--sched", "constant", "--lr", "1e-3"]


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """``saved(strategy)``: the step-4 checkpoint of a 2-rank run of 6 steps under that strategy, trained once per
    session (the resume matrix, whose reference curve is ddp's run, and the export test share them)."""
    cache: dict[str, Path] = {}

    def get(strategy: str) -> Path:
        if strategy not in cache:
            run_dir = tmp_path_factory.mktemp(f"saved_{strategy}")
            cache[strategy] = run_dir / "checkpoints" / "step_00000004"
            proc = torchrun_train(["--strategy", strategy, *CKPT_BASE, "--save-every", "4",
                                   "--output-dir", str(run_dir)])
            assert proc.returncode == 0, proc.stderr[-3000:]
        return cache[strategy]

    yield get
    for step in cache.values():
        shutil.rmtree(step.parents[1], ignore_errors=True)
