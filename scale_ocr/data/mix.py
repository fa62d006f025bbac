"""Training from several sources at stated weights: ``--train-path real/=0.5 synthetic=0.3 shards/=0.2``
(docs/data.md, "Mixed sources").

A source is a docTR folder, a shard set (``scale-ocr make-shards``) or ``synthetic``, the task's own generator
(``--train-samples`` of them, in ``--fonts``). Weights are shares of the samples drawn; they need not sum to 1.

**The order.** An epoch of the mix is as many samples as its sources hold together, N. Source s is drawn D_s times an
epoch, its weight's share of N (largest remainders, so the D_s sum to N), and its draws are spread evenly through the
epoch: draw k of s sits at time (k + 1/2) / D_s, and the epoch is every source's draws in time order (ties: the
source given first). So every stretch of the epoch, a micro-batch included, holds each source at its weight to within
a sample. Draw k of source s (counted over the whole run: epoch e's j-th is k = e D_s + j) takes the source's own
pass k // L_s (L_s its samples) at position k mod L_s: a folder or the generator in a seeded permutation of its
samples, a shard set shard after shard (each shard read whole once a pass by each rank and loader worker: a mix
reads a set world-size times over, where a set alone hands each rank its own shards), so a source that is
drawn more than it holds repeats only after every one of its samples was drawn, and one drawn less goes on next
epoch where it stopped.

**The position.** Everything above is a function of (seed, epoch, position in the epoch), so a checkpoint's
position is the samples consumed of the epoch (:class:`MixPosition`), as a folder's is: a run resumed at any world
size, worker count or batch size goes on at the same draw of every source.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Dataset

from scale_ocr.errors import UserError, say, shown

SYNTHETIC = "synthetic"  # the source that is the task's own generator


@dataclass(frozen=True)
class Source:
    name: str  # the path as given, or SYNTHETIC
    weight: float  # as given


def parse(items: tuple[str, ...] | list[str]) -> list[Source] | None:
    """``--train-path``'s sources and weights; None when it is no mix (no weight given, no ``synthetic``): folders
    read together, or one shard set. A mix that cannot be drawn is refused in one line."""
    if not any("=" in item for item in items) and SYNTHETIC not in items:
        return None
    sources: list[Source] = []
    for item in items:
        name, sep, text = item.rpartition("=")
        if not sep or not name:
            raise UserError(f"--train-path {shown(item)}: in a mix every source takes its weight, SOURCE=WEIGHT, e.g. "
                            f"{shown(item)}=0.5 (a source: a docTR folder, a shard set or synthetic)")
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise UserError(f"--train-path {shown(item)}: the weight {shown(text)} is not a positive number; give "
                            "each source's share of the samples, e.g. data/real=0.5 synthetic=0.5")
        if any(s.name == name for s in sources):
            raise UserError(f"--train-path: the source {shown(name)} is given twice; give each source once with "
                            "its whole weight")
        sources.append(Source(name, weight))
    return sources


def draws_synthetic(cfg) -> bool:
    """Whether a run (``cfg``: its DataConfig) draws synthetic samples: a set it left out, or a mix's source."""
    if cfg.data_cache:
        return False
    return not (cfg.train_path and cfg.val_path) or any(s.name == SYNTHETIC for s in parse(cfg.train_path) or ())


def shares(weights: list[float], total: int) -> list[int]:
    """``total`` split in proportion to ``weights``, the remainders to the largest fractions (first on ties)."""
    exact = [w / sum(weights) * total for w in weights]
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))[:total - sum(counts)]:
        counts[i] += 1
    return counts


class MixedSet(Dataset):
    """The sources' datasets as one: item ``(s, index)`` is source s's sample ``index`` (a shard set's index is its
    ``(shard, member)``). :meth:`position` is its training order."""

    def __init__(self, sources: list[Source], datasets: list[Dataset], digests: list[str | None]) -> None:
        self.sources, self.datasets = sources, datasets
        self.lengths = [len(d) for d in datasets]
        for source, n in zip(sources, self.lengths, strict=True):
            if n == 0:
                raise UserError(f"--train-path: the source {shown(source.name)} holds no sample; drop it from the mix")
        self.draws = shares([s.weight for s in sources], sum(self.lengths))  # per epoch
        self.digest = hashlib.sha256(json.dumps([[s.name, s.weight, d] for s, d in zip(sources, digests, strict=True)])
                                     .encode()).hexdigest()
        self.report = _merged([getattr(d, "report", None) for d in datasets])

    def __len__(self) -> int:
        return sum(self.lengths)

    def __getitem__(self, item: tuple[int, object]):
        source, index = item
        return self.datasets[source][index]

    def describe(self) -> list[dict]:
        """Each source: its name, weight (as a share), samples and draws an epoch (config.json, W&B)."""
        total = sum(s.weight for s in self.sources)
        return [{"source": s.name, "weight": round(s.weight / total, 6), "samples": n, "draws_per_epoch": d,
                 "passes_per_epoch": round(d / n, 3)}
                for s, n, d in zip(self.sources, self.lengths, self.draws, strict=True)]

    def line(self) -> str:
        parts = [f"{shown(d['source'])} {d['weight']:.0%} ({d['samples']:,} samples, {d['draws_per_epoch']:,} draws "
                 f"an epoch: {d['passes_per_epoch']:g} passes)" for d in self.describe()]
        return f"scale-ocr: training mix of {len(self.sources)} sources, {len(self):,} samples an epoch: " + \
            "; ".join(parts)

    def position(self, seed: int, world: int, rank: int, workers: int, batch: int, main: bool) -> MixPosition:
        return MixPosition(self, seed, world, rank, batch, main)


def _merged(reports: list) -> object:
    from scale_ocr.data.files import ScanReport

    merged = ScanReport()
    for r in reports:
        if r is not None:
            merged.kept += r.kept
            for k, v in r.skipped.items():
                merged.skipped[k] = merged.skipped.get(k, 0) + v
    return merged


class MixPosition:
    """The training position over a :class:`MixedSet` (:class:`~scale_ocr.data.loader.Position`) and this rank's
    batch sampler: micro-batch m of rank r is the epoch's samples ``start + (m world + r) batch`` onwards."""

    def __init__(self, mix: MixedSet, seed: int, world: int, rank: int, batch: int, main: bool) -> None:
        self.mix, self.seed, self.world, self.rank, self.batch, self.main = mix, seed, world, rank, batch, main
        self.shards = [getattr(d, "set", None) for d in mix.datasets]  # a shard set's ShardSet, else None
        times = np.concatenate([(np.arange(d) + 0.5) / d for d in mix.draws])
        order = np.argsort(times, kind="stable")
        self.source = np.concatenate([np.full(d, s, np.int16) for s, d in enumerate(mix.draws)])[order]
        self.nth = np.concatenate([np.arange(d, dtype=np.int64) for d in mix.draws])[order]  # j: its draw this epoch
        self._orders: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self.epoch, self.start, self.restored, self.reported_tail = 0, 0, None, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.start = self.restored[1] if self.restored is not None and self.restored[0] == epoch else 0
        self.restored = None
        tail = (len(self.source) - self.start) % (self.world * self.batch)
        if tail and tail != self.reported_tail and self.main:
            say(f"scale-ocr: note: {tail} samples of the mix's epoch of {len(self.source)} do not fill a global batch "
                f"of {self.world * self.batch} and are left out of it (as DistributedSampler's drop_last)", err=True)
        self.reported_tail = tail

    def __len__(self) -> int:
        return (len(self.source) - self.start) // (self.world * self.batch)

    def __iter__(self):
        for m in range(len(self)):
            first = self.start + (m * self.world + self.rank) * self.batch
            yield [self.item(p) for p in range(first, first + self.batch)]

    def item(self, p: int) -> tuple[int, object]:
        """The epoch's sample ``p``: ``(source, its index there)``."""
        s = int(self.source[p])
        k = self.epoch * self.mix.draws[s] + int(self.nth[p])
        passes, at = divmod(k, self.mix.lengths[s])
        if self.shards[s] is None:
            return s, int(self._order((s, passes), lambda: np.random.default_rng(
                [self.seed, 17, s, passes]).permutation(self.mix.lengths[s]))[at])
        counts = self.shards[s].counts
        shard_order = self._order((s, passes, "shards"), lambda: np.random.default_rng(
            [self.seed, 18, s, passes]).permutation(len(counts)))
        ends = self._order((s, passes, "ends"), lambda: np.cumsum([counts[i] for i in shard_order]))
        i = int(np.searchsorted(ends, at, side="right"))
        shard = int(shard_order[i])
        member = at - (int(ends[i - 1]) if i else 0)
        members = self._order((s, passes, shard), lambda: np.random.default_rng(
            [self.seed, 19, s, passes, shard]).permutation(counts[shard]))
        return s, (shard, int(members[member]))

    def _order(self, key: tuple, make: Callable[[], np.ndarray]) -> np.ndarray:
        if key not in self._orders:
            self._orders[key] = make()
            while len(self._orders) > 8 * len(self.mix.sources):
                self._orders.popitem(last=False)
        return self._orders[key]

    def state(self, epoch: int, consumed_batches: int) -> dict:
        if epoch != self.epoch:
            return {"kind": "mix", "mix": self.mix.digest, "epoch": epoch, "samples_in_epoch": 0}
        return {"kind": "mix", "mix": self.mix.digest, "epoch": epoch,
                "samples_in_epoch": self.start + consumed_batches * self.batch * self.world}

    def restore(self, epoch: int, samples_in_epoch: int, state: dict | None) -> None:
        if state and state.get("kind") == "mix" and state.get("mix") != self.mix.digest:
            raise UserError("the checkpoint's data position belongs to another mix (other sources, weights or "
                            "labels); resume with the --train-path it trained on, or pass --resume none")
        self.restored = (epoch, int(state["samples_in_epoch"]) if state and "samples_in_epoch" in state
                         else samples_in_epoch)

    def drawn(self, state: dict) -> dict[str, int]:
        """Samples drawn from each source up to a :meth:`state` (every rank's, the whole run)."""
        epoch, at = int(state.get("epoch", 0)), int(state.get("samples_in_epoch", 0))
        this = np.bincount(self.source[:at], minlength=len(self.mix.sources))
        return {s.name: epoch * d + int(n) for s, d, n in zip(self.mix.sources, self.mix.draws, this, strict=True)}


def open_train(cfg, open_paths: Callable[[tuple[str, ...]], Dataset], synthetic: Callable[[], Dataset],
               digest: Callable[[tuple[str, ...]], str]) -> tuple[Dataset, str | None]:
    """A task's training set and its labels' digest (None: synthetic): ``--train-path``'s mix, folders or shard set
    (``open_paths``), or the generator (``synthetic``) when it is left out. A mix's line is said once."""
    sources = parse(cfg.train_path)
    if sources is None:
        return (open_paths(cfg.train_path), digest(cfg.train_path)) if cfg.train_path else (synthetic(), None)
    datasets = [synthetic() if s.name == SYNTHETIC else open_paths((s.name,)) for s in sources]
    mixed = MixedSet(sources, datasets, [None if s.name == SYNTHETIC else digest((s.name,)) for s in sources])
    say(mixed.line(), every_rank=False)
    return mixed, mixed.digest
