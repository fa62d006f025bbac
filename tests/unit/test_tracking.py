import struct
import zlib

import pytest

from scale_ocr.errors import UserError
from scale_ocr.tracking.wandb_logger import _run_id, redact, resolve_mode, wandb_env
from tests.helpers.wandb_reader import BLOCK, iter_payloads


@pytest.mark.parametrize("flag,env,mode", [
    ("offline", {"WANDB_MODE": "online"}, "offline"),  # the flag wins
    ("auto", {"WANDB_MODE": "disabled"}, "disabled"),
    ("auto", {"WANDB_MODE": "dryrun"}, "offline"),
    ("auto", {"WANDB_DISABLED": "true"}, "disabled"),
    ("auto", {"WANDB_API_KEY": "k" * 40}, "online"),
])
def test_resolve_mode(flag, env, mode):
    assert resolve_mode(flag, env) == mode


def test_auto_without_key_is_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert resolve_mode("auto", {}) == "offline"


def test_redact_drops_secrets():
    env = {"WANDB_API_KEY": "0123456789abcdef", "HF_TOKEN": "hf_secretvalue", "PATH": "/usr/bin"}
    doc = {"a": "uses 0123456789abcdef here", "api_key": "x", "nested": {"t": ["hf_secretvalue", "/usr/bin"]}}
    out = redact(doc, env)
    assert out == {"a": "<redacted>", "nested": {"t": ["<redacted>", "/usr/bin"]}}


@pytest.mark.parametrize("content", ["../../../tmp/escape", "a b", "", "x" * 65, "fifo"])
def test_a_resumed_run_id_that_is_no_run_id_starts_a_new_w_and_b_run(tmp_path, capsys, content):
    """The W&B run id a resumed run reads becomes part of a folder's name: only an id W&B writes is used (a path
    such as ``../..`` could lead W&B's folder out of the run), and the file is read as a user's file (a FIFO never
    blocks it); anything else is one warning and a new id."""
    import os

    id_file = tmp_path / "wandb_run_id"
    if content == "fifo":
        os.mkfifo(id_file)
    else:
        id_file.write_text(content + "\n")
    run_id = _run_id(id_file)
    assert run_id != content and len(run_id) == 8 and run_id.isalnum()
    assert "holds no W&B run id" in capsys.readouterr().err
    id_file.unlink()
    id_file.write_text("abc123xy\n")
    assert _run_id(id_file) == "abc123xy"


def _frame(kind: int, chunk: bytes) -> bytes:
    return struct.pack("<IHB", zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF, len(chunk), kind) + chunk


def _log(records: list[bytes]) -> bytes:
    """Write records the way the LevelDB log writer does: fragment across 32 KiB blocks."""
    out = bytearray(struct.pack("<4sHB", b":W&B", 0xBEE1, 0))
    for rec in records:
        first, rest = True, rec
        while True:
            room = BLOCK - len(out) % BLOCK
            if room < 7:
                out += b"\0" * room
                room = BLOCK
            n = room - 7
            chunk, rest = rest[:n], rest[n:]
            kind = (1 if first else 4) if not rest else (2 if first else 3)
            out += _frame(kind, chunk)
            first = False
            if not rest:
                break
    return bytes(out)


def test_reader_reassembles_records_across_blocks(tmp_path):
    records = [b"a" * 10, b"b" * 70000, b"c" * (BLOCK - 30), b"d" * 5]
    path = tmp_path / "run.wandb"
    path.write_bytes(_log(records))
    assert list(iter_payloads(path)) == records


def test_reader_rejects_other_files(tmp_path):
    path = tmp_path / "x.wandb"
    path.write_bytes(b"not a log at all")
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        list(iter_payloads(path))


@pytest.mark.parametrize("env,named", [
    ({"WANDB_INIT_TIMEOUT": "abc"}, "WANDB_INIT_TIMEOUT='abc'"),  # V06
    ({"WANDB_INIT_TIMEOUT": "nan"}, "WANDB_INIT_TIMEOUT='nan'"),
    ({"WANDB_INIT_TIMEOUT": "-5"}, "WANDB_INIT_TIMEOUT='-5'"),
    ({"WANDB_INIT_TIMEOUT": "inf"}, "WANDB_INIT_TIMEOUT='inf'"),
    ({"WANDB_MODE": "ofline"}, "WANDB_MODE='ofline'"),
])
def test_wandb_variables_are_checked_at_start(env, named):
    """V06: a W&B variable W&B cannot use is one line at start, not a traceback after the run directory is
    claimed."""
    with pytest.raises(UserError) as caught:
        wandb_env("offline" if "WANDB_MODE" not in env else "auto", env)
    assert named in str(caught.value)


def test_wandb_variables_are_not_read_when_wandb_is_off():
    assert wandb_env("disabled", {"WANDB_INIT_TIMEOUT": "abc", "WANDB_MODE": "x"}) == ("disabled", 60.0)
    assert wandb_env("offline", {"WANDB_INIT_TIMEOUT": " 8 "}) == ("offline", 8.0)


def test_train_refuses_a_bad_wandb_variable_before_the_run_directory(monkeypatch, capsys, tmp_path):
    from scale_ocr import train

    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "abc")
    assert train.main(["--wandb-mode", "offline", "--output-dir", str(tmp_path / "run")]) == 2
    assert "WANDB_INIT_TIMEOUT='abc'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
