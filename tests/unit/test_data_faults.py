"""Bad data is caught at start-up, in one line, and image paths never leave their dataset folder."""

import io
import json
import random
import struct
import zlib

import pytest
import torch
from conftest import TINY, make_folder
from PIL import Image
from test_user_errors import _run

from scale_ocr.cli.args import parse_config
from scale_ocr.data.recognition import RecognitionFolder
from scale_ocr.errors import UserError
from scale_ocr.models.recognition.ctc import ctc_frames, ctc_frames_needed, ctc_loss
from scale_ocr.train import main
from scale_ocr.vocab import Vocab, resolve_vocab

GOOD = {f"{i}.png": w for i, w in enumerate(["abcd", "efgh", "ijkl", "mnop"])}


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(width: int, height: int, bit_depth: int = 8, noise: bool = False, keep: float = 1.0) -> bytes:
    """A grayscale PNG with valid chunk CRCs, written row by row so a huge one costs no memory.

    Args:
        width, height: the size the header declares.
        bit_depth: 1 packs eight pixels a byte, so an all-black 20000x20000 image compresses to ~50 kB.
        noise: random rows (incompressible) instead of black ones.
        keep: fraction of the compressed pixel data kept; below 1 the image is cut short.
    """
    rng, row = random.Random(0), bytes((width * bit_depth + 7) // 8)
    z = zlib.compressobj()
    idat = b"".join(z.compress(b"\0" + (rng.randbytes(len(row)) if noise else row)) for _ in range(height))
    idat = (idat + z.flush())[: None if keep == 1.0 else int(len(idat) * keep)]
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _truncated_png() -> bytes:
    data = _png(64, 32, noise=True, keep=0.5)
    with Image.open(io.BytesIO(data)) as im:
        im.verify()  # verify() alone would accept it: chunks and CRCs are intact, the pixels are not
    return data


@pytest.fixture
def out(tmp_path):
    return ["--output-dir", str(tmp_path / "run"), "--strategy", "single", *TINY]


@pytest.fixture
def secret(tmp_path):
    """A valid image outside every dataset folder: it must never be loaded."""
    path = tmp_path / "secret.png"
    path.write_bytes(_png(32, 16))
    return path


def _folder(root, bad_labels, images=None):
    return make_folder(root, {**GOOD, **bad_labels}, {name: images.get(name) for name in bad_labels}
                       if images is not None else None)


def test_absolute_key_refused(tmp_path, capsys, out, secret):
    folder = _folder(tmp_path / "d", {str(secret): "abc"}, {})
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and repr(str(secret)) in line and "points outside" in line and "labels.json" in line


def test_dotdot_key_refused(tmp_path, capsys, out, secret):
    folder = _folder(tmp_path / "d", {"../../secret.png": "abc"}, {})
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and "'../../secret.png'" in line and "points outside" in line


def test_symlink_out_of_the_folder_refused(tmp_path, capsys, out, secret):
    folder = _folder(tmp_path / "d", {"link.png": "abc"}, {})
    (folder / "images" / "link.png").symlink_to(secret)
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and "'link.png'" in line and "points outside" in line


@pytest.mark.parametrize("name", ["", "a\x00.png"])
def test_key_that_is_not_a_file_name_refused(tmp_path, capsys, out, name):
    folder = _folder(tmp_path / "d", {name: "abc"}, {})
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and "is not a file name" in line and repr(name) in line


def test_truncated_png_refused(tmp_path, capsys, out):
    folder = _folder(tmp_path / "d", {"cut.png": "abc"}, {"cut.png": _truncated_png()})
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and "cut.png cannot be read as an image" in line and "truncated" in line


@pytest.mark.parametrize("size,why", [
    (20000, "decompression bomb"),  # 400 Mpx: Pillow raises DecompressionBombError
    (10000, "decompression bomb"),  # 100 Mpx: Pillow only warns; the warning is an error here
    (5000, "5000x5000 pixels"),  # 25 Mpx: under Pillow's limits, over a word crop's
])
def test_huge_image_refused(tmp_path, capsys, out, size, why):
    bomb = _png(size, size, bit_depth=1)
    assert len(bomb) < 100_000  # a few kB on disk, gigabytes once decoded
    folder = _folder(tmp_path / "d", {"big.png": "abc"}, {"big.png": bomb})
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and "big.png" in line and why in line and "8192 px a side" in line


def test_label_longer_than_ctc_frames_refused(tmp_path, capsys, out):
    folder = _folder(tmp_path / "d", {"long.png": "a" * 17})  # 17 characters + 16 repeats = 33 frames
    code, line = _run(capsys, ["--train-path", str(folder), *out])
    assert code == 2 and "'long.png' needs 33 CTC frames (17 characters + 16 repeats)" in line
    assert "128-pixel-wide input gives 32" in line and "--input-size" in line


def test_labels_with_repeats_that_fit_train(tmp_path):
    # "a" * 16 + "b" needs exactly the 32 frames of a 128-pixel-wide input.
    folder = make_folder(tmp_path / "d",
                         {f"{i}.png": w for i, w in enumerate(["hello", "aabb", "book", "a" * 16 + "b"])})
    code = main(["--train-path", str(folder), "--output-dir", str(tmp_path / "run"), "--strategy", "single", *TINY,
                 "--max-steps", "1", "--no-eval"])
    assert code == 0 and json.loads((tmp_path / "run" / "metrics.json").read_text())["train_loss"] > 0


@pytest.mark.parametrize("word,fits", [("a" * 16 + "b", True), ("ab" * 16, True), ("a" * 17, False)])
def test_frames_needed_is_exactly_what_ctc_can_align(word, fits):
    vocab = Vocab("ab")
    assert (ctc_frames_needed(word) <= ctc_frames((32, 128))) == fits
    logits = torch.zeros(1, ctc_frames((32, 128)), len(vocab.chars) + 1)
    loss = ctc_loss(logits, vocab.encode(word)[None], torch.tensor([len(word)]))
    assert (loss.item() > 0) == fits  # an impossible alignment is infinite, zeroed by zero_infinity


def test_bad_samples_skipped_and_counted_by_reason(tmp_path, secret):
    bad = {str(secret): "abc", "../../secret.png": "abc", "link.png": "abc", "": "abc", "cut.png": "abc",
           "bomb.png": "abc", "big.png": "abc", "long.png": "a" * 17}
    folder = _folder(tmp_path / "d", bad, {"cut.png": _truncated_png(), "bomb.png": _png(20000, 20000, bit_depth=1),
                                           "big.png": _png(5000, 5000, bit_depth=1)})
    (folder / "images" / "link.png").symlink_to(secret)
    run_dir = tmp_path / "run"
    code = main(["--train-path", str(folder), "--on-bad-sample", "skip", "--output-dir", str(run_dir),
                 "--strategy", "single", *TINY, "--max-steps", "1", "--no-eval"])
    assert code == 0
    assert json.loads((run_dir / "metrics.json").read_text())["skipped_samples"] == len(bad)
    skipped = json.loads((run_dir / "config.json").read_text())["dataset"]["skipped_samples"]
    assert skipped == {"outside_folder": 3, "bad_name": 1, "corrupt_image": 1, "too_large": 2, "too_long": 1}


def test_image_changed_during_the_run_is_one_line(tmp_path):
    folder = make_folder(tmp_path / "d", GOOD)
    ds = RecognitionFolder((str(folder),), Vocab(resolve_vocab("latin")), input_size=(32, 128))
    (folder / "images" / "0.png").write_bytes(_truncated_png())
    with pytest.raises(UserError, match=r"0\.png cannot be read .* changed during the run"):
        ds[0]


def test_max_chars_leaves_room_for_repeats():
    parse_config(["--max-chars", "16"])  # "aaa...a" of 16 needs 31 of the 32 frames
    with pytest.raises(UserError, match="needing 33 CTC frames .* gives 32; lower --max-chars to 16"):
        parse_config(["--max-chars", "17"])
