"""Every mistake a user can make ends in one line naming the problem and the fix, and exit code 2."""

import os
import sys

import pytest
from conftest import TINY, _env, make_folder, python_train, read_metrics, run_cmd

from scale_ocr.train import main


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("scale-ocr: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def _run(capsys, argv):
    code = main(argv)
    return code, _one_error_line(capsys.readouterr().err)


@pytest.fixture
def out(tmp_path):
    return ["--output-dir", str(tmp_path / "run"), "--strategy", "single", *TINY]


def test_missing_labels_json(tmp_path, capsys, out):
    (tmp_path / "d" / "images").mkdir(parents=True)
    code, line = _run(capsys, ["--train-path", str(tmp_path / "d"), *out])
    assert code == 2 and "holds neither labels.json (a docTR folder) nor shards.json" in line, line
    assert str(tmp_path / "d") in line


def test_label_points_to_missing_image(tmp_path, capsys, out):
    folder = make_folder(tmp_path / "d", {"a.png": "abc", "gone.png": "def"}, {"gone.png": None})
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and "gone.png" in line and "does not exist" in line and "--on-bad-sample skip" in line


def test_corrupt_image(tmp_path, capsys, out):
    folder = make_folder(tmp_path / "d", {"a.png": "abc", "bad.png": "def"}, {"bad.png": b"\x89PNG\r\n\x1a\nnot"})
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and "bad.png" in line and "cannot be read" in line


def test_unknown_characters(tmp_path, capsys, out):
    folder = make_folder(tmp_path / "d", {"a.png": "abc", "b.png": "naïve"})
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and "'ï'" in line and "--vocab" in line and "b.png" in line


def test_empty_label(tmp_path, capsys, out):
    folder = make_folder(tmp_path / "d", {"a.png": "abc", "e.png": ""})
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and "e.png" in line and "empty label" in line


def test_skip_counts_bad_samples(tmp_path, capsys):
    labels = {f"{i}.png": w for i, w in enumerate(["abcd", "efgh", "ijkl", "mnop"] * 4)}
    labels.update({"u.png": "naïve", "e.png": "", "gone.png": "xyz"})
    folder = make_folder(tmp_path / "d", labels, {"gone.png": None})
    run_dir = tmp_path / "run"
    code = main(["--train-path", str(folder), "--val-path", str(folder), "--on-bad-sample", "skip",
                 "--strategy", "single", "--max-steps", "2", "-b", "4", "--output-dir", str(run_dir)])
    assert code == 0
    m = read_metrics(run_dir)
    assert m["skipped_samples"] == 6  # 3 bad in train, 3 in val


def test_unknown_arch(capsys, out):
    code, line = _run(capsys, ["crnn_resnet9000", *out])
    assert code == 2 and "unknown model 'crnn_resnet9000'" in line and "crnn_vgg16_bn" in line


def test_unknown_strategy(capsys, tmp_path):
    code, line = _run(capsys, ["--strategy", "zero9", "--output-dir", str(tmp_path)])
    assert code == 2 and "unknown strategy 'zero9'" in line and "fsdp" in line


def test_malformed_deepspeed_json(tmp_path, capsys):
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 2,}}')
    code, line = _run(capsys, ["--strategy", "deepspeed", "--ds-config", str(bad), "--output-dir", str(tmp_path)])
    assert code == 2 and "ds.json is not valid JSON" in line and "line 1" in line


def test_real_process_exit_code_and_no_traceback(tmp_path):
    proc = python_train(["--strategy", "nope", "--output-dir", str(tmp_path)], timeout=120)
    assert proc.returncode == 2
    _one_error_line(proc.stderr)


def test_dp_under_a_multi_process_launcher(tmp_path):
    """torchrun/deepspeed set RANK/WORLD_SIZE; dp must refuse before any rendezvous."""
    env = _env()
    env.update({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "TORCHELASTIC_RUN_ID": "test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    proc = run_cmd([sys.executable, "scale_ocr/train.py", "--strategy", "dp", "--output-dir", str(tmp_path)],
                   env=env, timeout=120)
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "--strategy dp runs in one process" in line and "torchrun" in line


@pytest.mark.slow
def test_dp_under_real_torchrun(tmp_path):
    from conftest import torchrun_train

    proc = torchrun_train(["--strategy", "dp", "--output-dir", str(tmp_path)], timeout=180)
    assert proc.returncode != 0
    assert "scale-ocr: error: --strategy dp runs in one process" in proc.stderr
    assert os.linesep.join(ln for ln in proc.stderr.splitlines() if "scale-ocr: error" in ln).count("\n") == 0


def test_a_mistake_only_another_rank_found_is_printed_by_it_after_the_grace(monkeypatch, capsys):
    """Before the ranks meet, rank 0 prints what every rank finds; under a launcher that ends the rest once one
    rank exits, a rank other than 0 still alive after the grace (the launcher did not end it: rank 0 did not fail)
    prints its own line, naming itself. Under srun, which ends no rank, so does a rank that finds rank 0 at the
    rendezvous (rank 0 passed); otherwise rank 0 alone prints."""
    from scale_ocr.errors import UserError, found_by_every_rank, report_user_errors

    @report_user_errors
    def check(message, launcher_ends_the_rest=True, rank_zero_waiting=None):
        with found_by_every_rank(launcher_ends_the_rest, rank_zero_waiting, grace_s=0.0):
            raise UserError(message)

    monkeypatch.setenv("RANK", "1")
    assert check("--train-path /x does not exist") == 2
    assert capsys.readouterr().err == "scale-ocr: error: rank 1: --train-path /x does not exist\n"
    assert check("--train-path /x does not exist", launcher_ends_the_rest=False) == 2
    assert capsys.readouterr().err == ""
    # srun: rank 0 is at the rendezvous (it passed the checks), so the mistake is this rank's own: it says so
    assert check("local rank 1 has no GPU", False, rank_zero_waiting=lambda grace: True) == 2
    assert capsys.readouterr().err == "scale-ocr: error: rank 1: local rank 1 has no GPU\n"
    assert check("--train-path /x does not exist", False, rank_zero_waiting=lambda grace: False) == 2
    assert capsys.readouterr().err == ""  # rank 0 failed too and printed it
    monkeypatch.setenv("RANK", "0")
    assert check("--train-path /x does not exist") == 2
    assert capsys.readouterr().err == "scale-ocr: error: --train-path /x does not exist\n"


def test_rank_0_whose_peers_never_reach_the_rendezvous_says_so_in_one_line(monkeypatch, capsys):
    """Under srun a rank that exited before the ranks met never joins rank 0's store: rank 0's wait ends in one
    line, not torch's traceback."""
    import torch.distributed as dist

    from scale_ocr.errors import EXIT_PEER_LOST, report_user_errors

    @report_user_errors
    def rendezvous():
        raise dist.DistStoreError("Timed out after 91 seconds waiting for clients. 1/2 clients joined.")

    monkeypatch.setenv("RANK", "0")
    assert rendezvous() == EXIT_PEER_LOST
    assert capsys.readouterr().err.startswith(
        "scale-ocr: error: rank 0 lost contact with another rank (Timed out "
        "after 91 seconds waiting for clients. 1/2 clients joined.); the job ends")


def test_gpu_memory_cap_on_a_cpu_rank_says_how_to_cap_a_cpu_process(tmp_path, capsys, out):
    code, line = _run(capsys, ["--gpu-memory-cap-gb", "4", *out])
    assert code == 2 and "caps GPU memory" in line and "ulimit -d" in line
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed


def test_compile_under_an_engine_that_does_not_compile(capsys, tmp_path):
    code, line = _run(capsys, ["--strategy", "zero2", "--compile", "--output-dir", str(tmp_path / "run")])
    assert code == 2 and "--compile runs under single, ddp, fsdp" in line and "zero2" in line
    assert not (tmp_path / "run").exists()  # refused before the run directory is claimed


@pytest.mark.parametrize("flags, says", [
    (["--strategy", "zero2", "--bucket-mb", "5"], "--bucket-mb tunes DDP's gradient reducer (ddp)"),
    (["--strategy", "ddp", "--static-graph", "--grad-accum", "2"],
     "--static-graph cannot be combined with --grad-accum 2"),
    (["--strategy", "ddp", "--bucket-mb", "0"], "--bucket-mb 0.0: give DDP's bucket size in MB"),
])
def test_ddp_reducer_flags_that_cannot_apply(capsys, tmp_path, flags, says):
    code, line = _run(capsys, [*flags, "--output-dir", str(tmp_path / "run")])
    assert code == 2 and says in line
    assert not (tmp_path / "run").exists()


def test_a_flag_argparse_refuses_is_one_line(capsys, out):
    """argparse's own refusal is a usage line and an error, printed by every rank of a launched job; here it is one
    line (rank 0's, under a launcher) with argparse's exit code."""
    assert main(["--batch-sise", "4", *out]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["scale-ocr: error: unrecognized arguments: --batch-sise; `scale-ocr train --help` lists the "
                   "flags"], err


@pytest.mark.parametrize("entry", [["scale_ocr/train.py", "--help"], ["-m", "scale_ocr", "models"],
                                   ["-m", "benchmarks.pixel_batches", "--help"]])
def test_a_python_that_cannot_import_torch_ends_in_one_line(entry):
    """Run by a Python without torch (the system's, where torch is in .venv; here the venv's own under -S, which
    leaves site-packages out), the launch script, ``python -m scale_ocr`` and the benchmarks say so in one line."""
    proc = run_cmd([sys.executable, "-S", *entry], timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.startswith("scale-ocr: error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot import torch or torchvision: run scale-ocr with the Python it is installed in" in proc.stderr
