"""Micro-batches filled to a pixel budget, balanced across ranks (``--batch-pixels``, issue 57): crops read at their
own width cost their padded pixels, not one sample each.

An epoch is a seeded permutation of the samples. It is planned a pool at a time (:data:`POOL` samples in the
permutation's order): a pool's samples are sorted by width and packed, narrowest first, into micro-batches whose
padded pixels (samples x widest x height) stay within the budget; ``world`` neighbouring micro-batches, as alike in
width as the sort makes them, form a round, one per rank, and the pool's rounds are shuffled. The micro-batches a
pool cannot deal out whole to every rank go to the front of the next pool; what the last pool cannot deal is the
epoch's tail, left out and counted.

Every rank plans the same epoch and takes its own micro-batch of each round, so every rank takes as many
micro-batches and near-equal pixels. What an epoch consumed is a set of positions of its permutation, kept as a bitmap
(:meth:`PixelPlan.consumed`): it holds no world size, so a run resumed at another one plans the rest of the epoch
anew from the samples not yet consumed, and trains each of them once.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Sequence

import numpy as np

from scale_ocr.errors import UserError

POOL = 4096  # samples planned together: enough widths for rounds of like micro-batches, few enough to shuffle well
Round = list[list[int]]  # one micro-batch (sample indices) per rank


def bucketed(width: int, widest: int, bucket: int) -> int:
    """The columns a micro-batch whose widest crop is ``width`` pads to (``--width-bucket``): up to a multiple of
    ``bucket``, at most ``widest`` (the model's widest input). A bucket of 32 on 10,000 lines of 32 to 1,028 pixels
    gives an epoch's 340 micro-batches 44 shapes, not 188, and 96.5% of their pixels are the crops' own (98.7% at a
    bucket of 4); on a CPU it no longer changes the wait on the slowest rank or the speed (docs/models.md)."""
    return min(widest, -(-width // bucket) * bucket)


class PixelPlan:
    """The micro-batches of an epoch of samples ``widths`` pixels wide (at ``height``), within ``budget`` padded
    pixels each, dealt to ``world`` ranks.

    Args:
        widths: each sample's width as its micro-batch pads it (:func:`bucketed`).
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

    def consumed(self, positions: Iterable[int]) -> str:
        """Positions as a bitmap of the permutation, base64 (a checkpoint holds N/8 bytes, whatever the rounds'
        shuffle scattered)."""
        bits = np.zeros(len(self.widths), dtype=bool)
        bits[list(positions)] = True
        return base64.b64encode(np.packbits(bits).tobytes()).decode("ascii")

    def expand(self, bitmap: str) -> list[int]:
        """The positions :meth:`consumed`'s bitmap holds ("": none); a bitmap of another length is refused
        (ValueError)."""
        if not bitmap:
            return []
        raw = np.frombuffer(base64.b64decode(bitmap.encode("ascii"), validate=True), dtype=np.uint8)
        if len(raw) != -(-len(self.widths) // 8):
            raise ValueError(f"a bitmap of {len(raw) * 8} positions for {len(self.widths)} samples")
        return [int(p) for p in np.flatnonzero(np.unpackbits(raw)[:len(self.widths)])]

    def pixels(self, batch: Sequence[int]) -> int:
        """A micro-batch's padded pixels."""
        return len(batch) * int(self.widths[list(batch)].max()) * self.height if len(batch) else 0


class PixelPosition:
    """The batch sampler of a run with ``--batch-pixels`` and its :class:`~scale_ocr.data.loader.Position`: rank
    ``rank``'s micro-batch of each round of :class:`PixelPlan`, from where the epoch stands.

    The loader hands the batches out in the sampler's order (its workers too), so after ``m`` micro-batches every
    rank took the first ``m`` rounds: what the epoch consumed is known on every rank without a collective, and so is
    every step's global sample count (:meth:`samples`)."""

    def __init__(self, plan: PixelPlan, rank: int) -> None:
        self.plan, self.rank = plan, rank
        self.epoch, self.rounds, self.before = 0, [], []  # the set epoch's rounds, and positions consumed before them
        self.restored: tuple[int, list[int]] | None = None
        self.planned: tuple[int, list[int]] | None = None  # the epoch and consumed positions self.rounds are for
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.before = self.restored[1] if self.restored is not None and self.restored[0] == epoch else []
        self.restored, self.epoch = None, epoch
        if self.planned != (epoch, self.before):  # the loader's first epoch was planned when it was built
            self.rounds, self.tail = self.plan.rounds(epoch, self.before)
            self.planned = (epoch, self.before)

    def __iter__(self):
        return iter([rnd[self.rank] for rnd in self.rounds])

    def __len__(self) -> int:
        return len(self.rounds)

    def samples(self, first: int, count: int) -> int:
        """Samples every rank together took in micro-batches ``first`` to ``first + count - 1`` since the epoch was
        set."""
        return sum(len(b) for rnd in self.rounds[first:first + count] for b in rnd)

    def mean_samples(self) -> float:
        """A rank's mean samples per micro-batch over the set epoch's rounds."""
        return self.samples(0, len(self.rounds)) / max(1, len(self.rounds) * self.plan.world)

    def state(self, epoch: int, consumed_batches: int) -> dict:
        if epoch != self.epoch:
            return {"kind": "pixels", "epoch": epoch, "samples_in_epoch": 0, "consumed": ""}
        done = self.before + self.plan.positions(epoch, self.rounds[:consumed_batches])
        return {"kind": "pixels", "epoch": epoch, "samples_in_epoch": len(done), "consumed": self.plan.consumed(done)}

    def restore(self, epoch: int, samples_in_epoch: int, state: dict | None) -> None:
        if state is not None and state.get("kind") == "pixels":
            try:
                self.restored = (epoch, self.plan.expand(state.get("consumed") or ""))
            except (ValueError, TypeError) as bad:
                raise UserError(f"the checkpoint's --batch-pixels position does not fit this training set ({bad}); "
                                "resume with the set it trained on") from None
        elif samples_in_epoch:  # a checkpoint of batches of -b samples: its order is not this one's
            raise UserError(f"the checkpoint stopped {samples_in_epoch} samples into epoch {epoch + 1} with batches "
                            "of -b samples, whose order --batch-pixels does not continue; resume it without "
                            "--batch-pixels, or from a checkpoint at an epoch's end")
        else:
            self.restored = (epoch, [])
