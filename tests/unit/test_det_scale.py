"""Detection at the page's own scale: native-scale training crops, whole pages read at --det-size auto."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from torch import nn

from scale_ocr.config import ModelConfig
from scale_ocr.data.det_transforms import (
    TextCrop,
    build_det_transform,
    crop_window,
    inside_fraction,
    pad_batch,
    run_size,
    stride_ceil,
)
from scale_ocr.data.transforms import MEAN, STD
from scale_ocr.errors import UserError
from scale_ocr.tasks import create_task
from scale_ocr.tasks.detection import PageCollate

DET = "db_mobilenet_v3_large"


def _box(x0: float, y0: float, x1: float, y1: float) -> list[list[float]]:
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1]]


def _page(w: int, h: int, boxes: list) -> Image.Image:
    """A white page with each box filled in red (what the oracle below detects)."""
    img = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for x0, y0, x1, y1 in boxes:
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=(255, 0, 0))
    return img


def test_crop_keeps_geometry_and_cuts_words_as_dbnet_trains():
    """A crop moves every kept polygon by exactly the window's offset; a word cut by the edge but mostly inside is
    clipped to the window, one mostly outside is dropped with its text."""
    boxes = [(100, 100, 160, 120), (290, 50, 330, 70), (10, 10, 90, 30), (380, 200, 395, 215)]
    img = _page(400, 300, boxes)
    polys = np.float32([_box(*b) for b in boxes])
    out, kept, words = crop_window(img, polys, ["in", "cut", "out", "edge"], (80, 40, 320, 240), keep=0.5)
    assert out.size == (240, 200) and words == ["in", "cut"]
    np.testing.assert_array_equal(kept[0], polys[0] - [80, 40])  # exact: the offset, nothing else
    np.testing.assert_array_equal(kept[1], np.float32(_box(210, 10, 240, 30)))  # 3/4 inside: clipped to the edge
    # The pixels moved with the polygons: the kept word is red exactly inside its shifted box.
    a = np.asarray(out)
    assert (a[60:80, 20:80] == [255, 0, 0]).all() and (a[59, 20:80] == 255).all() and (a[80, 20:80] == 255).all()


def test_crops_hold_text_and_small_pages_are_padded():
    torch.manual_seed(0)
    # Text only in one corner of a large page: uniform windows would mostly show paper.
    polys = np.float32([_box(1700 + 30 * i, 1800, 1725 + 30 * i, 1820) for i in range(5)])
    crop = TextCrop((256, 256), text_p=0.9)
    held = [(inside_fraction(polys - np.float32(w[:2]), 256, 256) == 1).any()
            for w in (crop.window(2000, 2000, polys) for _ in range(300))]
    assert 0.85 <= np.mean(held) <= 0.97, np.mean(held)
    # A page smaller than the crop in height: cut to 256 wide, padded with black to 256 high; the words keep
    # their size (no resize) and stay whole where the window holds them.
    tf = build_det_transform((256, 256), train=True, augment=False, page_scale="native")
    img = _page(300, 200, [(20, 150, 60, 170)])
    x, kept, _ = tf(img, np.float32([_box(20, 150, 60, 170)]), ["w"])
    assert x.shape == (3, 256, 256)
    black = (torch.zeros(3) - torch.tensor(MEAN)) / torch.tensor(STD)
    assert torch.allclose(x[:, 200:, :], black.view(3, 1, 1).expand(3, 56, 256))
    if len(kept):
        assert np.ptp(kept[0][:, 0]) == 40 and np.ptp(kept[0][:, 1]) == 20


def test_auto_sizes_are_stride_multiples_under_the_cap():
    assert run_size(1275, 1650, 1.0, 2048) == (1275, 1650)  # a 150-dpi A4 page at its own pixels ...
    assert (stride_ceil(1275), stride_ceil(1650)) == (1280, 1664)  # ... padded, never stretched, to DBNet's stride
    assert run_size(2550, 3300, 1.0, 2048) == (1583, 2048)  # 300 dpi: scaled down to the cap, aspect kept
    assert run_size(1275, 1650, 0.5, 2048) == (638, 825)  # --page-scale 0.5
    for w, h, f, cap in [(1275, 1650, 1.0, 1024), (8000, 30, 2.0, 4096), (31, 33, 1.0, 32)]:
        nw, nh = run_size(w, h, f, cap)
        assert max(nw, nh) <= cap and stride_ceil(max(nw, nh)) <= cap


def test_collate_pads_pages_out_of_loss_and_metrics():
    small, large = torch.randn(3, 96, 64), torch.randn(3, 120, 150)
    poly = np.float32([_box(10, 10, 50, 30)])
    batch = PageCollate()([(small, poly, [], True), (large, poly, [], True)])
    assert batch.images.shape == (2, 3, 128, 160) and batch.sizes == [(96, 64), (120, 150)]
    assert batch.page_size(0) == (96, 64) and torch.equal(batch.images[0, :, :96, :64], small)
    for key in ("prob_mask", "thresh_mask"):
        assert batch.maps[key][0, 96:].sum() == 0 and batch.maps[key][0, :, 64:].sum() == 0
    assert batch.maps["prob_mask"][0, :96, :64].sum() == 96 * 64
    same, sizes = pad_batch([small, small])
    assert same.shape == (2, 3, 96, 64) and sizes == [(96, 64)] * 2  # already a stride multiple: as stacked


class TargetOracle(nn.Module):
    """A perfect DBNet for validation: its probability logits are the DB target the task feeds it (so every
    step between the page and the metric is the task's own: scaling, padding, masks, post-processing)."""

    def forward(self, images, prob_target, prob_mask, thresh_target, thresh_mask):
        return {"logits": (prob_target[:, None] * 2 - 1) * 20, "losses": torch.zeros(len(images))}


class RedOracle(nn.Module):
    """A perfect detector of red boxes on a white page (the padding is black): logits from the normalised input."""

    def forward(self, images):
        rgb = images * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)
        red = (rgb[:, 0] > 0.5) & (rgb[:, 1] < 0.5)
        return {"logits": (red[:, None].float() * 2 - 1) * 20}


def test_whole_pages_at_native_scale_map_back_exactly(tmp_path):
    """Validation on pages of two sizes in one padded batch scores a perfect detector perfectly, and --det-size auto
    finds a page's words in its own pixels (the box a DB post-processor gives a filled rectangle, to within its
    pixel grid), at native scale and scaled down to a cap."""
    from scale_ocr.data.loader import EvalShard

    task = create_task(ModelConfig(arch=DET, input_size=(128, 128), page_scale="native", max_page_side=512))
    boxes = [[(20, 30, 80, 50), (100, 120, 170, 140)], [(40, 200, 120, 230), (10, 10, 60, 28)]]
    pages = [(_page(200, 150, b), np.float32([_box(*x) for x in b]), []) for b in boxes[:1]]
    pages.append((_page(150, 250, boxes[1]), np.float32([_box(*x) for x in boxes[1]]), []))
    tf = task.transform(train=False)
    data = EvalShard([tf(*p) for p in pages], 0, 1)
    loader = torch.utils.data.DataLoader(data, batch_size=2, collate_fn=PageCollate())
    m = task.evaluate(TargetOracle(), loader, torch.device("cpu"), contextlib.nullcontext).metrics
    assert m["recall"] == 1 and m["precision"] == 1 and m["mean_iou"] > 0.85, m
    # A page of 300x420 (not a stride multiple: padded) read whole, and scaled down to a 256 cap: the boxes are
    # those the post-processing finds on the page's own map, in page pixels (exactly, unscaled).
    truth = [(30, 40, 150, 70), (200, 300, 280, 330), (50, 380, 90, 400)]
    page = _page(300, 420, truth)
    red = np.asarray(page)[..., 1] < 128
    want = sorted((b.polygon * [300, 420]).round(3).tolist() for b in task.boxes(red.astype(np.float32)))
    assert len(want) == 3
    for det_size, cap, tol in (("auto", None, 1e-3), (None, None, 1e-3), ("auto", 256, 2.5)):
        found = task.detect(RedOracle(), [page], input_size=det_size, max_side=cap)[0]
        got = sorted(np.round(p, 3).tolist() for p, _ in found)
        assert len(got) == 3 and np.abs(np.subtract(got, want)).max() <= tol, (det_size, cap, got, want)


def test_page_scale_faults_are_one_line():
    from scale_ocr.cli.args import parse_config
    from scale_ocr.cli.page_ocr import check_models  # noqa: F401 - page OCR imports cleanly

    cases = [(["--page-scale", "big"], "--page-scale 'big'"), (["--page-scale", "0"], "between 0.05 and 8"),
             (["--max-page-side", "1000"], "multiple of 32"),
             (["--train-path", "x", "--max-page-side", "256"], "below the 512x512 crops"),
             (["crnn_mobilenet_v3_small", "--page-scale", "native"], "reads word crops")]
    for flags, words in cases:
        argv = flags if flags[0].startswith("crnn") else [DET, *flags]
        with pytest.raises(UserError, match=words.replace("(", r"\(")):
            parse_config(argv)
    from scale_ocr.data.synthetic_pages import main as pages_main

    for flags, words in ((["--size", "1650x"], "a size HxW"), (["--size", "40"], "from 64 to 8192"),
                         (["--text-scale", "20"], "from 0.25 to 8")):
        with pytest.raises(UserError, match=words):
            pages_main(["unused-out", *flags])
    cfg = parse_config([DET, "--train-path", "x"])
    assert (cfg.model.page_scale, cfg.model.max_page_side) == ("native", 2048)  # real pages: their own pixels
    assert parse_config([DET]).model.page_scale == "fit"  # synthetic pages, rendered at the input size
    assert parse_config(["doctr:db_resnet50", "--train-path", "x"]).model.page_scale == "fit"  # as docTR reads
    assert parse_config([DET, "--page-scale", "0.50"]).model.page_scale == "0.5"


def test_native_training_end_to_end(tmp_path, capsys):
    """A few steps on native-scale crops of synthetic pages larger than the input, validated on whole pages; the
    model file records how it reads pages, and page OCR reads them that way by default."""
    from scale_ocr.checkpoint.export import LoadedModel, load_any
    from scale_ocr.cli.main import main as cli
    from scale_ocr.cli.page_ocr import evaluate_pages
    from scale_ocr.data.synthetic_pages import write_detection_folder
    from scale_ocr.train import main as train_main

    folder = write_detection_folder(tmp_path / "pages", 4, seed=1, size=(224, 160), text_scale=0.5)
    run = tmp_path / "run"
    code = train_main([DET, "--strategy", "single", "--train-path", str(folder), "--val-path", str(folder),
                       "--input-size", "128x128", "-b", "2", "--max-steps", "2", "--output-dir", str(run),
                       "--wandb-mode", "disabled", "--max-page-side", "192"])
    assert code == 0
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["page_scale"] == "native" and config["page_scale"] == "native"
    summary = json.loads((run / "metrics.json").read_text())
    assert 0 <= summary["hmean"] <= 1 and np.isfinite(summary["val_loss"])
    det = load_any(run / "best_model.pt")
    assert det.task.page_scale == "native" and det.task.max_page_side == 192 and det.task.reads_whole_pages(None)
    capsys.readouterr()
    assert cli(["predict", str(run / "best_model.pt"), str(folder / "images" / "page_00000.png")]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    for box in json.loads(line)["boxes"]:  # page pixels: the page is 160 wide, 224 high, read at 137x192
        assert all(0 <= x <= 160 and 0 <= y <= 224 for x, y in box["polygon"])
    # Page OCR reads the pages whole too (an untrained recognizer: only the plumbing is checked).
    reco_task = create_task(ModelConfig(arch="crnn_mobilenet_v3_small", input_size=(32, 128)))
    reco = LoadedModel(reco_task.build_model().eval(), reco_task)
    assert evaluate_pages(det, reco, [folder], det_size="auto", max_side=160)["pages"] == 4
    # A cap that is no stride multiple, or one beside a fixed --det-size, is one line before any model is read.
    page = str(folder / "images" / "page_00000.png")
    for flags, words in ((["--max-page-side", "100"], "multiple of 32"), (["--det-size", "128", "--max-page-side",
                                                                          "256"], "drop one of them")):
        assert cli(["predict", "--det", "missing", "--reco", "missing", page, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
