"""Lines of text on a page: the words of one baseline in one column, in the text layer's order (make-dataset's line
sets, docs/make-dataset.md)."""

from __future__ import annotations

from collections.abc import Sequence

from scale_ocr.boxes.order import LINE_GAP  # page OCR's lines are cut by the same rule
from scale_ocr.data.pdf_text import PdfWord


def _reading_frame(box: Sequence[float], turn: int) -> tuple[float, float, float, float]:
    """A box as ``(u0, v0, u1, v1)``: u along its text's reading direction, v across it towards the next line, so a
    turned line reads as an upright one does."""
    x0, y0, x1, y1 = box
    return {0: (x0, y0, x1, y1), 1: (-y1, x0, -y0, x1), 2: (-x1, -y1, -x0, -y0), 3: (y0, -x1, y1, -x0)}[turn]


def text_lines(words: Sequence[tuple[int, PdfWord, tuple[float, ...]]], breaks: set[int] = frozenset()
               ) -> list[list[int]]:
    """The words (``(index in the text layer, word, box)`` in its order, every one kept for recognition) grouped
    into lines; each line's positions in ``words``. A line goes on while the next word has its turn, shares half
    its height or more across the line (ascenders and descenders differ, the next line shares none), is set at a
    size within 1.5x and starts after it, less than :data:`LINE_GAP` line heights on (more is another column, a
    table cell or a margin note). A word the page draws but recognition leaves out (``breaks``: out of the
    vocabulary, a rule...) ends the line, so no line crop shows what its label does not say."""
    lines: list[list[int]] = []
    for i, (k, word, box) in enumerate(words):
        if lines:
            j, last, last_box = words[lines[-1][-1]]
            if last.turn == word.turn and not breaks.intersection(range(j + 1, k)):
                a, b = _reading_frame(last_box, last.turn), _reading_frame(box, word.turn)
                height = max(last.line_height, word.line_height, 1e-6)
                shared = min(a[3], b[3]) - max(a[1], b[1])
                if (shared >= 0.5 * min(a[3] - a[1], b[3] - b[1]) and -0.25 * height <= b[0] - a[2] <= LINE_GAP * height
                        and max(last.line_height, word.line_height) <= 1.5 * min(last.line_height, word.line_height)):
                    lines[-1].append(i)
                    continue
        lines.append([i])
    return lines
