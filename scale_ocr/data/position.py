"""An epoch's data position in samples, exact whatever the world size, worker count or batch size.

A shard set's epoch order is a seeded permutation of its shards, and within each shard a seeded
permutation of its samples (both from ``(seed, epoch)``). What is left of an epoch is a list of
:data:`Range` ``(shard, lo, hi)``: positions ``lo..hi-1`` of that shard's permutation, in order.

A *segment* (a fresh epoch, or the rest of one after a resume) splits the pending list, in order, into
``world`` equal contiguous pieces of whole micro-batches; the tail shorter than one global batch stays
pending (a resume may train it) and is left out of this segment. Each rank's piece is cut into its loader
workers' contiguous pieces in whole batches, the first ones one batch more, and the rank's batch ``j``
is the ``j // W``-th batch of worker ``j % W``'s piece: the order torch's DataLoader takes batches from
its workers. After ``m`` batches on every rank, the consumed samples are each piece's known prefix, so
the rest of the epoch (:func:`remaining`) is a function of (pending, world, workers, batch, m) alone,
computed on every rank without communication and stored world-size free in the checkpoint.
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


def consumed_batches(m: int, workers: int) -> list[int]:
    """Batches each worker has delivered after the rank's first ``m`` (batch j comes from worker j % W)."""
    return worker_batches(m, workers)


class Segment:
    """One segment's split of the pending ranges over ranks and workers.

    Args:
        pending: what is left of the epoch, in order.
        world: ranks.
        workers: loader workers per rank (0 counts as 1: the rank reads itself).
        batch: micro-batch size.
    """

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
        taken = consumed_batches(m, self.workers)
        rest: list[Range] = []
        for rank in range(self.world):
            for w, piece in enumerate(self.worker_pieces(rank)):
                rest += cut(piece, taken[w] * self.batch, total(piece))
        rest += cut(self.pending, self.per_rank * self.world, total(self.pending))
        return merge(rest)
