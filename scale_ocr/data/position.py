"""An epoch's data position in samples, exact whatever the world size, worker count or batch size (docs/data.md).

What is left of an epoch is a list of :data:`Range` ``(shard, lo, hi)`` of seeded permutations. A :class:`Segment`
cuts it into contiguous pieces per rank, then per loader worker in whole batches; the rank's batch ``j`` comes from
worker ``j % W`` (torch's DataLoader order), so after ``m`` batches what was consumed is each piece's known prefix
and :meth:`Segment.remaining` needs no communication.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Range = tuple[int, int, int]  # (shard, lo, hi): positions lo..hi-1 of the shard's permutation of its samples


def shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The epoch's order of shards (a permutation of ``range(num_shards)``)."""
    return [int(i) for i in np.random.default_rng([seed, epoch, 0]).permutation(num_shards)]


def sample_order(count: int, seed: int, epoch: int, shard: int) -> np.ndarray:
    """The epoch's order of one shard's ``count`` samples (member indices in the tar's order)."""
    return np.random.default_rng([seed, epoch, 1, shard]).permutation(count)


def epoch_ranges(counts: Sequence[int], seed: int, epoch: int) -> list[Range]:
    """A whole epoch as pending ranges: every shard in the epoch's order, all of its positions."""
    return [(s, 0, int(counts[s])) for s in shard_order(len(counts), seed, epoch) if counts[s]]


def total(ranges: Sequence[Range]) -> int:
    return sum(hi - lo for _, lo, hi in ranges)


def cut(ranges: Sequence[Range], start: int, stop: int) -> list[Range]:
    """Positions ``start..stop-1`` of the flattened ranges, as ranges."""
    out, at = [], 0
    for shard, lo, hi in ranges:
        n = hi - lo
        a, b = max(start - at, 0), min(stop - at, n)
        if a < b:
            out.append((shard, lo + a, lo + b))
        at += n
        if at >= stop:
            break
    return out


def merge(ranges: Sequence[Range]) -> list[Range]:
    """Adjacent ranges of the same shard joined (a checkpoint stays short)."""
    out: list[Range] = []
    for r in ranges:
        if out and out[-1][0] == r[0] and out[-1][2] == r[1]:
            out[-1] = (r[0], out[-1][1], r[2])
        elif r[2] > r[1]:
            out.append(tuple(r))
    return out


def worker_batches(batches: int, workers: int) -> list[int]:
    """Batches of each worker's piece: equal, the first ones one more (torch's round-robin order)."""
    return [batches // workers + (1 if w < batches % workers else 0) for w in range(workers)]


class Segment:
    """One segment's split of the ``pending`` ranges over ranks and workers (0 workers count as 1: the rank reads
    itself); the tail shorter than one global batch stays pending, out of this segment."""

    def __init__(self, pending: Sequence[Range], world: int, workers: int, batch: int) -> None:
        self.pending, self.world, self.workers, self.batch = list(pending), world, max(1, workers), batch
        n = total(self.pending)
        self.batches = n // (world * batch)  # per rank
        self.per_rank = self.batches * batch
        self.tail = n - self.per_rank * world  # fewer than one global batch: left out of this segment

    def rank_piece(self, rank: int) -> list[Range]:
        return cut(self.pending, rank * self.per_rank, (rank + 1) * self.per_rank)

    def worker_pieces(self, rank: int) -> list[list[Range]]:
        """Each worker's contiguous piece of the rank's piece."""
        piece, out, at = self.rank_piece(rank), [], 0
        for n in worker_batches(self.batches, self.workers):
            out.append(cut(piece, at, at + n * self.batch))
            at += n * self.batch
        return out

    def batch_order(self, rank: int) -> list[tuple[int, int]]:
        """The rank's batches in the order the loader delivers them: ``(worker, batch index in its piece)``."""
        return [(j % self.workers, j // self.workers) for j in range(self.batches)]

    def remaining(self, m: int) -> list[Range]:
        """What is left of the epoch after every rank took its first ``m`` batches of this segment.

        Each worker piece's unconsumed rest, rank by rank and worker by worker, then the tail this segment
        left out: a resume re-splits it at its own world size, so no sample is repeated or skipped.
        """
        m = min(m, self.batches)
        taken = worker_batches(m, self.workers)  # delivered by each worker: batch j comes from worker j % W
        rest: list[Range] = []
        for rank in range(self.world):
            for w, piece in enumerate(self.worker_pieces(rank)):
                rest += cut(piece, taken[w] * self.batch, total(piece))
        rest += cut(self.pending, self.per_rank * self.world, total(self.pending))
        return merge(rest)
