"""Ranks that do not share the run directory stop at start with one line.

Two simulated nodes (``torchrun --nnodes 2 --node_rank i --nproc_per_node 1`` on 127.0.0.1); node 1 runs in its own
mount namespace with a tmpfs over the output directory, so it truly does not see what rank 0 writes there.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import BIN, REPO, TRAIN, _env

from scale_ocr.distributed.process_group import free_port
from scale_ocr.run.run_dir import previous_run
from scale_ocr.run.shared_dir import TOKEN_PREFIX

ARGS = ["--strategy", "ddp", "--max-steps", "2", "--train-samples", "32", "--val-samples", "8", "-b", "4",
        "--max-chars", "5", "--log-every", "1", "--wandb-mode", "disabled"]
# Node 1's own view of the file system: a fresh tmpfs over the output directory, private to this process tree.
PRIVATE = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs scale-ocr-test "$0" && exec "$@"']


def _can_unshare() -> bool:
    try:
        return subprocess.run([*PRIVATE[:4], "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
def test_ranks_that_do_not_share_the_run_directory_stop_at_start(tmp_path):
    if not _can_unshare():
        pytest.skip("needs a private mount namespace (root, or CAP_SYS_ADMIN, and util-linux's unshare)")
    run_dir = tmp_path / "run"
    run_dir.mkdir()  # the mount point node 1 covers
    port = free_port()
    procs = []
    for node in (0, 1):
        torchrun = [str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                    "--master_addr", "127.0.0.1", "--master_port", str(port), str(TRAIN), *ARGS,
                    "--output-dir", str(run_dir)]
        cmd = [*PRIVATE, str(run_dir), *torchrun] if node else torchrun
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True))
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    text = "\n".join(o + e for o, e in outs)
    lines = [ln for ln in text.splitlines() if ln.startswith("scale-ocr: ")]
    assert len(lines) == 1, text[-3000:]
    assert lines[0].startswith("scale-ocr: error: rank 1 (on ") and f"--output-dir {run_dir}:" in lines[0], lines
    assert "every node mounts" in lines[0], lines
    # torchrun reports each failed rank's exit code: the user error's 2 on both nodes, and neither trained a step.
    assert all("exitcode  : 2" in e for _, e in outs) and all(p.returncode != 0 for p in procs), text[-3000:]
    # Nothing but rank 0's lock: no config or metrics written, and the check's token removed.
    assert "step 1/" not in text and sorted(p.name for p in run_dir.iterdir()) == [".scale-ocr.lock"]


def test_a_killed_jobs_token_is_not_taken_for_a_foreign_file(tmp_path):
    """A job killed between writing the token and removing it leaves the token: the next job does not refuse the
    directory as another program's ("not empty and holds no scale-ocr run")."""
    (tmp_path / ".scale-ocr.lock").write_text("")
    (tmp_path / (TOKEN_PREFIX + "ab" * 16)).write_text("ab" * 16)
    assert previous_run(tmp_path) == []
    (tmp_path / "notes.txt").write_text("mine")
    assert previous_run(tmp_path) == ["notes.txt"]
