"""Reading order of detected words: columns left to right, lines top to bottom, words left to right.

Columns are vertical strips of empty space no box crosses, XY-cut style. A title crosses the gutter, so the page
is first cut into horizontal bands, merged while together they still have a gutter: a title above two columns is
read first, then the left column, then the right one. Limits: a figure spanning the gutter merges the columns
(read line by line across), wide-gapped tables are read column by column, and words are assumed horizontal.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from scale_ocr.boxes.metrics import as_polygons


def _gap_groups(lo: np.ndarray, hi: np.ndarray, min_gap: float) -> list[np.ndarray]:
    """Index arrays of intervals [lo, hi], in increasing order, split at gaps no interval crosses wider than
    ``min_gap``."""
    order = np.argsort(lo, kind="stable")
    reach = np.maximum.accumulate(hi[order])  # right end of everything seen so far
    cuts = np.nonzero(lo[order][1:] - reach[:-1] > min_gap)[0] + 1
    return np.split(order, cuts)


# Two neighbouring words of a line belong to one line of text while the gap between them is under this many word
# heights (make-dataset's line sets split lines by the same rule, scale_ocr.data.text_lines): word spaces, even
# justified, are well under one; a table's next cell or a margin note are further.
LINE_GAP = 1.5


def _lines(idx: np.ndarray, y0: np.ndarray, y1: np.ndarray, x0: np.ndarray) -> list[list[int]]:
    """Base case: groups words into lines, lines top to bottom, words left to right.

    A word joins the current line when their vertical extents overlap by more than half the smaller height;
    the line's extent is the mean of its words' extents, so one tall word does not swallow the next line.
    """
    idx = idx[np.argsort((y0[idx] + y1[idx]) / 2, kind="stable")]
    lines: list[list[int]] = []
    top = bottom = 0.0
    for i in idx:
        if lines:
            overlap = min(bottom, y1[i]) - max(top, y0[i])
            if overlap > 0.5 * min(bottom - top, y1[i] - y0[i]):
                lines[-1].append(int(i))
                top, bottom = float(np.mean(y0[lines[-1]])), float(np.mean(y1[lines[-1]]))
                continue
        lines.append([int(i)])
        top, bottom = float(y0[i]), float(y1[i])
    return [sorted(line, key=lambda j: x0[j]) for line in lines]


def _order(idx: np.ndarray, box: tuple[np.ndarray, ...], gap: float) -> list[list[int]]:
    """The lines of the words ``idx``, in reading order."""
    x0, y0, x1, y1 = box
    columns = _gap_groups(x0[idx], x1[idx], gap)
    if len(columns) > 1:
        return [line for col in columns for line in _order(idx[col], box, gap)]
    # Bands: cut wherever no box spans the vertical position (gap 0: any empty row of pixels).
    bands = [idx[b] for b in _gap_groups(y0[idx], y1[idx], 0.0)]
    if len(bands) == 1:
        return _lines(idx, y0, y1, x0)
    blocks = [bands[0]]
    for band in bands[1:]:
        merged = np.concatenate([blocks[-1], band])
        # Keep the band with the block above while they share a gutter (both halves of a two-column page).
        if len(_gap_groups(x0[merged], x1[merged], gap)) > 1:
            blocks[-1] = merged
        else:
            blocks.append(band)
    return [line for block in blocks for line in _order(block, box, gap)]


def reading_lines(polygons: np.ndarray | Sequence, column_gap: float | None = 1.5,
                  line_gap: float | None = LINE_GAP) -> list[list[int]]:
    """The words' lines in reading order, each its words' indices left to right; together a permutation of
    ``range(N)``.

    ``polygons`` as :func:`~scale_ocr.boxes.metrics.as_polygons` takes them, both axes on one scale (the gaps are
    measured in word heights); ``column_gap``: an empty strip wider than this many median word heights separates
    columns, None reads every line across the page; ``line_gap``: a line is cut where two neighbouring words are
    further apart than this many of its median word heights (None: never).
    """
    polys = as_polygons(polygons)
    if len(polys) == 0:
        return []
    mins, maxs = polys.min(axis=1), polys.max(axis=1)
    box = (mins[:, 0], mins[:, 1], maxs[:, 0], maxs[:, 1])
    idx = np.arange(len(polys))
    gap = 0.0 if column_gap is None else column_gap * float(np.median(maxs[:, 1] - mins[:, 1]))
    # gap 0: no column splitting asked for, or flat (zero-height) boxes that any space would split
    lines = _lines(idx, box[1], box[3], box[0]) if gap <= 0 else _order(idx, box, gap)
    return lines if line_gap is None else [part for line in lines for part in _cut(line, box, line_gap)]


def _cut(line: list[int], box: tuple[np.ndarray, ...], line_gap: float) -> list[list[int]]:
    """A line's words in runs whose neighbours are at most ``line_gap`` median word heights apart."""
    x0, y0, x1, y1 = box
    height = float(np.median(y1[line] - y0[line]))
    parts = [[line[0]]]
    for i in line[1:]:
        if x0[i] - x1[parts[-1][-1]] > line_gap * height:
            parts.append([i])
        else:
            parts[-1].append(i)
    return parts


def reading_order(polygons: np.ndarray | Sequence, column_gap: float | None = 1.5) -> list[int]:
    """Indices of words in reading order, a permutation of ``range(N)``: :func:`reading_lines`' words, line after
    line."""
    return [i for line in reading_lines(polygons, column_gap, line_gap=None) for i in line]
