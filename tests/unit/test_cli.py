import sys

from conftest import TINY, read_metrics, run_cmd

from scale_ocr.cli.main import main


def test_lists(capsys):
    assert main(["models"]) == 0
    assert "crnn_mobilenet_v3_small" in capsys.readouterr().out
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert "zero3_offload" in out and "fairscale" in out
    assert main(["models", "vitstr_*", "--params"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [r[0] for r in rows] == ["vitstr_base", "vitstr_large", "vitstr_small", "vitstr_tiny"]
    assert rows[3][1:] == ["recognition", "5.40M", "4.543", "GFLOP/sample", "lr", "0.001", "at", "global", "batch",
                           "64"]  # FLOPs: forward + backward per 32x128 sample, counted (docs/mfu.md)
    assert rows[1][2] == "302.64M"
    assert main(["models", "crnn_mobilenet_v3_small", "--params"]) == 0
    assert capsys.readouterr().out.split()[-6:] == ["lr", "0.003", "at", "global", "batch", "64"]  # --lr's default


def test_unknown_command(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_scale_ocr_train_takes_train_py_flags(tmp_path):
    proc = run_cmd([sys.executable, "-m", "scale_ocr", "train", "crnn_mobilenet_v3_small", "--strategy", "single",
                    *TINY, "--output_dir", str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_metrics(tmp_path)["strategy"] == "single"


def test_help_lists_flags():
    proc = run_cmd([sys.executable, "scale_ocr/train.py", "--help"], timeout=120)
    assert proc.returncode == 0
    for flag in ("--strategy", "--train-path", "--ds-config", "--grad-accum", "--precision", "--input-size"):
        assert flag in proc.stdout


def test_benchmark_commands_find_the_checkout():
    """`scale-ocr bench` and `max-model` run the checkout's benchmarks (the path from cli/main.py to the root)."""
    for command, prog in (("bench", "benchmarks.scaling"), ("max-model", "benchmarks.max_model")):
        proc = run_cmd([sys.executable, "-m", "scale_ocr", command, "--help"], timeout=120)
        assert proc.returncode == 0 and f"python -m {prog}" in proc.stdout, proc.stdout + proc.stderr
