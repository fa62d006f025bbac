"""``scale-ocr summary RUN_DIR``: the one screen ``make demo`` ends with, read back from a real run's files."""

from __future__ import annotations

import json
import shlex

from scale_ocr.cli.main import main as cli_main
from tests.conftest import python_train

TINY = ["--train-samples", "32", "--val-samples", "8", "-b", "8", "--epochs", "2", "--max-chars", "4",
        "--eval-every", "2", "--log-every", "1", "--wandb-mode", "offline", "--resume", "none"]


def test_summary_of_a_real_run(tmp_path, capsys):
    """Every line the issue asks for, from what a real (tiny) run wrote: strategy, world size, global batch, time and
    accuracy; the run dir; the W&B offline run with a `wandb sync` command naming a folder that exists; a PNG of the
    curves; and the same job under fsdp and zero3, its flags kept and only the strategy and output dir changed."""
    run_dir = tmp_path / "run"
    proc = python_train([*TINY, "--output-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((run_dir / "config.json").read_text())["argv"] == [*TINY, "--output-dir", str(run_dir)]
    assert cli_main(["summary", str(run_dir)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "world size 1" in lines["strategy"] and "global batch 8" in lines["strategy"]
    assert " 8 steps" in lines["trained"] and "exact_match" in lines["accuracy"] and "on 8 held-out" in out
    sync = lines["W&B"].split("wandb sync ")[1].rstrip(")")
    assert (run_dir / "wandb").is_dir() and sync.startswith(str(run_dir / "wandb" / "offline-run-"))
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for strategy in ("fsdp", "zero3"):
        cmd = shlex.split(out.split(f"under {strategy}")[1].splitlines()[0])
        assert cmd[:4] == ["torchrun", "--nproc_per_node", "1", "scale_ocr/train.py"]
        assert cmd[4:] == [*TINY, "--strategy", strategy, "--output-dir", f"{run_dir}-{strategy}"]


def test_summary_of_no_run_is_one_line(tmp_path, capsys):
    """A folder that holds no finished run: exit 2 and one line naming the missing file, no traceback."""
    assert cli_main(["summary", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json does not exist" in err[0] and "--output-dir" in err[0]
