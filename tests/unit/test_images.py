"""Images as users have them decode to the same upright 8-bit RGB pixels through every consumer.

A fixture set (made here with Pillow, small: 64x24 crops and 96x64 pages) holds the kinds scanners, phones and PDF
rasterisers write: 16-bit grey, 32-bit and float grey, RGBA, LA, palette with and without transparency, CMYK,
grey, 1-bit, EXIF orientations 1-8 (PNG) and a phone's EXIF-rotated JPEG, multi-frame GIF and TIFF. Each decodes
through the recognition dataset (what the training and evaluation transforms receive), the detection dataset
(training, evaluation, ``evaluate-pages``), and ``open_rgb`` (``predict`` of either task, and page OCR's
``predict --det --reco``). The result is compared with a reference made independently with Pillow's own
operations (``ImageOps.exif_transpose``, ``Image.alpha_composite`` over a white image, ``point`` for 16 bits) and,
where the fixture knows it, with the upright pixels it was made from.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from scale_ocr.data.detection import DetectionFolder
from scale_ocr.data.files import PAGE_LIMITS, WORD_LIMITS, open_rgb
from scale_ocr.data.recognition import RecognitionFolder
from scale_ocr.errors import UserError
from scale_ocr.vocab import Vocab, resolve_vocab

ROOT = Path(__file__).resolve().parents[2]
CROP, PAGE = (64, 24), (96, 64)  # (width, height)
BOX = [[8, 8], [40, 8], [40, 24], [8, 24]]  # inside a 96x64 page
# EXIF orientation -> the stored pixels of an upright image, written from the EXIF definition with numpy alone
# (row 0 / column 0 of what is stored), so the decoder's own transpose table is not used to make its fixtures.
STORED = {1: lambda u: u, 2: lambda u: u[:, ::-1], 3: lambda u: u[::-1, ::-1], 4: lambda u: u[::-1],
          5: lambda u: u.transpose(1, 0, 2), 6: lambda u: np.rot90(u, 1),
          7: lambda u: np.rot90(u, 2).transpose(1, 0, 2), 8: lambda u: np.rot90(u, -1)}


def upright(size: tuple[int, int], seed: int = 0) -> np.ndarray:
    """(H, W, 3) uint8: random colours, so any flip, turn or channel mix-up shows."""
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def smooth(size: tuple[int, int]) -> np.ndarray:
    """(H, W, 3) uint8 that survives JPEG: gradients and a dark block at the top left (an asymmetric mark)."""
    w, h = size
    x, y = np.meshgrid(np.linspace(0, 255, w), np.linspace(0, 255, h))
    u = np.stack([x, y, 255 - x], axis=-1)
    u[: h // 3, : w // 4] = 20
    return u.round().astype(np.uint8)


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def _save(path: Path, im: Image.Image, truth: np.ndarray | None, **kw) -> tuple[Path, np.ndarray | None]:
    im.save(path, **kw)
    return path, truth


def _grey16(folder: Path, size, seed) -> tuple[Path, np.ndarray]:
    v = np.random.default_rng(seed).integers(0, 65536, size[::-1]).astype(np.uint16)
    grey = ((v.astype(np.uint32) * 2 + 257) // 514).astype(np.uint8)  # round(v / 257)
    return _save(folder / "grey16.png", Image.fromarray(v), np.repeat(grey[..., None], 3, -1))


def _grey16b(folder: Path, size, seed) -> tuple[Path, np.ndarray]:
    v = np.random.default_rng(seed).integers(0, 65536, size[::-1]).astype(np.uint16)
    grey = np.rint(v / 257).astype(np.uint8)
    im = Image.frombytes("I;16B", size, v.astype(">u2").tobytes())
    return _save(folder / "grey16b.tif", im, np.repeat(grey[..., None], 3, -1))


def _int32(folder: Path, size, seed) -> tuple[Path, np.ndarray]:
    """32-bit integers within 0..65535 (a 16-bit scan some tools store as I): read as 16 bits."""
    v = np.random.default_rng(seed).integers(0, 65536, size[::-1]).astype(np.int32)
    grey = np.rint(v / 257).astype(np.uint8)
    return _save(folder / "int32.tif", Image.fromarray(v, "I"), np.repeat(grey[..., None], 3, -1))


def _float(folder: Path, size, seed, lo: float, hi: float, name: str) -> tuple[Path, np.ndarray]:
    f = np.random.default_rng(seed).uniform(lo, hi, size[::-1]).astype(np.float32)
    f[0, 0], f[-1, -1] = lo, hi
    grey = np.rint(f * 255 if (lo, hi) == (0, 1) else (f.astype(np.float64) - lo) * (255 / (hi - lo)))
    return _save(folder / name, Image.fromarray(f, "F"), np.repeat(grey.astype(np.uint8)[..., None], 3, -1))


def _rgba(folder: Path, size, seed) -> tuple[Path, np.ndarray]:
    """A transparent-black background (what design tools export) with opaque ink: white paper, ink kept."""
    ink = upright(size, seed)
    alpha = np.where(np.random.default_rng(seed + 1).random(size[::-1]) < 0.3, 255, 0).astype(np.uint8)
    rgba = np.dstack([np.where(alpha[..., None] == 255, ink, 0), alpha]).astype(np.uint8)
    return _save(folder / "rgba.png", Image.fromarray(rgba, "RGBA"), np.where(alpha[..., None] == 255, ink, 255))


def _la(folder: Path, size, seed) -> tuple[Path, None]:
    rng = np.random.default_rng(seed)
    la = np.dstack([rng.integers(0, 256, size[::-1]), rng.integers(0, 256, size[::-1])]).astype(np.uint8)
    return _save(folder / "la.png", Image.fromarray(la, "LA"), None)


def _palette(folder: Path, size, seed, transparent: bool) -> tuple[Path, np.ndarray]:
    idx = np.random.default_rng(seed).integers(0, 4, size[::-1]).astype(np.uint8)
    colours = np.array([[200, 30, 30], [20, 20, 20], [30, 200, 60], [240, 240, 10]], dtype=np.uint8)
    im = Image.fromarray(idx, "P")
    im.putpalette(colours.ravel().tolist())
    truth = colours[idx]
    if transparent:  # index 0 is the transparent one: it becomes white paper
        truth = np.where(idx[..., None] == 0, 255, truth).astype(np.uint8)
        return _save(folder / "palette_trns.png", im, truth, transparency=0)
    return _save(folder / "palette.png", im, truth)


def _cmyk(folder: Path, size, seed) -> tuple[Path, None]:
    cmyk = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 4)).astype(np.uint8)
    return _save(folder / "cmyk.tif", Image.fromarray(cmyk, "CMYK"), None)


def _grey(folder: Path, size, seed, mode: str) -> tuple[Path, np.ndarray]:
    g = np.random.default_rng(seed).integers(0, 256, size[::-1]).astype(np.uint8)
    if mode == "1":
        g = np.where(g < 128, 0, 255).astype(np.uint8)
    return _save(folder / f"grey_{mode}.png", Image.fromarray(g, "L").convert(mode), np.repeat(g[..., None], 3, -1))


def _exif_png(folder: Path, size, seed, orientation: int) -> tuple[Path, np.ndarray]:
    u = upright(size, seed)
    stored = np.ascontiguousarray(STORED[orientation](u))
    return _save(folder / f"exif{orientation}.png", Image.fromarray(stored, "RGB"), u, exif=_exif(orientation))


def _exif_jpeg(folder: Path, size, seed) -> tuple[Path, np.ndarray]:
    """A phone's photo: stored on its side (orientation 6), shown upright. JPEG is lossy: compared within 8."""
    u = smooth(size)
    stored = np.ascontiguousarray(STORED[6](u))
    return _save(folder / "exif6.jpg", Image.fromarray(stored, "RGB"), u, exif=_exif(6), quality=95, subsampling=0)


def _frames(folder: Path, size, seed, fmt: str) -> tuple[Path, np.ndarray]:
    first, second = (np.full((size[1], size[0], 3), c, np.uint8) for c in ((200, 30, 30), (30, 30, 200)))
    first[: size[1] // 2] = (20, 20, 20)  # an upper half, so the first frame is not just a colour
    frames = [Image.fromarray(f, "RGB") for f in (first, second)]
    return _save(folder / f"frames.{fmt}", frames[0], first, save_all=True, append_images=frames[1:])


KINDS = {
    "grey16": _grey16, "grey16b": _grey16b, "int32": _int32,
    "float01": lambda f, s, n: _float(f, s, n, 0.0, 1.0, "float01.tif"),
    "float_wide": lambda f, s, n: _float(f, s, n, -3.0, 5.0, "float_wide.tif"),
    "rgba": _rgba, "la": _la,
    "palette": lambda f, s, n: _palette(f, s, n, False), "palette_trns": lambda f, s, n: _palette(f, s, n, True),
    "cmyk": _cmyk, "grey_L": lambda f, s, n: _grey(f, s, n, "L"), "grey_1": lambda f, s, n: _grey(f, s, n, "1"),
    **{f"exif{k}": (lambda f, s, n, k=k: _exif_png(f, s, n, k)) for k in range(1, 9)},
    "exif6_jpeg": _exif_jpeg,
    "frames_gif": lambda f, s, n: _frames(f, s, n, "gif"), "frames_tif": lambda f, s, n: _frames(f, s, n, "tiff"),
}


def reference(path: Path) -> np.ndarray:
    """The decoded pixels, made with Pillow's own operations rather than scale_ocr's."""
    with Image.open(path) as im:
        im = ImageOps.exif_transpose(im)
        if im.mode.startswith("I"):  # the full 16-bit range onto 8 bits, rounded (point needs I;16 or I)
            im = (im if im.mode in ("I;16", "I") else im.convert("I")).point(lambda v: v / 257 + 0.5).convert("L")
        elif im.mode == "F":  # these fixtures' floats: 0..1, or their own min..max
            lo, hi = im.getextrema()
            im = im.point(lambda v: v * 255 + 0.5) if (lo, hi) == (0, 1) else \
                im.point(lambda v: (v - lo) * (255 / (hi - lo)) + 0.5)
            im = im.convert("L")
        if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info:
            im = Image.alpha_composite(Image.new("RGBA", im.size, "white"), im.convert("RGBA"))
        return np.asarray(im.convert("RGB"))


@pytest.fixture(scope="module")
def fixture_set(tmp_path_factory) -> dict[str, dict]:
    """Per kind, a crop in a recognition folder and a page in a detection folder, with their known pixels."""
    root = tmp_path_factory.mktemp("images")
    made: dict[str, dict] = {}
    for role, size in (("crop", CROP), ("page", PAGE)):
        folder = root / role
        (folder / "images").mkdir(parents=True)
        for seed, (kind, make) in enumerate(KINDS.items()):
            path, truth = make(folder / "images", size, seed)
            made.setdefault(kind, {})[role] = (path, truth)
        names = [made[k][role][0].name for k in KINDS]
        labels = {n: "word" for n in names} if role == "crop" else \
            {n: {"img_dimensions": [PAGE[1], PAGE[0]], "polygons": [BOX], "words": ["word"]} for n in names}
        (folder / "labels.json").write_text(json.dumps(labels))
        made["_" + role] = {"folder": folder, "names": names}
    return made


def _same(got: np.ndarray, want: np.ndarray, tolerance: int = 0) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert diff.max() <= tolerance, f"max difference {diff.max()} at {np.unravel_index(diff.argmax(), diff.shape)}"


@pytest.mark.parametrize("kind", KINDS)
def test_every_consumer_decodes_the_reference_pixels(fixture_set, kind):
    crops, pages = fixture_set["_crop"], fixture_set["_page"]
    # What the training and the evaluation transforms receive: the dataset's image, handed to the transform.
    words = RecognitionFolder((str(crops["folder"]),), Vocab(resolve_vocab("latin")), transform=np.asarray)
    det = DetectionFolder((str(pages["folder"]),))
    for role, size, limits in (("crop", CROP, WORD_LIMITS), ("page", PAGE, PAGE_LIMITS)):
        path, truth = fixture_set[kind][role]
        want = reference(path)
        assert want.shape == (size[1], size[0], 3) and want.dtype == np.uint8
        if truth is not None:  # the pixels the fixture was made from (JPEG within its loss)
            _same(want, truth, 8 if path.suffix == ".jpg" else 1 if kind == "rgba" else 0)
        _same(np.asarray(open_rgb(str(path), limits)), want)  # predict (either task) and page OCR's predict
        if role == "crop":
            _same(words[crops["names"].index(path.name)][0], want)
        else:
            _same(np.asarray(det[pages["names"].index(path.name)][0]), want)


def test_image_files_are_opened_in_one_place():
    """Every task decodes through scale_ocr.data.files.load_image: no other module opens an image file."""
    opened = [p.relative_to(ROOT).as_posix() for p in (ROOT / "scale_ocr").rglob("*.py")
              if re.search(r"Image\.open\(|cv2\.imread|imageio|read_image\(", p.read_text(encoding="utf-8"))]
    assert opened == ["scale_ocr/data/files.py"]


# --- The cases of issue 29 (docs/faults.md rows 46-50) ---

def test_full_range_16bit_grey_png_is_not_all_white(tmp_path):
    """Pillow's own convert("RGB") clips 16-bit values at 255, so a scan's full-range page came out white."""
    v = np.full((24, 64), 60000, np.uint16)  # paper
    v[8:16, 8:56] = 4000  # ink
    Image.fromarray(v).save(tmp_path / "scan16.png")
    got = np.asarray(open_rgb(str(tmp_path / "scan16.png"), WORD_LIMITS))
    assert got[0, 0].tolist() == [233] * 3 and got[10, 10].tolist() == [16] * 3  # round(v / 257)


def test_transparent_rgba_crop_is_not_all_black(tmp_path):
    """Black ink on a transparent-black background: the alpha is the only thing that tells them apart."""
    rgba = np.zeros((24, 64, 4), np.uint8)
    rgba[8:16, 8:56, 3] = 255  # opaque black ink
    Image.fromarray(rgba, "RGBA").save(tmp_path / "crop.png")
    got = np.asarray(open_rgb(str(tmp_path / "crop.png"), WORD_LIMITS))
    assert got[0, 0].tolist() == [255] * 3 and got[10, 10].tolist() == [0] * 3


def test_exif_rotated_jpeg_crop_is_fed_upright(tmp_path):
    """A phone crop stored on its side with orientation 6 trains and predicts as it is shown: 64 wide, 24 high."""
    path, truth = _exif_jpeg(tmp_path, CROP, 0)
    folder = tmp_path / "d"
    (folder / "images").mkdir(parents=True)
    path.rename(folder / "images" / path.name)
    (folder / "labels.json").write_text(json.dumps({path.name: "word"}))
    img = RecognitionFolder((str(folder),), Vocab(resolve_vocab("latin")))[0][0]
    assert img.size == CROP
    _same(np.asarray(img), truth, 8)
    assert np.asarray(open_rgb(str(folder / "images" / path.name), WORD_LIMITS)).shape == (24, 64, 3)


def test_jpeg_with_a_damaged_exif_tag_decodes_upright_but_a_tiff_with_one_is_refused(tmp_path):
    """A phone's EXIF description cut short is metadata: skipped, the orientation still read, the pixels kept. The
    same damaged tag in a TIFF describes the pixels, so that file is refused as corrupt."""
    # An IFD with orientation 6 and an ImageDescription claiming 1000 bytes beyond the end of the block.
    ifd = struct.pack("<H", 2) + struct.pack("<HHII", 0x0112, 3, 1, 6) + struct.pack("<HHII", 0x010E, 2, 1000, 5000)
    jpeg = tmp_path / "phone.jpg"
    Image.new("RGB", (20, 10), "white").save(jpeg, "JPEG",
                                             exif=b"Exif\0\0II*\0" + struct.pack("<I", 8) + ifd + b"\0" * 4)
    assert open_rgb(str(jpeg), WORD_LIMITS).size == (10, 20)  # upright: a quarter turn
    tiff = tmp_path / "scan.tif"
    Image.new("L", (20, 10), 255).save(tiff, "TIFF")
    data = bytearray(tiff.read_bytes())
    ifd_at = struct.unpack("<I", data[4:8])[0]
    count = struct.unpack("<H", data[ifd_at:ifd_at + 2])[0]
    data[ifd_at:ifd_at + 2] = struct.pack("<H", count + 1)  # the IFD as Pillow wrote it, plus the same bad tag
    data[ifd_at + 2 + 12 * count:ifd_at + 2 + 12 * count] = struct.pack("<HHII", 0x010E, 2, 1000, 5000)
    tiff.write_bytes(bytes(data))
    with pytest.raises(UserError, match="cannot be read as an image .UserWarning: Tag data larger than file"):
        open_rgb(str(tiff), WORD_LIMITS)


def _rotated_page(tmp_path: Path, dims: list[int], polygons: list) -> Path:
    folder = tmp_path / "d"
    (folder / "images").mkdir(parents=True)
    path, _ = _exif_jpeg(folder / "images", PAGE, 0)  # shown 96 wide and 64 high, stored 64 wide and 96 high
    (folder / "labels.json").write_text(json.dumps({path.name: {"img_dimensions": dims, "polygons": polygons}}))
    return folder


def test_exif_rotated_page_is_upright_and_its_labels_checked_upright(tmp_path):
    """Labels drawn on the page as shown fit it; the dark mark at its top left is inside their box."""
    ds = DetectionFolder((str(_rotated_page(tmp_path, [64, 96], [[0, 0, 24, 21]])),))
    img, polygons, _ = ds[0]
    assert img.size == PAGE and polygons.tolist() == [[[0, 0], [24, 0], [24, 21], [0, 21]]]
    assert np.asarray(img)[:21, :24].mean() < 40  # the mark, where the label says


def test_exif_rotated_page_with_stored_dimensions_is_not_told_to_swap(tmp_path):
    """img_dimensions of the stored (sideways) pixels: swapping them would train the polygons on sideways pixels,
    so the line names the EXIF orientation and the two real fixes instead."""
    with pytest.raises(UserError) as err:
        DetectionFolder((str(_rotated_page(tmp_path, [96, 64], [[0, 0, 21, 24]])),))
    line = str(err.value)
    assert "\n" not in line and "exif6.jpg" in line and "EXIF orientation 6" in line, line
    assert "96 wide and 64 high" in line and "label the upright image" in line and "write [" not in line, line
    assert "--on-bad-sample skip" in line


def test_exif_rotated_page_polygon_outside_names_the_orientation(tmp_path):
    """Without img_dimensions, a polygon drawn on the stored pixels falls outside the upright page: say why."""
    with pytest.raises(UserError, match=r"outside the 96x64 image .*EXIF orientation 6 turns the stored pixels"):
        DetectionFolder((str(_rotated_page(tmp_path, None, [[4, 70, 20, 90]])),))
