"""Text recognition metrics: exact match, case-insensitive match, character error rate."""

from __future__ import annotations


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


class TextMetric:
    """Accumulates sums that can be all-reduced across ranks, then turned into rates.

    ``sums()`` order: exact, case-insensitive exact, edit distance, target characters, words.
    """

    def __init__(self) -> None:
        self.exact = self.ci_exact = self.edits = self.chars = self.count = 0

    def update(self, preds: list[str], targets: list[str]) -> None:
        for p, t in zip(preds, targets, strict=True):
            self.exact += p == t
            self.ci_exact += p.lower() == t.lower()
            self.edits += edit_distance(p, t)
            self.chars += len(t)
            self.count += 1

    def sums(self) -> list[float]:
        return [self.exact, self.ci_exact, self.edits, self.chars, self.count]

    @staticmethod
    def rates(sums: list[float]) -> dict[str, float]:
        exact, ci_exact, edits, chars, count = sums
        n = max(count, 1)
        return {"exact_match": exact / n, "ci_match": ci_exact / n, "cer": edits / max(chars, 1)}
