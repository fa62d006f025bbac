"""Micro-batches filled to a pixel budget, balanced across ranks (``--batch-pixels``, issue 57): crops read at their
own width cost their padded pixels, not one sample each.

An epoch is a seeded permutation of the samples. It is planned a pool at a time (:data:`POOL` samples in the
permutation's order): a pool's samples are sorted by width and packed, narrowest first, into micro-batches whose
padded pixels (samples x widest x height) stay within the budget; ``world`` neighbouring micro-batches, as alike in
width as the sort makes them, form a round, one per rank, and the pool's rounds are shuffled. The micro-batches a
pool cannot deal out whole to every rank go to the front of the next pool; what the last pool cannot deal is the
epoch's tail, left out and counted.

Every rank plans the same epoch and takes its own micro-batch of each round, so every rank takes as many
micro-batches and near-equal pixels. What an epoch consumed is a set of positions of its permutation, kept as ranges
(:meth:`PixelPlan.consumed`): it holds no world size, so a run resumed at another one plans the rest of the epoch
anew from the samples not yet consumed, and trains each of them once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

POOL = 4096  # samples planned together: enough widths for rounds of like micro-batches, few enough to shuffle well
Round = list[list[int]]  # one micro-batch (sample indices) per rank


class PixelPlan:
    """The micro-batches of an epoch of samples ``widths`` pixels wide (at ``height``), within ``budget`` padded
    pixels each, dealt to ``world`` ranks.

    Args:
        widths: each sample's width as the model reads it (padding to its frame multiple included).
        height: the model's input height.
        budget: padded pixels a micro-batch may hold; at least the widest sample's.
        world: ranks that take one micro-batch of each round.
        seed: the run's seed (the permutation and the shuffles).
    """

    def __init__(self, widths: Sequence[int], height: int, budget: int, world: int, seed: int,
                 pool: int = POOL) -> None:
        self.widths = np.asarray(widths, dtype=np.int64)
        self.height, self.budget, self.world, self.seed, self.pool = height, budget, world, seed, pool
        widest = int(self.widths.max()) * height if len(self.widths) else 0
        if widest > budget:
            raise ValueError(f"a budget of {budget} pixels cannot hold the widest sample's {widest}")

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of the samples."""
        return np.random.default_rng([self.seed, epoch, 0]).permutation(len(self.widths))

    def pack(self, samples: Sequence[int]) -> list[list[int]]:
        """``samples`` sorted by width (stably) and packed, narrowest first, into micro-batches within the budget."""
        ordered = sorted(samples, key=lambda i: self.widths[i])
        batches: list[list[int]] = []
        for i in ordered:
            # sorted: the sample joining is the widest, so the batch costs its width times its samples
            if batches and (len(batches[-1]) + 1) * int(self.widths[i]) * self.height <= self.budget:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def rounds(self, epoch: int, consumed: Iterable[int] = ()) -> tuple[list[Round], int]:
        """The epoch's rounds over the samples not in ``consumed`` (positions of :meth:`order`), and how many samples
        its tail leaves out."""
        done = set(consumed)
        order = self.order(epoch)
        left = [int(order[p]) for p in range(len(order)) if p not in done]
        out: list[Round] = []
        carry: list[int] = []
        for k, start in enumerate(range(0, len(left), self.pool)):
            batches = self.pack(carry + left[start:start + self.pool])
            whole = len(batches) - len(batches) % self.world
            carry = [i for b in batches[whole:] for i in b]
            pool_rounds = [batches[r:r + self.world] for r in range(0, whole, self.world)]
            for r in np.random.default_rng([self.seed, epoch, 1, k]).permutation(len(pool_rounds)):
                out.append(pool_rounds[int(r)])
        return out, len(carry)

    def positions(self, epoch: int, rounds: Sequence[Round]) -> list[int]:
        """The permutation positions of the samples of ``rounds``."""
        where = np.empty(len(self.widths), dtype=np.int64)
        where[self.order(epoch)] = np.arange(len(self.widths))
        return [int(where[i]) for rnd in rounds for batch in rnd for i in batch]

    @staticmethod
    def consumed(positions: Iterable[int]) -> list[list[int]]:
        """Positions as sorted ``[start, stop)`` ranges (a checkpoint stays short: pools are consumed whole)."""
        ranges: list[list[int]] = []
        for p in sorted(set(positions)):
            if ranges and ranges[-1][1] == p:
                ranges[-1][1] = p + 1
            else:
                ranges.append([p, p + 1])
        return ranges

    @staticmethod
    def expand(ranges: Iterable[Sequence[int]]) -> list[int]:
        """The positions ``[start, stop)`` ranges hold."""
        return [p for a, b in ranges for p in range(int(a), int(b))]

    def pixels(self, batch: Sequence[int]) -> int:
        """A micro-batch's padded pixels."""
        return len(batch) * int(self.widths[list(batch)].max()) * self.height if len(batch) else 0
