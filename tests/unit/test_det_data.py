"""Detection data: docTR page folders checked at start-up, synthetic pages, and box-keeping transforms."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from scale_ocr.data import synthetic
from scale_ocr.data.det_transforms import DetCompose, RandomCrop, RandomRotate, ResizePage, build_det_transform
from scale_ocr.data.detection import DetectionFolder
from scale_ocr.data.files import PAGE_LIMITS, WORD_LIMITS, BadImage, load_image
from scale_ocr.data.synthetic_pages import SyntheticPages, render_page, write_detection_folder
from scale_ocr.data.transforms import MEAN, STD
from scale_ocr.errors import UserError

BOX = [[4, 4], [40, 4], [40, 20], [4, 20]]


def _gray(img) -> np.ndarray:
    """Luminance 0..255 of a PIL page or of a normalised (3, H, W) tensor."""
    if isinstance(img, torch.Tensor):
        img = (img * torch.tensor(STD).view(3, 1, 1) + torch.tensor(MEAN).view(3, 1, 1)).clamp(0, 1) * 255
        return img.mean(0).numpy()
    return np.asarray(img.convert("L"), dtype=np.float64)


def _ink_contrast(img, polygons) -> float:
    """Paper brightness (median outside the polygons) minus the mean brightness inside them."""
    gray = _gray(img)
    mask = Image.new("L", gray.shape[::-1], 0)
    for poly in polygons:
        ImageDraw.Draw(mask).polygon([tuple(p) for p in poly], fill=1)
    inside = np.asarray(mask, dtype=bool)
    return float(np.median(gray[~inside]) - gray[inside].mean())


def _page_folder(root, entry, name="p.png", size=(64, 48)):
    """A folder with one good page and one page labelled ``entry`` (a plain white W x H image)."""
    (root / "images").mkdir(parents=True)
    for n in ("good.png", name):
        if "/" not in n and not n.startswith("/"):
            Image.new("RGB", size, (255, 255, 255)).save(root / "images" / n)
    good = {"img_dimensions": [size[1], size[0]], "polygons": [BOX], "words": ["ok"]}
    (root / "labels.json").write_text(json.dumps({"good.png": good, name: entry}))
    return root


def test_written_folder_loads_with_polygons_on_the_ink(tmp_path):
    folder = write_detection_folder(tmp_path / "pages", 3, seed=0, size=(256, 256))
    ds = DetectionFolder((str(folder),))
    assert len(ds) == 3 and ds.report.num_skipped == 0
    for i in range(3):
        img, polygons, words = ds[i]
        assert polygons.dtype == np.float32 and polygons.shape == (len(words), 4, 2) and words
        assert _ink_contrast(img, polygons) > 40  # text inside the boxes, paper outside


def test_written_labels_are_what_was_rendered(tmp_path):
    folder = write_detection_folder(tmp_path / "pages", 2, seed=5, size=(128, 128))
    ds = DetectionFolder((str(folder),))
    for i in range(2):
        page, polygons, words = render_page(5, i, (128, 128))
        got_img, got_polygons, got_words = ds[i]
        assert got_words == words and np.abs(got_polygons - polygons).max() < 0.01
        assert np.array_equal(np.asarray(got_img), np.asarray(page))


SECRET = "/etc/hostname"
BAD = {  # name: (key, entry, skip reason, words of the one-line message)
    "three_points": ("p.png", {"polygons": [BOX[:3]]}, "bad_polygon", "polygon 0 of 'p.png' is not a polygon"),
    "not_points": ("p.png", {"polygons": [[[1, 2, 3]] * 4]}, "bad_polygon", "is not a polygon"),
    "huge_int": ("p.png", {"polygons": [[0, 0, 10**400, 5]]}, "bad_polygon", "is not a polygon"),
    "non_finite": ("p.png", {"polygons": [[[0, 0], [9, 0], [9, float("nan")], [0, 9]]]}, "bad_polygon",
                   "non-finite"),
    "reversed_box": ("p.png", {"polygons": [[30, 5, 10, 15]]}, "bad_polygon", "xmin > xmax"),
    "outside": ("p.png", {"polygons": [[[0, 0], [70, 0], [70, 9], [0, 9]]]}, "outside_image",
                "point (70, 0) outside the 64x48 image"),
    "degenerate": ("p.png", {"polygons": [[[0, 0], [10, 10], [20, 20], [30, 30]]]}, "degenerate_polygon",
                   "has no area"),
    "on_the_edge": ("p.png", {"polygons": [[[64, 0], [64.5, 0], [64.5, 9], [64, 9]]]}, "degenerate_polygon",
                    "has no area"),
    "dimensions": ("p.png", {"img_dimensions": [64, 48], "polygons": [BOX]}, "bad_dimensions",
                   "is [64, 48] but the image is 64 wide and 48 high; write [48, 64]"),
    "no_polygons": ("p.png", {"img_dimensions": [48, 64]}, "bad_label", "has no \"polygons\""),
    "words_count": ("p.png", {"polygons": [BOX, BOX], "words": ["one"]}, "bad_words", "has 1 words for 2 polygons"),
    "hash": ("p.png", {"polygons": [BOX], "img_hash": "0" * 64}, "hash_mismatch", "is not the SHA-256"),
    "absolute_key": (SECRET, {"polygons": [BOX]}, "outside_folder", f"the key {SECRET!r} points outside"),
    "dotdot_key": ("../../x.png", {"polygons": [BOX]}, "outside_folder", "the key '../../x.png' points outside"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_label_is_one_line_naming_the_file(tmp_path, case):
    name, entry, _, words = BAD[case]
    folder = _page_folder(tmp_path / "d", entry, name)
    with pytest.raises(UserError) as err:
        DetectionFolder((str(folder),))
    line = str(err.value)
    assert "\n" not in line and str(folder / "labels.json") in line and words in line, line
    assert "--on-bad-sample skip" in line


@pytest.mark.parametrize("case", BAD)
def test_bad_label_skipped_as_a_counted_reason(tmp_path, case):
    name, entry, reason, _ = BAD[case]
    ds = DetectionFolder((str(_page_folder(tmp_path / "d", entry, name)),), on_bad_sample="skip")
    assert len(ds) == 1 and ds.report.skipped == {reason: 1} and ds.report.kept == 1


def test_symlinked_and_missing_pages_skipped_like_word_crops(tmp_path):
    secret = tmp_path / "secret.png"
    Image.new("RGB", (64, 48)).save(secret)
    folder = _page_folder(tmp_path / "d", {"polygons": [BOX]}, "link.png")
    (folder / "images" / "link.png").unlink()
    (folder / "images" / "link.png").symlink_to(secret)
    labels = json.loads((folder / "labels.json").read_text())
    (folder / "labels.json").write_text(json.dumps({**labels, "gone.png": {"polygons": []}}))
    ds = DetectionFolder((str(folder),), on_bad_sample="skip")
    assert len(ds) == 1 and ds.report.skipped == {"outside_folder": 1, "missing_image": 1}


@pytest.mark.parametrize("polygons,expected", [
    ([[4, 4, 40, 20]], [BOX]),  # a box
    ([[[40, 20], [4, 4], [40, 4], [4, 20]]], [BOX]),  # points in any order
    ({"words": [BOX], "artefacts": [[10, 30, 20, 40]]}, [BOX, [[10, 30], [20, 30], [20, 40], [10, 40]]]),
    ([[[-0.5, 4], [64.8, 4], [64.8, 20], [-0.5, 20]]], [[[0, 4], [64, 4], [64, 20], [0, 20]]]),  # 1 px tolerance
    ([[[10, 4], [20, 2], [30, 4], [30, 10], [20, 12], [10, 10]]],
     [[[10, 2], [30, 2], [30, 12], [10, 12]]]),  # 6 points: their rotated rectangle
], ids=["box", "any_order", "class_keyed", "tolerance", "six_points"])
def test_accepted_polygon_forms_become_four_clockwise_points(tmp_path, polygons, expected):
    ds = DetectionFolder((str(_page_folder(tmp_path / "d", {"polygons": polygons})),))
    _, got, words = ds[1]
    assert np.allclose(got, expected, atol=1e-4) and words == []


def test_pages_may_be_larger_than_word_crops_but_not_bombs(tmp_path):
    page, bomb = tmp_path / "page.png", tmp_path / "bomb.png"
    Image.new("1", (4200, 4200)).save(page)  # 17.6 Mpx: over a word crop's 16.8
    Image.new("1", (10000, 10000)).save(bomb)  # 100 Mpx: over Pillow's bomb limit, a few kB on disk
    with pytest.raises(BadImage, match="larger than a word crop"):
        load_image(page, WORD_LIMITS)
    assert load_image(page, PAGE_LIMITS).size == (4200, 4200)
    with pytest.raises(BadImage, match="decompression bomb.*a page"):
        load_image(bomb, PAGE_LIMITS)


def test_synthetic_pages_deterministic_per_seed_and_index():
    a = render_page(3, 5, (128, 128))
    assert np.array_equal(np.asarray(a[0]), np.asarray(render_page(3, 5, (128, 128))[0]))
    assert np.array_equal(a[1], render_page(3, 5, (128, 128))[1]) and a[2] == render_page(3, 5, (128, 128))[2]
    assert a[2] != render_page(3, 6, (128, 128))[2] and a[2] != render_page(4, 5, (128, 128))[2]
    img, polygons, words = SyntheticPages(8, seed=3, size=(128, 128))[5]
    assert np.array_equal(np.asarray(img), np.asarray(a[0])) and words == a[2]


def test_synthetic_pages_turn_boxes_with_the_page():
    angles = []
    for i in range(12):
        img, polygons, _ = render_page(1, i, (256, 256))
        assert ((polygons >= 0) & (polygons <= 256)).all()
        top = polygons[:, 1] - polygons[:, 0]  # each word's top edge, left to right
        angles += list(np.degrees(np.arctan2(-top[:, 1], top[:, 0])))
    assert max(abs(a) for a in angles) <= 5.0 + 1e-3 and sum(abs(a) > 1 for a in angles) > 10


def test_synthetic_pages_never_draw_a_word_the_turn_would_cut(monkeypatch):
    monkeypatch.setattr(synthetic, "MAX_ANGLE", 40.0)  # steep turns (page_turn) push corner words off the page
    kept = 0
    for i in range(6):
        img, polygons, words = render_page(1, i, (128, 128))
        assert ((polygons >= 0) & (polygons <= 128)).all()
        assert _ink_contrast(img, polygons) > 40 if len(words) else _gray(img).std() < 10  # all ink labelled
        kept += len(words)
    assert kept > 0


def test_eval_transform_fits_pads_and_scales_polygons():
    img, polygons, words = render_page(2, 0, (128, 256))  # H=128, W=256
    x, got, got_words = build_det_transform((128, 128), train=False)(img, polygons, words)
    assert x.shape == (3, 128, 128) and got_words == words
    assert np.allclose(got, polygons * 0.5)
    assert _gray(x)[64:].max() < 1  # bottom half: black padding, as docTR's predictor pads


def test_folder_with_transform_returns_tensor_triple(tmp_path):
    folder = write_detection_folder(tmp_path / "pages", 1, seed=0, size=(128, 96))
    x, polygons, words = DetectionFolder((str(folder),), transform=build_det_transform((64, 64), train=False))[0]
    assert x.shape == (3, 64, 64) and polygons.shape == (len(words), 4, 2) and (polygons <= 64).all()


def _crop_and_turn():
    """Training's geometric augmentations, each applied every time."""
    return DetCompose([RandomCrop(p=1.0), ResizePage((256, 256), pad=False), RandomRotate(p=1.0),
                       ResizePage((256, 256))])


@pytest.mark.parametrize("seed", range(4))
def test_crop_and_rotation_keep_polygons_on_the_text(seed):
    img, polygons, words = render_page(7, seed, (384, 384))
    torch.manual_seed(seed)
    x, got, got_words = _crop_and_turn()(img, polygons, words)
    assert len(got) == len(got_words) > 0 and ((got >= 0) & (got <= 256)).all()
    # Polygons turned the wrong way lose about half the page's ink contrast; resampling costs < 10%.
    assert _ink_contrast(x, got) > 0.85 * _ink_contrast(img, polygons)


@pytest.mark.parametrize("seed", range(4))
def test_crop_and_rotation_move_each_polygon_with_its_pixels(seed):
    _, polygons, words = render_page(7, seed, (384, 384))
    boxes = Image.new("RGB", (384, 384), (255, 255, 255))  # each polygon filled black: exact ink
    for poly in polygons:
        ImageDraw.Draw(boxes).polygon([tuple(p) for p in poly], fill=(0, 0, 0))
    torch.manual_seed(seed)
    x, got, _ = _crop_and_turn()(boxes, polygons, words)
    gray = _gray(x)
    for poly in got:  # every kept polygon still covers its own black box (edges blur: not 0)
        mask = Image.new("L", gray.shape[::-1], 0)
        ImageDraw.Draw(mask).polygon([tuple(p) for p in poly], fill=1)
        assert gray[np.asarray(mask, dtype=bool)].mean() < 80


def test_crop_drops_polygons_mostly_outside_with_their_words():
    polygons = np.float32([[[x, 10], [x + 20, 10], [x + 20, 20], [x, 20]] for x in range(0, 200, 10)])
    words = [f"w{i}" for i in range(len(polygons))]
    crop = RandomCrop(p=1.0, scale=(0.25, 0.25), ratio=(1.0, 1.0))
    torch.manual_seed(0)
    torch.rand(())
    x0, y0, x1, y1 = crop.window(200, 40)
    torch.manual_seed(0)
    _, got, got_words = crop(Image.new("RGB", (200, 40)), polygons, words)
    share_y = max(0, min(20, y1) - max(10, y0)) / 10
    inside = [max(0, min(x + 20, x1) - max(x, x0)) / 20 * share_y for x in range(0, 200, 10)]
    expect = [w for w, f in zip(words, inside, strict=True) if f >= 0.5]
    assert got_words == expect and len(got) == len(expect)


def test_train_transform_reproducible_from_torch_seed():
    img, polygons, words = render_page(0, 1, (160, 160))
    transform = build_det_transform((128, 128), train=True)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(transform(img, polygons, words))
    assert torch.equal(runs[0][0], runs[1][0]) and np.array_equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[2][0])


def test_rotation_turns_the_page_the_way_the_polygons_turn():
    img = Image.new("RGB", (100, 60), (255, 255, 255))
    ImageDraw.Draw(img).rectangle((70, 10, 79, 19), fill=(0, 0, 0))
    torch.manual_seed(0)
    rot, got, _ = RandomRotate(degrees=30, p=1.0)(img, np.float32([[[70, 10], [80, 10], [80, 20], [70, 20]]]), [])
    gray = _gray(rot)
    ys, xs = np.nonzero(gray < 128)
    assert math.dist((xs.mean() + 0.5, ys.mean() + 0.5), got[0].mean(axis=0)) < 1.0
