"""Property-based fuzzing of labels.json, through the start-up check a training run makes (docs/faults.md, "Fuzzing").

Recognition (``RecognitionFolder``) and detection (``DetectionFolder``) folders are built from generated labels:
keys that exist, traverse (``..``, absolute), hold NUL, control characters, lone surrogates or 300+ characters;
labels of every JSON type, unicode, outside the vocabulary or longer than CTC can align; polygons that are
degenerate, outside the image, NaN, infinite, huge, boxes, the wrong shape or type; ``img_dimensions``,
``img_hash`` and ``words`` of every type; and labels.json files that are not JSON, not UTF-8, nested 100,000 deep
or hold a 5,000-digit number. Each ends in success, where everything kept is usable, or in one UserError line
(:mod:`test_fuzz_oracle`).
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st
from PIL import Image
from test_fuzz_oracle import outcome

from scale_ocr.data.detection import MIN_AREA, DetectionFolder
from scale_ocr.data.recognition import RecognitionFolder
from scale_ocr.models.recognition.ctc import ctc_frames, ctc_frames_needed
from scale_ocr.vocab import Vocab, resolve_vocab

VOCAB = Vocab(resolve_vocab("french"))
INPUT_SIZE = (32, 128)
PAGE = (64, 48)  # width, height of every generated page
POLICIES = st.sampled_from(["error", "skip"])


def _png(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (255, 255, 255)).save(buf, format="PNG")
    return buf.getvalue()


CROP_PNG, PAGE_PNG = _png((32, 8)), _png(PAGE)
GOOD = ("0.png", "1.png", "2.png", "é 3.png")  # written in every generated folder
BAD_IMAGES = {"empty.png": b"", "text.png": b"hello", "cut.png": PAGE_PNG[:60]}
# Keys that are not what they look like: traversal, absolute, NUL, lone surrogates (one encodable as a byte, one
# not), a directory, over the file system's 255 bytes a name, control characters, a bidi override.
ODD_KEYS = ("", "\x00.png", "../x.png", "/etc/passwd", "a/../../x.png", "images/../0.png", ".", "..", "sub/0.png",
            "\ud800.png", "\udcff.png", "a" * 300 + ".png", "a/" * 200 + "0.png", "0.png\n", "\x1b[2J.png",
            "\u202egnp.png", "0.png/", "./0.png", "//0.png")
KEYS = st.one_of(st.sampled_from(GOOD), st.sampled_from(tuple(BAD_IMAGES)), st.sampled_from(ODD_KEYS),
                 st.text(max_size=12))
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**53, max_value=10**400),
                         st.floats(), st.text(max_size=8))
JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=5), inner, max_size=3), max_leaves=8)
WORDS = st.one_of(st.text(alphabet=VOCAB.chars, max_size=40), st.text(max_size=10),
                  st.integers(0, 3000).map(lambda n: "ab" * n), JSON)


def _folder(root: Path, labels: dict, png: bytes) -> str:
    images = root / "images"
    images.mkdir(parents=True)
    for name in GOOD:
        (images / name).write_bytes(png)
    for name, data in BAD_IMAGES.items():
        (images / name).write_bytes(data)
    (images / "sub").mkdir()
    (root / "labels.json").write_text(json.dumps(labels), encoding="utf-8")
    return str(root)


def _usable_word(word: object) -> bool:
    return (isinstance(word, str) and word != "" and not VOCAB.unknown_chars(word)
            and ctc_frames_needed(word) <= ctc_frames(INPUT_SIZE))


def _good(entries: st.SearchStrategy) -> st.SearchStrategy:
    """Entries a folder may hold, under the names of images it has."""
    return st.dictionaries(st.sampled_from(GOOD), entries, max_size=len(GOOD))


FUZZED = st.dictionaries(KEYS, WORDS, max_size=3)


@given(good=_good(st.text(alphabet=VOCAB.chars, min_size=1, max_size=16)), fuzzed=FUZZED, policy=POLICIES)
@example(good={}, fuzzed={"a" * 300 + ".png": "abc"}, policy="error")  # a name too long for a file (ENAMETOOLONG)
@example(good={}, fuzzed={"\ud800.png": "abc"}, policy="error")  # a name no file system can encode
def test_recognition_labels(good, fuzzed, policy):
    """Folders as users have them: mostly good entries, a few generated ones (which may replace a good one)."""
    labels = {**good, **fuzzed}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "words"
        ds, message = outcome(RecognitionFolder, (_folder(root, labels, CROP_PNG),), VOCAB, policy,
                              input_size=INPUT_SIZE)
        if message is not None:
            # Only a bad sample stops an "error" run; a "skip" run stops only when nothing is left.
            assert fuzzed or not good, message
            assert policy == "error" or message.startswith("no usable samples"), message
            return
        images = (root / "images").resolve()
        for path, word in ds.samples:
            assert path.is_relative_to(images) and path.is_file() and _usable_word(word), (path, word)
        assert ds.report.kept == len(ds.samples) == (len(labels) if policy == "error"
                                                      else len(labels) - ds.report.num_skipped)


# labels.json as bytes: not JSON, not UTF-8, not an object, nested past the recursion limit, huge numbers.
RAW_LABELS = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=64).map(str.encode),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.integers(4301, 6000).map(lambda n: b'{"0.png": ' + b"1" * n + b"}"),
    st.integers(1000, 20_000).map(lambda n: b"[" * n + b"]" * n),
    st.sampled_from([b"\xef\xbb\xbf{}", '{"0.png": "ab"}'.encode("utf-16"), b'{"0.png": NaN}', b"",
                     b'{"0.png": "ab", "0.png": "cd"}']),
)


@given(raw=RAW_LABELS, detection=st.booleans())
@example(raw=b"[" * 5000, detection=False)  # json.loads: RecursionError
@example(raw=b'{"0.png": ' + b"1" * 5000 + b"}", detection=True)  # json.loads: ValueError (int digit limit)
def test_labels_file_bytes(raw, detection):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(_folder(Path(tmp) / "d", {}, PAGE_PNG if detection else CROP_PNG))
        (root / "labels.json").write_bytes(raw)
        if detection:
            ds, _ = outcome(DetectionFolder, (str(root),), "skip")
            assert ds is None or all(len(p.polygons) == 0 or p.polygons.dtype == np.float32 for p in ds.pages)
        else:
            ds, _ = outcome(RecognitionFolder, (str(root),), VOCAB, "skip", input_size=INPUT_SIZE)
            assert ds is None or all(_usable_word(w) for _, w in ds.samples)


# --- detection ---------------------------------------------------------------------------------------------------

W, H = PAGE
COORD = st.one_of(st.integers(-5, W + 5), st.floats(-5, W + 5), st.floats(), st.integers(2**53 - 2, 10**30),
                  st.sampled_from([True, None, "3", 1e308, -1e308, 1.0000001 * W]))


@st.composite
def _rect(draw) -> list:
    """A rectangle inside the page (the kind a labelling tool writes), its corners in any order."""
    x0, y0 = draw(st.integers(0, W - 2)), draw(st.integers(0, H - 2))
    x1, y1 = draw(st.integers(x0 + 1, W)), draw(st.integers(y0 + 1, H))
    return draw(st.permutations([[x0, y0], [x1, y0], [x1, y1], [x0, y1]]))


POLYGON = st.one_of(
    _rect(),
    _rect().map(lambda r: [min(p[0] for p in r), min(p[1] for p in r), max(p[0] for p in r), max(p[1] for p in r)]),
    st.lists(st.lists(COORD, min_size=2, max_size=2), min_size=3, max_size=8),  # anywhere, of any shape
    st.lists(COORD, min_size=4, max_size=4),  # a box, maybe with xmin > xmax
    st.builds(lambda x, y, n: [[x, y]] * n, COORD, COORD, st.integers(4, 6)),  # one repeated point
    st.builds(lambda x, n: [[x, y] for y in range(n)], st.integers(0, W), st.integers(4, 6)),  # on one line
    st.sampled_from([[[0, 0], [W, 0], [W, 0.5], [0, 0.5]], [[W + 1, 0], [W + 1, H], [W + 0.5, H], [W + 0.5, 0]]]),
    JSON,
)
DIMS = st.one_of(st.just([H, W]), st.just([W, H]), st.lists(COORD, max_size=3), JSON)
ENTRY = st.one_of(
    st.fixed_dictionaries({"polygons": st.one_of(st.lists(POLYGON, max_size=4),
                                                 st.dictionaries(st.text(max_size=6), st.lists(POLYGON, max_size=3),
                                                                 max_size=2), JSON)},
                          optional={"img_dimensions": DIMS, "img_hash": st.one_of(st.text(max_size=8), JSON,
                                                                                   st.just("0" * 64)),
                                    "words": st.one_of(st.lists(st.text(max_size=6), max_size=5), JSON)}),
    JSON,
)


def _fits(page, entry: object) -> bool:
    """Whether a kept page is ``entry`` made usable: one polygon per polygon listed, each 4 finite points inside the
    image, clockwise with area; its words those listed."""
    if not isinstance(entry, dict) or not isinstance(entry.get("polygons"), (list, dict)):
        return False
    listed = entry["polygons"]
    count = sum(len(g) for g in listed.values() if isinstance(g, list)) if isinstance(listed, dict) else len(listed)
    polys = page.polygons
    if polys.dtype != np.float32 or polys.shape != (count, 4, 2) or not np.isfinite(polys).all():
        return False
    quads = polys.astype(np.float64)
    x, y = quads[..., 0], quads[..., 1]
    area = 0.5 * ((x * np.roll(y, -1, axis=1)).sum(axis=1) - (np.roll(x, -1, axis=1) * y).sum(axis=1))
    return (bool((quads >= 0).all() and (x <= W).all() and (y <= H).all() and (area >= MIN_AREA * 0.99).all())
            and page.words == (entry.get("words") or []))


def _resolved(root: Path, name: str) -> Path | None:
    try:
        return (root / "images" / name).resolve()
    except (ValueError, OSError):  # NUL, a lone surrogate: never kept
        return None


GOOD_ENTRY = st.lists(_rect(), max_size=3).flatmap(lambda polys: st.fixed_dictionaries(
    {"polygons": st.just(polys)}, optional={"img_dimensions": st.just([H, W]),
                                            "words": st.lists(st.text(max_size=6), min_size=len(polys),
                                                              max_size=len(polys))}))


@given(good=_good(GOOD_ENTRY), fuzzed=st.dictionaries(KEYS, ENTRY, max_size=3), policy=POLICIES)
@example(good={}, fuzzed={"0.png": {"polygons": [[0, 0, 10, float("nan")]]}}, policy="error")
@example(good={}, fuzzed={"0.png": {"polygons": [[[0, 0], [10**30, 0], [10, 10], [0, 10]]]}}, policy="error")
@example(good={}, fuzzed={"0.png": {"polygons": {"x" * 2000: 5}}}, policy="error")  # messages cut what they echo
@example(good={}, fuzzed={"0.png": {"polygons": [], "img_dimensions": [[0] * 500]}}, policy="error")
def test_detection_labels(good, fuzzed, policy):
    pages = {**good, **fuzzed}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "pages"
        ds, message = outcome(DetectionFolder, (_folder(root, pages, PAGE_PNG),), policy)
        if message is not None:
            assert fuzzed or not good, message
            assert policy == "error" or message.startswith("no usable pages"), message
            return
        assert len(ds.pages) == ds.report.kept == (len(pages) if policy == "error"
                                                   else len(pages) - ds.report.num_skipped)
        images = (root / "images").resolve()
        for page in ds.pages:  # keys such as "0.png" and "./0.png" name the same page
            assert page.path.is_relative_to(images)
            assert any(_fits(page, entry) for name, entry in pages.items() if _resolved(root, name) == page.path), page
