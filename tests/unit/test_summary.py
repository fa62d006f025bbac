"""``scale-ocr summary RUN_DIR``: the one screen ``make demo`` ends with, read back from a real run's files."""

from __future__ import annotations

import json
import os
import shlex
import tracemalloc
from pathlib import Path

import pytest

from scale_ocr.cli.main import main as cli_main
from scale_ocr.cli.summary import read_curves
from tests.conftest import python_train

TINY = ["--train-samples", "32", "--val-samples", "8", "-b", "8", "--epochs", "2", "--max-chars", "4",
        "--eval-every", "2", "--log-every", "1", "--wandb-mode", "offline", "--resume", "none"]


def test_summary_of_a_real_run(tmp_path, capsys):
    """Every line the issue asks for, from what a real (tiny) run wrote: strategy, world size, global batch, time and
    accuracy; the run dir; the W&B offline run with a `wandb sync` command naming a folder that exists; a PNG of the
    curves; and the same job under fsdp and zero3, its flags kept and only the strategy and output dir changed."""
    run_dir = tmp_path / "run"
    args = [*TINY, "--grad-accum", "2", "--noise-every", "1"]  # two batch sizes: the noise scale is measured
    proc = python_train([*args, "--output-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run_dir / "config.json").read_text())["argv"] == [*args, "--output-dir", str(run_dir)]
    assert cli_main(["summary", str(run_dir)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "world size 1" in lines["strategy"] and "global batch 16" in lines["strategy"]
    assert " 4 steps" in lines["trained"] and "exact_match" in lines["accuracy"] and "on 8 held-out" in out
    noise = json.loads((run_dir / "metrics.json").read_text())["noise_scale"]
    assert (noise["b_small"], noise["b_big"], noise["readings"]) == (8, 16, 4)
    assert f"B_simple {noise['b_simple']:.0f} at the end (micro-batch 8 against global 16, 4 readings" in lines["noise"]
    sync = lines["W&B"].split("wandb sync ")[1].rstrip(")")
    assert (run_dir / "wandb").is_dir() and sync.startswith(str(run_dir / "wandb" / "offline-run-"))
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for strategy in ("fsdp", "zero3"):
        cmd = shlex.split(out.split(f"under {strategy}")[1].splitlines()[0])
        assert cmd[:4] == ["torchrun", "--nproc_per_node", "1", "scale_ocr/train.py"]
        assert cmd[4:] == [*args, "--strategy", strategy, "--output-dir", f"{run_dir}-{strategy}"]


def test_summary_of_no_run_is_one_line(tmp_path, capsys):
    """A folder that holds no finished run: exit 2 and one line naming the missing file, no traceback."""
    assert cli_main(["summary", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json does not exist" in err[0] and "--output-dir" in err[0]


# --- A run directory is a user's input (docs/faults.md U01-U09): written by hand here, no training ---------------

CONFIG = {"model": {"arch": "vitstr_tiny", "input_size": [16, 64]}, "task": "recognition", "num_params": 17259,
          "argv": ["vitstr_tiny", "--epochs", "2", "--output-dir", "RUN"], "world_size": 1,
          "output": {"output_dir": "RUN"}, "logging": {"wandb_mode": "offline"},
          "lr_plan": {"line": "lr 1e-3 unscaled"}, "dataset": {"num_val": 8}}
METRICS = {"strategy": "single", "world_size": 1, "global_batch": 8, "steps": 8, "epochs": 2, "wall_seconds": 61.5,
           "samples_per_sec": 812.4, "exact_match": 0.25, "ci_match": 0.5, "cer": 0.3, "best_exact_match": 0.5,
           "launcher": "python", "backend": "gloo", "device": "cpu", "val_loss": float("nan")}
CURVES = [{"step": 1, "train/loss": 8.8}, {"step": 2, "train/loss": 7.7},
          {"step": 2, "val/val_loss": 8.1, "val/exact_match": 0.25}]


def write_run(run_dir: Path, config: object = None, metrics: object = None, curves: bytes | None = None) -> Path:
    """A run directory as train.py leaves it, for summary: config.json, metrics.json and metrics.jsonl."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    (run_dir / "metrics.json").write_text(json.dumps(METRICS if metrics is None else metrics))
    (run_dir / "metrics.jsonl").write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in CURVES)
                                            if curves is None else curves)
    return run_dir


def _summary(capsys, *argv: str) -> tuple[int, list[str], str]:
    """``scale-ocr summary ARGV`` in this process: its exit code, stdout's lines and stderr's one error line."""
    code = cli_main(["summary", *argv])
    out, err = capsys.readouterr()
    errors = [ln for ln in err.splitlines() if ln.startswith("scale-ocr: error:")]
    assert "Traceback" not in err and (code == 0 or len(errors) == 1), err
    return code, out.splitlines(), errors[0] if errors else ""


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "precious.txt"
    path.write_text("precious\n")
    return path


@pytest.mark.parametrize("name", [".curves.png.tmp.png", ".curves.png.tmp{pid}"])  # {pid}: this process's, at run time
def test_a_planted_link_beside_the_plot_is_never_written_through(tmp_path, capsys, victim, name):
    """U01: the plot goes to a temp file opened O_EXCL|O_NOFOLLOW and renamed, not to a predictable name through a
    link; the link's target keeps its bytes and curves.png is a real PNG, not the link."""
    run = write_run(tmp_path / "run")
    (run / name.format(pid=os.getpid())).symlink_to(victim)
    code, _, _ = _summary(capsys, str(run))
    assert code == 0 and victim.read_text() == "precious\n"
    assert not (run / "curves.png").is_symlink() and (run / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_a_curves_png_link_is_refused_in_one_line(tmp_path, capsys, victim):
    run = write_run(tmp_path / "run")
    (run / "curves.png").symlink_to(victim)
    code, _, err = _summary(capsys, str(run))
    assert code == 2 and "curves.png is a symbolic link" in err and victim.read_text() == "precious\n"


def test_every_value_shown_is_escaped(tmp_path, capsys):
    """U02: config and metrics strings, argv and a W&B folder's name holding ESC, OSC, BEL and newlines are shown
    escaped, each line of the summary one line (no forged ``scale-ocr:`` line, no cursor or title control)."""
    evil = "x\x1b[2J\x1b]0;title\x07\nscale-ocr: FAKE\r\u202e"
    config = {**CONFIG, "task": evil, "argv": [*CONFIG["argv"], "--name", evil], "lr_plan": {"line": evil}}
    metrics = {**METRICS, "strategy": evil, "launcher": evil, "backend": evil, "device": evil}
    run = write_run(tmp_path / "run", config, metrics)
    (run / "wandb" / f"offline-run-{evil}").mkdir(parents=True)
    code, lines, _ = _summary(capsys, str(run))
    assert code == 0 and len(lines) == 11 and all(ln.isprintable() for ln in lines), lines
    assert not any(ln.startswith("scale-ocr:") for ln in lines[1:]) and "\\x1b[2J" in lines[2]


@pytest.mark.parametrize("plant", ["fifo", "dev_zero"])
def test_a_run_file_that_is_not_a_regular_file_is_one_line(tmp_path, capsys, plant):
    """U03, U04: config.json a FIFO (used to block forever), a link to /dev/zero (read until memory ran out):
    one line, before a byte is read."""
    run = write_run(tmp_path / "run")
    (run / "config.json").unlink()
    if plant == "fifo":
        os.mkfifo(run / "config.json")
    else:
        (run / "config.json").symlink_to("/dev/zero")
    code, _, err = _summary(capsys, str(run))
    assert code == 2 and "config.json" in err and ("named pipe" in err or "symbolic link" in err)


def test_metrics_jsonl_is_streamed_in_bounded_memory(tmp_path):
    """U05: a long metrics.jsonl is read a line at a time into compact arrays: the memory it takes is a small share
    of the file (reading it whole into dicts took 6.5 times the file)."""
    rows = b"".join(json.dumps({"step": i, "train/loss": 1.0 / i, "note": "x" * 400}).encode() + b"\n"
                    for i in range(1, 20001))
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(rows + b"{\"step\": 3, \"train/loss\": " + b"1" * (3 << 20) + b"\n"
                     + b'{"step": 1, "train/loss": 2}\n')  # a 3 MiB line, then a record
    tracemalloc.start()
    curves = read_curves(path, ("train/loss",))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    steps, values = curves.points("train/loss")
    assert len(steps) == 20001 and steps[-1] == 1 and values[-1] == 2.0  # the over-long line is skipped whole
    assert peak < len(rows) / 8, (peak, len(rows))


@pytest.mark.parametrize(("file", "change", "words"), [
    ("config.json", {"model": None}, "has no model.arch"),
    ("config.json", {"model": ["vitstr_tiny"]}, "model is an array"),
    ("config.json", {"model": {"arch": "nope"}}, "model.arch 'nope' is not a model"),
    ("config.json", {"argv": [1, 2]}, "argv is an array"),
    ("config.json", {"dataset": {"num_val": -1}}, "dataset.num_val is a number (-1), not a whole number"),
    ("metrics.json", {"wall_seconds": "long"}, 'wall_seconds is a string ("long"), not a number'),
    ("metrics.json", {"world_size": None}, "has no world_size"),
    ("metrics.json", {"steps": 2.5}, "steps is a number (2.5)"),
    ("metrics.json", {"exact_match": [0.5]}, "exact_match is an array"),
    ("metrics.json", {"strategy": {"a": 1}}, "strategy is an object"),
])
def test_a_field_of_the_wrong_type_is_one_line_naming_file_and_field(tmp_path, capsys, file, change, words):
    """U06: the run files are parsed into typed records before anything is formatted (KeyError, TypeError and
    ``round`` of a string were tracebacks)."""
    config, metrics = dict(CONFIG), dict(METRICS)
    (config if file == "config.json" else metrics).update(change)
    run = write_run(tmp_path / "run", config, metrics)
    code, _, err = _summary(capsys, str(run))
    assert code == 2 and f"{run / file}" in err and words in err, err
    assert not (run / "curves.png").exists()


def test_a_dangling_wandb_link_is_ignored(tmp_path, capsys):
    """U07: W&B's folder lists only real offline-run folders; a dangling link there was a FileNotFoundError."""
    run = write_run(tmp_path / "run")
    (run / "wandb").mkdir()
    (run / "wandb" / "offline-run-dangling").symlink_to(tmp_path / "nowhere")
    code, lines, _ = _summary(capsys, str(run))
    assert code == 0 and any("W&B          none written here" in ln for ln in lines), lines


@pytest.mark.parametrize(("where", "words"), [
    ("missing/curves.png", "the folder"),  # U08
    ("run/metrics.json", "would replace a file of the run"),  # U09
    ("run/checkpoints/curves.png", "would replace a file of the run"),
])
def test_plot_is_checked_as_an_output(tmp_path, capsys, where, words):
    """U08, U09: ``--plot`` into a folder that does not exist, or over the run's own files, is one line; the run's
    metrics.json keeps its bytes."""
    run = write_run(tmp_path / "run")
    (run / "checkpoints").mkdir()
    before = (run / "metrics.json").read_bytes()
    code, _, err = _summary(capsys, str(run), "--plot", str(tmp_path / where))
    assert code == 2 and words in err and (run / "metrics.json").read_bytes() == before
