"""Bad configuration - config-file values, non-finite numbers, output directories - is one line, exit code 2."""

import os

import pytest
from test_user_errors import _run

from scale_ocr.cli.args import parse_config
from scale_ocr.config import LoggingConfig
from scale_ocr.errors import UserError
from scale_ocr.run import run_dir
from scale_ocr.tracking.wandb_logger import RUN_ID_FILE, open_wandb


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_values_convert_like_flags(tmp_path):
    # YAML reads 1e-3 as the string "1e-3" (no dot); the flag's float() reads it as a number.
    cfg = parse_config(["--config", _yaml(tmp_path, "lr: 1e-3\nbatch_size: '8'\nepochs: 2.0\naugment: no\n"
                                                    "input_size: [32, 128]\nwandb_tags: ci\nworkers: null\n"
                                                    "train: {eval: 'false'}\n")])
    assert cfg.optim.lr == 0.001 and isinstance(cfg.optim.lr, float)
    assert cfg.train.batch_size == 8 and cfg.train.epochs == 2 and isinstance(cfg.train.epochs, int)
    assert cfg.data.augment is False and cfg.train.eval is False
    assert cfg.model.input_size == (32, 128) and cfg.logging.wandb_tags == ("ci",) and cfg.data.workers is None


@pytest.mark.parametrize("line,expected", [
    ("lr: abc", "lr = 'abc' is not a number (float)"),
    ("wd: null", "wd = null is not a number (float)"),  # (lr: null is the model's recommended rate)
    ("batch_size: eight", "batch_size = 'eight' is not a whole number (int)"),
    ("epochs: 2.5", "epochs = 2.5 is not a whole number (int)"),
    ("epochs: true", "epochs = true is not a whole number (int)"),
    ("augment: 'yes'", "augment = 'yes' is not true or false"),
    ("augment: 1", "augment = 1 is not true or false"),
    ("optim: sgd", "optim = 'sgd' is not one of adamw, adam"),
    ("backend: mpi", "backend = 'mpi' is not one of nccl, gloo or null"),
    ("input_size: wide", "input_size = 'wide' is not a size HxW"),
    ("train_path: {a: 1}", 'train_path = {"a": 1} is not text (str) or a list of them'),
])
def test_bad_config_file_value_is_one_line(tmp_path, capsys, line, expected):
    path = _yaml(tmp_path, line + "\n")
    code, err = _run(capsys, ["--config", path, "--output-dir", str(tmp_path / "run")])
    assert code == 2 and f"--config {path}: {expected}" in err and "remove the key" in err


@pytest.mark.parametrize("argv,file", [
    (["--lr", "nan"], None), (["--lr", "inf"], None), (["--wd=-inf"], None), (["--clip-grad", "nan"], None),
    (["--device-memory-gb", "inf"], None), ([], "lr: .nan\n"), ([], "lr: inf\n"),
])
def test_non_finite_numbers_are_refused(tmp_path, capsys, argv, file):
    if file:
        argv = ["--config", _yaml(tmp_path, file)]
    code, err = _run(capsys, [*argv, "--output-dir", str(tmp_path / "run")])
    assert code == 2 and "is not a finite number" in err


@pytest.mark.parametrize("under", ["notes.txt/run", "notes.txt"])
def test_output_dir_under_a_file(tmp_path, capsys, under):
    (tmp_path / "notes.txt").write_text("x")
    code, err = _run(capsys, ["--output-dir", str(tmp_path / under)])
    assert code == 2 and f"{tmp_path / 'notes.txt'} is a file, not a directory" in err and "--output-dir" in err


def test_unwritable_output_dir(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anywhere; stand in for what access(2) tells everyone else
        real = os.access
        monkeypatch.setattr(run_dir.os, "access", lambda p, mode: real(p, mode) and str(p) != str(locked))
    with pytest.raises(UserError, match=f"{locked} is not writable"):
        parse_config(["--output-dir", str(locked / "run")])


def test_wandb_dir_is_honoured(tmp_path, monkeypatch):
    scratch, run = tmp_path / "scratch", tmp_path / "run"
    scratch.mkdir()
    run.mkdir()
    monkeypatch.setenv("WANDB_DIR", str(scratch))
    monkeypatch.setenv("HOME", str(tmp_path))
    logger = open_wandb(LoggingConfig(wandb_mode="offline"), run, {"lr": 0.1})
    assert logger is not None
    logger.close()
    runs = list((scratch / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and not (run / "wandb").exists()
    assert runs[0].name.endswith((run / RUN_ID_FILE).read_text().strip())  # the id file stays in the run dir
