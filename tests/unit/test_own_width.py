"""Crops read at their own width (--max-width, issue 57): the input keeps its aspect ratio at a fixed height, a batch
is padded to its widest, and no padding frame reaches the model's output, the loss or the decoding."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_folder
from PIL import Image

from scale_ocr.checkpoint.export import load_any
from scale_ocr.cli.main import main as cli_main
from scale_ocr.config import ModelConfig
from scale_ocr.data.recognition import RecognitionFolder, ScanReport, scan_folder
from scale_ocr.data.transforms import ResizeHeight
from scale_ocr.errors import UserError
from scale_ocr.models.recognition.ctc import ctc_greedy_decode, ctc_loss
from scale_ocr.tasks import create_task
from scale_ocr.train import main as train_main
from scale_ocr.vocab import Vocab


def test_resize_height_keeps_the_aspect_pads_short_crops_and_squeezes_long_ones():
    r = ResizeHeight(32, 256)
    assert r(Image.new("RGB", (100, 20), "white")).size == (160, 32)  # 100 * 32 / 20
    assert r(Image.new("RGB", (10, 20), "white")).size == (32, 32)  # narrower than high: padded to the height
    assert r(Image.new("RGB", (61, 20), "white")).size == (100, 32)  # 97.6 -> 98 columns, padded to a multiple of 4
    assert r(Image.new("RGB", (1000, 20), "white")).size == (256, 32)  # squeezed into --max-width
    assert r.width((61, 20)) == 100


@pytest.mark.parametrize("arch", ["vitstr_tiny", "crnn_mobilenet_v3_small"])
def test_a_crop_reads_the_same_alone_and_padded_in_a_batch(arch):
    """The frames of a narrow crop in a batch padded to a wide one are the frames it has alone, and the model says
    each item's frames. ViTSTR: no token attends to padding. CRNN: its BiLSTM reads no padding frame (read unpacked,
    the narrow crop's logits move by 0.02 here); its convolutions see the padding at the crop's edge as they see a
    word crop's, which an untrained backbone's tiny features (about 1e-8) do not show."""
    torch.manual_seed(0)
    sizes = {"model_depth": 2} if arch.startswith("vitstr") else {}
    task = create_task(ModelConfig(arch=arch, input_size=(32, 256), max_width=256, **sizes))
    model = task.build_model().eval()
    narrow, wide = torch.randn(3, 32, 64), torch.randn(3, 32, 200)
    with torch.no_grad():
        batch = model(torch.stack([torch.cat([narrow, wide[:, :, 64:]], -1), wide]), widths=torch.tensor([64, 200]))
        alone = model(narrow[None], widths=torch.tensor([64]))
    assert batch["lengths"].tolist() == [16, 50] and alone["logits"].shape[1] == 16
    torch.testing.assert_close(batch["logits"][0, :16], alone["logits"][0], atol=1e-4, rtol=1e-4)


def test_the_crnns_lstm_reads_own_lengths_as_a_packed_sequence_does_forward_and_backward():
    """OwnLengthLSTM (padded batch, each direction one fused call) gives a packed sequence's outputs, zeros after each
    length, and the same gradients; without lengths it is nn.LSTM, with nn.LSTM's weight names."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from scale_ocr.models.recognition.crnn import OwnLengthLSTM

    torch.manual_seed(0)
    ours = OwnLengthLSTM(12, 6, num_layers=2, bidirectional=True, batch_first=True)
    ref = torch.nn.LSTM(12, 6, num_layers=2, bidirectional=True, batch_first=True)
    ref.load_state_dict(ours.state_dict())
    x, lengths = torch.randn(4, 9, 12, requires_grad=True), torch.tensor([9, 3, 6, 1])
    got, _ = ours(x, lengths)
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    want, _ = pad_packed_sequence(ref(packed)[0], batch_first=True, total_length=9)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert got[1, 3:].abs().max() == 0
    for a, b in zip(torch.autograd.grad(got.square().sum(), [x, *ours.parameters()]),
                    torch.autograd.grad(want.square().sum(), [x, *ref.parameters()]), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ours(x)[0], ref(x)[0])
    with pytest.raises(ValueError, match="batch-first bidirectional"):  # the one layout it reads, checked once
        OwnLengthLSTM(12, 6, batch_first=True)


def test_ctc_loss_and_decoding_read_no_frame_after_an_items_length():
    torch.manual_seed(0)
    vocab = Vocab("ab ")
    logits = torch.randn(2, 12, vocab.num_classes)
    targets, target_lengths, lengths = torch.tensor([[1, 3, 2], [2, 2, 0]]), torch.tensor([3, 2]), torch.tensor([7, 12])
    spoiled = logits.clone()
    spoiled[0, 7:] = torch.randn(5, vocab.num_classes) * 10
    loss = ctc_loss(logits, targets, target_lengths, reduction="none", lengths=lengths)
    assert torch.equal(loss, ctc_loss(spoiled, targets, target_lengths, reduction="none", lengths=lengths))
    assert loss[0] == ctc_loss(logits[:1, :7], targets[:1], target_lengths[:1], reduction="none")[0]
    assert ctc_greedy_decode(spoiled, vocab, lengths) == ctc_greedy_decode(logits, vocab, lengths)
    assert ctc_greedy_decode(logits, vocab, lengths)[0][0] == ctc_greedy_decode(logits[:1, :7], vocab)[0][0]


def test_the_task_adds_the_space_records_the_width_and_loads_back_reading_at_own_width():
    task = create_task(ModelConfig(arch="crnn_mobilenet_v3_small", input_size=(32, 512), max_width=512))
    assert task.vocab.chars.endswith(" ") and task.own_width
    identity = task.identity()
    assert identity["max_width"] == 512 and identity["input_size"] == [32, 512]
    back = type(task).from_identity(identity)
    assert back.own_width and back.vocab.chars == task.vocab.chars
    fixed = create_task(ModelConfig(arch="crnn_mobilenet_v3_small"))
    assert "max_width" not in fixed.identity() and not type(fixed).from_identity(fixed.identity()).own_width


@pytest.mark.parametrize("argv, says", [
    (["db_mobilenet_v3_large", "--max-width", "512"], "reads its inputs at one size"),
    (["crnn_mobilenet_v3_small", "--max-width", "16"], "narrower than the input height 32"),
    (["crnn_mobilenet_v3_small", "--max-width", "510"], "must be a multiple of 4"),
    (["crnn_mobilenet_v3_small", "--max-width", "512", "--data-cache", "x.pt"], "--data-cache holds images of one"),
])
def test_what_cannot_read_at_own_width_is_refused_in_one_line(argv, says, tmp_path, capsys):
    assert train_main([*argv, "--output-dir", str(tmp_path / "run"), "--wandb-mode", "disabled"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_line_too_long_for_its_own_width_is_refused_or_skipped_and_counted(tmp_path):
    long = "a" * 40  # 79 frames needed: a 20-pixel-high crop 160 wide, read at 32 high, is 256 wide: 64 frames
    folder = make_folder(tmp_path / "lines", {"ok.png": "ab ab", "long.png": long},
                         {"long.png": _png(Image.new("RGB", (160, 20), "white"))})
    vocab = Vocab("ab ")
    with pytest.raises(UserError, match="is 256 pixels wide and gives 64; raise --max-width"):
        RecognitionFolder((str(folder),), vocab, "error", None, (32, 1024), own_width=True)
    report = ScanReport()
    assert [w for _, w in scan_folder(folder, vocab, "skip", report, (32, 1024), own_width=True)] == ["ab ab"]
    assert report.skipped == {"too_long": 1}


def test_lines_train_and_are_measured_at_their_own_width(tmp_path, capsys):
    """A 2-step run on lines of several widths, then `scale-ocr evaluate` of its weights: the run's config.json
    says the model reads at its own width, and the evaluation does; the MFU line says what it bills."""
    lines = ["a line", "another longer line of text", "ok", "text at its own width", "CTC frames", "x y z"]
    folder = make_folder(tmp_path / "lines", {f"{i}.png": w for i, w in enumerate(lines)})
    run = tmp_path / "run"
    assert train_main(["crnn_mobilenet_v3_small", "--strategy", "single", "--threads", "1", "--train-path",
                       str(folder), "--val-path", str(folder), "--max-width", "512", "-b", "3", "--max-steps", "2",
                       "--output-dir", str(run), "--wandb-mode", "disabled"]) == 0
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["max_width"] == 512 and config["vocab"].endswith(" ")
    assert "(counted at 32, 256, 512 px); each micro-batch billed at the width" in capsys.readouterr().out
    loaded = load_any(run / "last_model.pt")
    assert loaded.task.own_width
    assert cli_main(["evaluate", str(run / "last_model.pt"), str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["samples"] == len(lines)


def _png(img: Image.Image) -> bytes:
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_synthetic_text_lines_part_words_with_single_spaces_and_need_the_space():
    from scale_ocr.data.synthetic import SyntheticWords

    lines = SyntheticWords("abcXYZ019-. ", 200, 5, 30, seed=1, style="text")
    texts = [lines.label(i) for i in range(200)]
    assert all(5 <= len(t) <= 30 and t == " ".join(t.split()) for t in texts)
    assert sum(" " in t for t in texts) > 150 and lines.sample(3)[1] == texts[3]
    words = SyntheticWords("abc ", 50, 3, 8, seed=1)  # a word never holds the space, even when the vocabulary has it
    assert not any(" " in words.label(i) for i in range(50))
    with pytest.raises(UserError, match="--synthetic-words text parts words with spaces"):
        SyntheticWords("abc", 10, 3, 8, seed=1, style="text")


def test_docTRs_crnn_holds_a_line_model_built_for_its_widest_input():
    """--format doctr's class: docTR's CRNN, built with the line model's vocabulary (the space in it) and input shape
    (its widest), holds its weights and reads a full-width line as it does."""
    import doctr.models as doctr_models

    from scale_ocr.checkpoint.export import doctr_info
    from scale_ocr.checkpoint.weights_io import doctr_state_dict

    task = create_task(ModelConfig(arch="crnn_mobilenet_v3_small", input_size=(32, 512), max_width=512))
    torch.manual_seed(0)
    ours = task.build_model().eval()
    arch, state = doctr_state_dict(ours, task.arch)
    info = doctr_info(task)
    assert info["input_shape"] == [3, 32, 512] and info["vocab"].endswith(" ")
    theirs = getattr(doctr_models, arch)(pretrained=False, pretrained_backbone=False, vocab=info["vocab"],
                                         input_shape=tuple(info["input_shape"])).eval()
    theirs.load_state_dict(state, strict=True)
    x = torch.randn(1, 3, 32, 512)
    with torch.no_grad():
        a, b = ours(x, widths=torch.tensor([512]))["logits"], theirs(x, return_model_output=True)["out_map"]
    torch.testing.assert_close(torch.cat([a[..., 1:], a[..., :1]], -1), b, rtol=0, atol=1e-5)
