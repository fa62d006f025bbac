"""docTR's detection format: ``DIR/images/*`` and ``DIR/labels.json`` mapping each page to its words' polygons.

The entry's fields and the checks on them: docs/data.md, "Detection folders". ``img_hash`` is checked only when it
is a SHA-256 hex digest (docTR's README shows placeholders). A page with any bad label is rejected whole: dropping
just the bad polygon would leave its word visible but labelled as background.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import shapely
from torch.utils.data import Dataset

from scale_ocr.data.files import (
    IMAGE_FILE_LIMIT,
    PAGE_LIMITS,
    BadSample,
    ScanReport,
    decode_listed,
    orientation_of,
    read_labels,
    reject,
    reload_image,
    resolve_image,
)
from scale_ocr.data.images import quarter_turned
from scale_ocr.disk import read_user_bytes
from scale_ocr.errors import UserError, shown

TOLERANCE = 1.0  # pixels a point may lie outside the image (rounding in labelling tools) before it is refused
MIN_AREA = 1e-2  # square pixels: below this a polygon has no area (collinear or repeated points)
SKIP = "or pass --on-bad-sample skip"
FORM = "[[x, y], [x, y], [x, y], [x, y]] (4 or more points, absolute pixels) or a box [xmin, ymin, xmax, ymax]"


@dataclass
class Page:
    """One usable page: its image file and its words' 4-point polygons (float32 ``(N, 4, 2)``)."""

    path: Path
    polygons: np.ndarray
    words: list[str]
    size: tuple[int, int] = (0, 0)  # (width, height) upright, as decoded at the start-up scan


def _is_number(v: object) -> bool:
    # JSON integers are unbounded in Python; past 2**53 they are no pixel coordinate and float() may overflow.
    return isinstance(v, float) or (isinstance(v, int) and not isinstance(v, bool) and abs(v) < 2**53)


def _points(poly: object, where: str) -> np.ndarray:
    """The ``(K, 2)`` points of one polygon or box as written, or :class:`BadSample` ``bad_polygon``."""
    if isinstance(poly, list) and len(poly) == 4 and all(_is_number(v) for v in poly):
        x0, y0, x1, y1 = (float(v) for v in poly)
        if np.isfinite([x0, y0, x1, y1]).all() and (x0 > x1 or y0 > y1):
            raise BadSample("bad_polygon", f"{where} is a box {poly} with xmin > xmax or ymin > ymax; "
                                           f"write boxes as [xmin, ymin, xmax, ymax] {SKIP}")
        pts = np.array([[x0, y0], [x1, y0], [x1, y1], [x0, y1]])
    elif (isinstance(poly, list) and len(poly) >= 4
          and all(isinstance(p, list) and len(p) == 2 and all(_is_number(v) for v in p) for p in poly)):
        pts = np.array(poly, dtype=np.float64)
    else:
        raise BadSample("bad_polygon", f"{where} is not a polygon ({shown(poly, 60)}); write it as {FORM}, {SKIP}")
    if not np.isfinite(pts).all():
        raise BadSample("bad_polygon", f"{where} has a non-finite coordinate; write finite pixel coordinates {SKIP}")
    return pts


def _shoelace(quad: np.ndarray) -> float:
    """Signed area; positive for clockwise on screen, as y points down."""
    x, y = quad[:, 0], quad[:, 1]
    return 0.5 * float(np.dot(x, np.roll(y, -1)) - np.dot(np.roll(x, -1), y))


def _degenerate(where: str) -> BadSample:
    return BadSample("degenerate_polygon", f"{where} has no area inside the image (its points are repeated, on "
                                           f"one line, or along the image's edge); fix or remove it, {SKIP}")


def _quad(pts: np.ndarray, where: str) -> np.ndarray:
    """The polygon as 4 points clockwise on screen from the top-left: its convex hull when that has 4 corners
    (which also fixes any point order), else the hull's minimum-area rotated rectangle (curved text, a box)."""
    hull = shapely.MultiPoint(pts).convex_hull
    if hull.geom_type != "Polygon" or hull.area < MIN_AREA:
        raise _degenerate(where)
    quad = np.asarray(hull.exterior.coords)[:-1]
    if len(quad) != 4:
        quad = np.asarray(hull.minimum_rotated_rectangle.exterior.coords)[:-1]
    if _shoelace(quad) < 0:
        quad = quad[::-1]
    return np.roll(quad, -int(np.argmin(quad.sum(axis=1))), axis=0)


def _fields(labels: Path | str, name: str, entry: object):
    """``(polygons as written with where each is, words or None, [H, W] or None, hash or None)``."""
    if not isinstance(entry, dict) or "polygons" not in entry:
        raise BadSample("bad_label", f"{labels}: the label of {shown(name)} has no \"polygons\"; each image maps to "
                                     "{\"img_dimensions\": [H, W], \"polygons\": [...]} (an empty list for a page "
                                     f"without text), {SKIP}")
    polys = entry["polygons"]
    groups = polys.items() if isinstance(polys, dict) else [(None, polys)]
    listed = []
    for cls, group in groups:
        of = f"class {shown(cls)} of " if cls is not None else ""
        if not isinstance(group, list):
            raise BadSample("bad_label", f"{labels}: \"polygons\" of {of}{shown(name)} is not a list; give a list "
                                         f"of polygons, each {FORM}, {SKIP}")
        listed += [(poly, f"{labels}: polygon {i} of {of}{shown(name)}") for i, poly in enumerate(group)]
    dims = entry.get("img_dimensions")
    if dims is not None and not (isinstance(dims, list) and len(dims) == 2
                                 and all(_is_number(v) and float(v).is_integer() and v > 0 for v in dims)):
        raise BadSample("bad_dimensions", f"{labels}: \"img_dimensions\" of {shown(name)} is {shown(dims)}, not "
                                          f"[height, width] in pixels; fix or remove it, {SKIP}")
    digest = entry.get("img_hash")
    if digest is not None and not isinstance(digest, str):
        raise BadSample("bad_label", f"{labels}: \"img_hash\" of {shown(name)} is not a string; write the image "
                                     f"file's SHA-256 hex digest or remove it, {SKIP}")
    words = entry.get("words")
    if words is not None and not (isinstance(words, list) and all(isinstance(w, str) for w in words)
                                  and len(words) == len(listed)):
        count = f"{len(words)} words" if isinstance(words, list) else "a \"words\" that is not a list"
        raise BadSample("bad_words", f"{labels}: {shown(name)} has {count} for {len(listed)} polygons; \"words\" must "
                                     f"list one string per polygon, in the same order, {SKIP}")
    return listed, words, dims, digest


def _turned(img_path: Path) -> str:
    """A note for messages when the image's EXIF orientation turns its stored pixels a quarter turn, else ""."""
    orientation = orientation_of(img_path)
    return (f"; its EXIF orientation {orientation} turns the stored pixels a quarter turn and labels are in the "
            "upright image's pixels, as viewers show it") if quarter_turned(orientation) else ""


def _dimensions_problem(labels: Path, name: str, dims: list, img_path: Path, w: int, h: int) -> BadSample:
    """``bad_dimensions`` for ``img_dimensions`` that are not the upright image's ``[h, w]``.

    When they are the stored pixels' size and EXIF orientation turns the image, swapping them would train the
    polygons on sideways pixels, so the message says which pixels the labels must follow instead.
    """
    orientation = orientation_of(img_path)
    if quarter_turned(orientation) and [int(v) for v in dims] == [w, h]:
        return BadSample("bad_dimensions", f"{labels}: \"img_dimensions\" of {shown(name)} is {dims}, the size of the "
                                           f"stored pixels, but its EXIF orientation {orientation} turns them a "
                                           f"quarter turn: upright, as viewers show it and as it is trained, the "
                                           f"image is {w} wide and {h} high; label the upright image (polygons and "
                                           "img_dimensions), or if the labels follow the stored pixels, remove the "
                                           f"file's orientation tag (exiftool -Orientation= FILE), {SKIP}")
    return BadSample("bad_dimensions", f"{labels}: \"img_dimensions\" of {shown(name)} is {dims} but the image is "
                                       f"{w} wide and {h} high; write [{h}, {w}] (height first), {SKIP}")


def check_page(path: Path, name: str, entry: object) -> Page:
    """Check one labels.json entry against its decoded image; :class:`BadSample` says why it cannot be used."""
    img_path, problem = resolve_image(path, name)
    if problem:
        raise BadSample(*problem)
    labels = path / "labels.json"
    listed, words, dims, digest = _fields(labels, name, entry)
    points = [(_points(poly, where), where) for poly, where in listed]
    img, problem = decode_listed(path, name, img_path, PAGE_LIMITS)
    if problem:
        raise BadSample(*problem)
    w, h = img.size  # upright: EXIF orientation applied
    if dims is not None and [int(v) for v in dims] != [h, w]:
        raise _dimensions_problem(labels, name, dims, img_path, w, h)
    if digest is not None and re.fullmatch(r"[0-9a-fA-F]{64}", digest):
        page = read_user_bytes(img_path, what="the page", limit=IMAGE_FILE_LIMIT, follow=True)
        if hashlib.sha256(page).hexdigest() != digest.lower():
            raise BadSample("hash_mismatch", f"{labels}: \"img_hash\" of {shown(name)} is not the SHA-256 of "
                                             f"{shown(path / 'images' / name)}, so the labels describe "
                                             f"another image; relabel it or fix the hash, {SKIP}")
    polygons = page_quads(points, w, h, lambda: _turned(img_path))
    return Page(img_path, polygons, list(words) if words is not None else [], (w, h))


def page_quads(points: list[tuple[np.ndarray, str]], w: int, h: int, note=lambda: "") -> np.ndarray:
    """Each polygon's points (with where it is, for messages) as a quad inside the ``w`` x ``h`` page, float32
    ``(N, 4, 2)``; :class:`BadSample` for a point outside the page or a polygon without area. ``note()``: what a
    message about a point outside adds (an EXIF turn)."""
    quads = []
    for pts, where in points:
        off = (pts < -TOLERANCE) | (pts > np.array([w, h]) + TOLERANCE)
        if off.any():
            x, y = pts[int(np.argmax(off.any(axis=1)))]
            raise BadSample("outside_image", f"{where} has the point ({x:g}, {y:g}) outside the {w}x{h} image "
                                             f"(x in 0..{w}, y in 0..{h}, {TOLERANCE:g} px tolerance{note()}"
                                             f"); fix the coordinates (absolute pixels, x first) {SKIP}")
        quad = np.clip(_quad(pts, where), 0, [w, h])
        if _shoelace(quad) < MIN_AREA:  # it lay along the edge, in the tolerance band: clamped, it is a line
            raise _degenerate(where)
        quads.append(quad)
    return np.asarray(quads, dtype=np.float32).reshape(-1, 4, 2)


def stored_page(where: str, key: str, entry: object) -> tuple[np.ndarray, list[str], tuple[int, int]]:
    """A page label stored without its folder (a shard set's): the checks of :func:`check_page` that need no
    image, with ``img_dimensions`` required, as ``(quads, words, (width, height))``; :class:`BadSample` says why
    it cannot be used. ``where`` names the file that holds it, ``key`` the page."""
    listed, words, dims, _ = _fields(where, key, entry)
    if dims is None or max(int(v) for v in dims) > PAGE_LIMITS.max_side:
        most = PAGE_LIMITS.max_side
        raise BadSample("bad_dimensions", f"{where}: \"img_dimensions\" of {shown(key)} is {shown(dims)}, not "
                                          f"[height, width] of a page of at most {most} px a side; write its size")
    h, w = (int(v) for v in dims)
    quads = page_quads([(_points(poly, at), at) for poly, at in listed], w, h)
    return quads, list(words) if words is not None else [], (w, h)


def scan_detection_folder(path: Path, on_bad_sample: str, report: ScanReport) -> list[Page]:
    """Check every page of a folder at start-up (decoding each image) and return the usable ones; a bad page raises
    a :class:`UserError` (``on_bad_sample="error"``) or is counted in ``report`` (``"skip"``)."""
    pages = []
    for name, entry in read_labels(path, "detection", "page labels").items():
        try:
            pages.append(check_page(path, name, entry))
            report.kept += 1
        except BadSample as exc:
            reject(exc.problem, on_bad_sample, report)
    return pages


class DetectionFolder(Dataset):
    """Pages from one or more docTR detection folders; ``transform(img, polygons, words)`` returns the same triple
    (:func:`~scale_ocr.data.det_transforms.build_det_transform`), None the PIL page."""

    def __init__(self, paths: tuple[str, ...], on_bad_sample: str = "error", transform=None) -> None:
        self.report = ScanReport()
        self.pages: list[Page] = []
        for p in paths:
            self.pages += scan_detection_folder(Path(p), on_bad_sample, self.report)
        if not self.pages:
            raise UserError(f"no usable pages in {', '.join(paths)}; check labels.json and images/")
        self.transform = transform

    def __len__(self) -> int:
        return len(self.pages)

    def target(self, index: int) -> tuple[np.ndarray, list[str]]:
        """The polygons (original image pixels) and words of page ``index``, without decoding it."""
        page = self.pages[index]
        return page.polygons.copy(), list(page.words)

    def __getitem__(self, index: int):
        """``(image, polygons float32 (N, 4, 2) in the transformed image's pixels, words)``."""
        img = reload_image(self.pages[index].path, PAGE_LIMITS)
        polygons, words = self.target(index)
        return self.transform(img, polygons, words) if self.transform else (img, polygons, words)
