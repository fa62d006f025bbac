"""Page OCR: word crops, detector + recognizer plumbing, end-to-end metrics and the page commands.

Untrained models read nothing, so the plumbing is tested with oracles: a detector that outputs DB's own
target map of the true words (what a perfectly trained DBNet would) and a recognizer that finds where each
crop was cut from and reads the true word there.
"""

import hashlib
import json

import cv2
import numpy as np
import pytest
import torch
from conftest import make_folder
from PIL import Image, ImageDraw
from torch import nn

from scale_ocr.boxes import box_iou
from scale_ocr.checkpoint.export import LoadedModel, save_export
from scale_ocr.cli.main import main
from scale_ocr.cli.page_ocr import crop_words, evaluate_pages, read_pages
from scale_ocr.config import ModelConfig
from scale_ocr.data.det_transforms import build_det_transform
from scale_ocr.data.detection import DetectionFolder
from scale_ocr.data.synthetic_pages import write_detection_folder
from scale_ocr.errors import UserError
from scale_ocr.models.detection.targets import build_targets
from scale_ocr.tasks import create_task

RECO_ARCH, DET_ARCH = "crnn_mobilenet_v3_small", "db_mobilenet_v3_large"


def _key(image: torch.Tensor) -> str:
    return hashlib.sha1(image.numpy().tobytes()).hexdigest()


class OracleDetector(nn.Module):
    """Logits high inside DB's shrunk kernels of the true words of whichever known page it is shown."""

    def __init__(self, input_size: tuple[int, int], pages: list[tuple[Image.Image, np.ndarray]]) -> None:
        super().__init__()
        tf = build_det_transform(input_size, train=False)
        self.maps = {}
        for page, polygons in pages:
            image, scaled, _ = tf(page, polygons)  # polygons in the model input's pixels, as the page is resized
            self.maps[_key(image)] = torch.from_numpy(build_targets(scaled, *input_size)["prob_target"])

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": torch.stack([(self.maps[_key(im)] * 2 - 1) * 20 for im in images])[:, None]}


def oracle_reader(pages: list[tuple[Image.Image, np.ndarray, list[str]]], spoil: bool = False):
    """A ``recognize`` that locates each crop on the known pages (an exact pixel match) and reads the true
    word under it; ``spoil`` misreads every word."""
    grey = [np.asarray(page.convert("L"), np.float32) for page, _, _ in pages]

    def recognize(model, crops, batch_size=64):
        out = []
        for crop in crops:
            c = np.asarray(crop.convert("L"), np.float32)
            found = [cv2.minMaxLoc(cv2.matchTemplate(g, c, cv2.TM_SQDIFF))[::2] for g in grey]  # (error, (x, y))
            k = int(np.argmin([err for err, _ in found]))
            (x, y), (_, polygons, words) = found[k][1], pages[k]
            iou = box_iou([[x, y, x + c.shape[1], y + c.shape[0]]], polygons)[0]
            text = words[int(np.argmax(iou))] if iou.max() > 0 else ""
            out.append((text[::-1] + "~" if spoil else text, 0.9))
        return out

    return recognize


def oracle_pair(pages, input_size=(256, 256), spoil=False) -> tuple[LoadedModel, LoadedModel]:
    det_task = create_task(ModelConfig(arch=DET_ARCH, input_size=input_size))
    detector = LoadedModel(OracleDetector(input_size, [(p, polys) for p, polys, _ in pages]), det_task)
    reco_task = create_task(ModelConfig(arch=RECO_ARCH, input_size=(32, 128)))
    reco_task.recognize = oracle_reader(pages, spoil)  # this instance only
    return detector, LoadedModel(nn.Identity(), reco_task)


def _rect(x0, y0, x1, y1):
    return [[x0, y0], [x1, y0], [x1, y1], [x0, y1]]


def test_crop_words_straightens_a_rotated_word():
    page = Image.new("RGB", (200, 200), "white")
    angle = np.deg2rad(20)
    axes = np.array([[np.cos(angle), np.sin(angle)], [-np.sin(angle), np.cos(angle)]])  # along, down the word
    corners = np.array([[-40, -10], [40, -10], [40, 10], [-40, 10]]) @ axes + 100  # 80 x 20, turned by 20 degrees
    ImageDraw.Draw(page).polygon([tuple(p) for p in corners], fill="black")
    (crop,) = crop_words(page, [corners], pad=0)
    assert abs(crop.width - 80) <= 1 and abs(crop.height - 20) <= 1, crop.size  # not the 82 x 46 bounding box
    assert np.asarray(crop.convert("L")).mean() < 0.15 * 255  # upright: ink everywhere, no white corners


def test_crop_words_pads_upright_boxes_and_clips_them_to_the_page():
    page = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 80, 3), dtype=np.uint8))
    inside, at_edge = crop_words(page, [_rect(10, 10, 30, 20), _rect(70, 40, 80, 50)], pad=2)
    assert inside.tobytes() == page.crop((8, 8, 32, 22)).tobytes()
    assert at_edge.tobytes() == page.crop((68, 38, 80, 50)).tobytes()


def test_crop_words_gives_none_for_a_box_with_no_area_on_the_page():
    page = Image.new("RGB", (80, 50), "white")
    crops = crop_words(page, [_rect(10, 10, 30, 10), _rect(90, 10, 120, 20), _rect(5, 5, 20, 15)], pad=1)
    assert crops[0] is None and crops[1] is None and crops[2].size == (17, 12)  # parallel to the polygons


def _page_with_boxes():
    """A 480 x 320 noisy page with dark words: a title, then two lines; listed out of reading order."""
    rng = np.random.default_rng(1)
    pixels = rng.integers(190, 256, (320, 480, 3), dtype=np.uint8)
    words = {"title": (40, 20, 440, 60), "a1": (40, 100, 140, 130), "a2": (170, 100, 300, 130),
             "a3": (330, 100, 440, 130), "b1": (40, 160, 200, 190), "b2": (230, 160, 440, 190)}
    for x0, y0, x1, y1 in words.values():
        pixels[y0:y1, x0:x1] = rng.integers(0, 60, (y1 - y0, x1 - x0, 3))
    names = list(words)[::-1]
    return Image.fromarray(pixels), np.array([_rect(*words[n]) for n in names], np.float64), names


def test_read_pages_returns_words_in_reading_order_in_page_pixels():
    page, polygons, names = _page_with_boxes()
    detector, recognizer = oracle_pair([(page, polygons, names)], input_size=(256, 256))  # page is 480 x 320
    (words,) = read_pages(detector, recognizer, [page])
    assert [w["text"] for w in words] == ["title", "a1", "a2", "a3", "b1", "b2"]
    truth = dict(zip(names, polygons, strict=True))
    # Un-scaled from the detector's 256 x 256 input back to the page: centred on the true words. (DB's unclip
    # does not quite undo its shrink on long thin words, so the boxes are a little smaller than the truth.)
    shifts = [np.linalg.norm(np.mean(w["polygon"], 0) - truth[w["text"]].mean(0)) for w in words]
    ious = [box_iou([w["polygon"]], [truth[w["text"]]])[0, 0] for w in words]
    assert max(shifts) < 3 and min(ious) > 0.6, (shifts, ious)
    assert json.loads(json.dumps(words)) == words and all(w["box_score"] > 0.9 for w in words)


def test_read_pages_runs_the_detector_at_det_size():
    # The oracle only knows the page fitted into 384 x 384, while the detector was "trained" at 256 x 256.
    page, polygons, names = _page_with_boxes()
    detector, recognizer = oracle_pair([(page, polygons, names)], input_size=(384, 384))
    detector.task.input_size = (256, 256)
    with pytest.raises(KeyError):
        read_pages(detector, recognizer, [page])
    (words,) = read_pages(detector, recognizer, [page], det_size=(384, 384))
    assert [w["text"] for w in words] == ["title", "a1", "a2", "a3", "b1", "b2"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_detection_folder(tmp_path_factory.mktemp("pages"), num_pages=3, seed=0, size=(256, 256))


@pytest.mark.parametrize("spoil", [False, True])
def test_evaluate_pages_reads_words_only_when_their_text_is_right(folder, spoil):
    data = DetectionFolder((str(folder),))
    pages = [data[i] for i in range(len(data))]
    detector, recognizer = oracle_pair(pages, input_size=(384, 384), spoil=spoil)
    m = evaluate_pages(detector, recognizer, [folder])
    assert m["pages"] == 3 and m["gt_words"] == sum(len(w) for _, _, w in pages)
    assert m["recall"] >= 0.9 and m["precision"] >= 0.9, m
    assert m["unread_boxes"] == 0
    if spoil:
        assert m["word_recall"] == 0.0 and m["ci_word_recall"] == 0.0, m
    else:
        assert m["word_recall"] >= 0.9 and m["word_precision"] >= 0.9, m


def test_boxes_read_as_nothing_are_not_words_but_still_score_the_detector(folder):
    data = DetectionFolder((str(folder),))
    pages = [data[i] for i in range(len(data))]
    detector, recognizer = oracle_pair(pages, input_size=(384, 384))
    truth = recognizer.task.recognize
    recognizer.task.recognize = lambda model, crops, batch_size=64: [("", c) if i % 2 else (t, c) for i, (t, c)
                                                                      in enumerate(truth(model, crops, batch_size))]
    m = evaluate_pages(detector, recognizer, [folder])
    words = read_pages(detector, recognizer, [p for p, _, _ in pages])
    assert all(w["text"] for page in words for w in page)  # page OCR's output holds only words read
    assert m["unread_boxes"] > 0 and m["pred_words"] + m["unread_boxes"] == sum(len(w) for _, _, w in pages)
    assert m["recall"] >= 0.9 and m["precision"] >= 0.9, m  # every box scores the detector
    assert 0.35 < m["word_recall"] < 0.65 and m["word_precision"] >= 0.9, m


def test_evaluate_pages_refuses_pages_without_words(folder, tmp_path):
    import shutil

    bare = shutil.copytree(folder, tmp_path / "bare")
    labels = json.loads((bare / "labels.json").read_text())
    for entry in labels.values():
        del entry["words"]
    (bare / "labels.json").write_text(json.dumps(labels))
    detector, recognizer = oracle_pair([])
    with pytest.raises(UserError, match="has no \"words\""):
        evaluate_pages(detector, recognizer, [bare])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Real (untrained) exports: the commands load them as users' files."""
    out = tmp_path_factory.mktemp("models")
    paths = {}
    for kind, arch, size in (("det", DET_ARCH, (64, 64)), ("reco", RECO_ARCH, (32, 128))):
        task = create_task(ModelConfig(arch=arch, input_size=size))
        paths[kind] = str(save_export(task.build_model(), task, out / f"{kind}.safetensors"))
    return paths


@pytest.fixture()
def page_file(tmp_path):
    path = tmp_path / "page.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 80, 3), dtype=np.uint8)).save(path)
    return str(path)


def test_predict_pages_refuses_a_recognizer_as_detector(models, page_file, capsys):
    assert main(["predict", "--det", models["reco"], "--reco", models["reco"], page_file]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and models["reco"] in err and "detection model" in err, err


def test_predict_pages_prints_json_lines_and_writes_the_overlay(models, page_file, tmp_path, capsys):
    out = tmp_path / "overlay.png"
    assert main(["predict", "--det", models["det"], "--reco", models["reco"], page_file, "--overlay", str(out)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line)["page"] == page_file and isinstance(json.loads(line)["words"], list)
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size == (80, 48)


@pytest.mark.parametrize("case", ["overlay_exists", "overlay_dir_file_exists", "overlay_with_two_pages"])
def test_predict_pages_never_overwrites_and_wants_a_dir_for_many_pages(models, page_file, tmp_path, capsys, case):
    target = tmp_path / "out" / ("page.png" if case == "overlay_dir_file_exists" else "taken.png")
    target.parent.mkdir()
    target.write_bytes(b"keep")
    flags = {"overlay_exists": ["--overlay", str(target)],
             "overlay_dir_file_exists": ["--overlay-dir", str(target.parent)],
             "overlay_with_two_pages": [page_file, "--overlay", str(tmp_path / "new.png")]}[case]
    assert main(["predict", "--det", models["det"], "--reco", models["reco"], page_file, *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured
    assert target.read_bytes() == b"keep" and not (tmp_path / "new.png").exists()


def test_predict_keeps_the_single_model_form(models, page_file, capsys):
    assert main(["predict", models["reco"], page_file]) == 0
    name, word, confidence = capsys.readouterr().out.rstrip("\n").split("\t")
    assert name == page_file and 0.0 <= float(confidence) <= 1.0


def test_evaluate_pages_command_prints_a_table_or_json(models, folder, capsys):
    argv = ["evaluate-pages", "--det", models["det"], "--reco", models["reco"], str(folder)]
    assert main(argv) == 0
    assert "word recall" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["pages"] == 3 and {"recall", "word_recall", "ci_word_precision"} <= set(metrics)
    assert main([*argv, "--json", "--det-size", "96"]) == 0  # one number: a square
    assert json.loads(capsys.readouterr().out)["pages"] == 3
    assert main([*argv, "--det-size", "100x100"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--det-size 100x100" in err and "96x96" in err, err


def test_synthetic_pages_command_writes_a_new_evaluation_folder_only(tmp_path, capsys):
    from scale_ocr.data.synthetic_pages import main as pages_main

    out = tmp_path / "pages"
    assert pages_main([str(out), "--pages", "2", "--size", "128"]) == 0
    labels = json.loads((out / "labels.json").read_text())
    assert sorted(labels) == ["page_00000.png", "page_00001.png"]
    assert all(len(e["words"]) == len(e["polygons"]) for e in labels.values())
    before = (out / "labels.json").read_bytes()
    with pytest.raises(UserError, match="already exists"):
        pages_main([str(out), "--pages", "3"])
    assert (out / "labels.json").read_bytes() == before


def test_evaluate_measures_a_model_on_labelled_folders_as_validation_does(models, folder, tmp_path, capsys):
    """`scale-ocr evaluate MODEL DIR`: a recognizer's exact match and CER on word crops, a detector's recall and
    precision on pages, the same numbers as the task's validation over those folders; the wrong kind of folder is
    refused in one line."""
    from scale_ocr.cli.evaluate import evaluate

    words = make_folder(tmp_path / "words", {f"{i}.png": w for i, w in enumerate(["hello", "world", "ocr42"])})
    assert main(["evaluate", models["reco"], str(words), "--json"]) == 0
    reco = json.loads(capsys.readouterr().out)
    assert reco["samples"] == 3 and reco["arch"] == RECO_ARCH and 0 <= reco["exact_match"] <= 1 and reco["cer"] > 0
    # batches of any size: the same sums (the loss's up to float rounding: a batch's sum depends on its size)
    assert evaluate(models["reco"], [str(words)], batch_size=2) == {**reco, "val_loss": pytest.approx(reco["val_loss"])}
    det = evaluate(models["det"], [str(folder)])
    assert det["samples"] == 3 and {"recall", "precision"} <= det.keys()
    assert main(["evaluate", models["reco"], str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "scale-ocr: error:" in err, err


def oracle_lines(pages: list[tuple[Image.Image, np.ndarray, list[str]]], spoil: bool = False):
    """A ``read_lines`` that locates each line crop on the known pages and reads the true words inside it, left to
    right, each with the columns it covers in the crop; ``spoil`` misreads every word."""
    grey = [np.asarray(page.convert("L"), np.float32) for page, _, _ in pages]

    def read_lines(model, crops, batch_size=64):
        out = []
        for crop in crops:
            c = np.asarray(crop.convert("L"), np.float32)
            found = [cv2.minMaxLoc(cv2.matchTemplate(g, c, cv2.TM_SQDIFF))[::2] for g in grey]
            k = int(np.argmin([err for err, _ in found]))
            (x, y), (_, polygons, words) = found[k][1], pages[k]
            w, h = crop.size
            inside = [i for i, p in enumerate(polygons)  # true words centred in the crop
                      if x <= p[:, 0].mean() <= x + w and y <= p[:, 1].mean() <= y + h]
            inside.sort(key=lambda i: polygons[i][:, 0].min())
            out.append([(words[i][::-1] + "~" if spoil else words[i], 0.9, (polygons[i][:, 0].min() - x) / w,
                         (polygons[i][:, 0].max() - x) / w) for i in inside])
        return out

    return read_lines


@pytest.mark.parametrize("spoil", [False, True])
def test_page_ocr_by_lines_reads_each_lines_words_into_their_boxes(folder, spoil):
    """The lines pipeline: the detected words grouped into lines, each line's crop read, each word read given to the
    box it was read in. With a recognizer that reads the truth, both pipelines read the same words and every line
    (line CER 0); misread, neither reads a word and the line CER is high."""
    data = DetectionFolder((str(folder),))
    pages = [data[i] for i in range(len(data))]
    detector, recognizer = oracle_pair(pages, input_size=(384, 384), spoil=spoil)
    recognizer.task.read_lines = oracle_lines(pages, spoil)  # this instance only
    by_words, by_lines = (evaluate_pages(detector, recognizer, [folder], read=r) for r in ("words", "lines"))
    assert by_lines["read"] == "lines" and by_lines["gt_lines"] == by_words["gt_lines"] > 3
    assert {k: by_lines[k] for k in ("recall", "word_recall", "pred_words")} == \
        {k: by_words[k] for k in ("recall", "word_recall", "pred_words")}
    if spoil:
        assert by_lines["word_recall"] == 0 and by_lines["line_cer"] > 0.5, by_lines
    else:
        assert by_lines["word_recall"] >= 0.9 and by_lines["line_cer"] <= 0.05, by_lines
    (words,) = read_pages(detector, recognizer, [pages[1][0]], det_size=(384, 384), read="lines")
    lines = [w["line"] for w in words]
    assert lines == sorted(lines) and lines[-1] > 0  # words in reading order, numbered by line


def test_reading_lines_cut_a_line_at_a_wide_gap_and_a_fixed_width_reader_refuses_lines():
    from scale_ocr.boxes import reading_lines, reading_order

    boxes = [_rect(0, 0, 40, 10), _rect(44, 0, 80, 10), _rect(200, 1, 240, 11), _rect(0, 20, 30, 30)]
    assert reading_lines(boxes, column_gap=None) == [[0, 1], [2], [3]]  # 120 px apart: 12 word heights
    assert reading_order(boxes, column_gap=None) == [0, 1, 2, 3]
    task = create_task(ModelConfig(arch=RECO_ARCH, input_size=(32, 128)))
    with pytest.raises(UserError, match="fits every crop into 32x128 pixels, which would crush a line"):
        task.read_lines(nn.Identity(), [Image.new("RGB", (300, 20))])
