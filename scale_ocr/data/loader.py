"""Datasets -> loaders: a resumable :class:`Position` for training (folders and shard sets alike), an evenly padded
shard for validation."""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from scale_ocr.config import DataConfig
from scale_ocr.data.files import LABELS_LIMIT
from scale_ocr.disk import read_user_bytes
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.errors import UserError

VAL_SEED_OFFSET = 1_000_003  # synthetic validation samples never overlap the training stream's seeds


class EvalShard(Dataset):
    """This rank's share of a validation set, padded so every rank runs the same number of batches.

    Sharded models (FSDP, ZeRO-3) gather parameters inside forward, so a rank that ran one batch
    fewer would leave the others waiting forever. Padding items repeat sample 0 and are flagged
    ``valid=False`` so metrics ignore them.
    """

    def __init__(self, dataset: Dataset, rank: int, world_size: int) -> None:
        self.dataset, self.rank, self.world = dataset, rank, world_size
        self.total = len(dataset)
        self.per_rank = math.ceil(self.total / world_size)

    def __len__(self) -> int:
        return self.per_rank

    def __getitem__(self, i: int):
        j = self.rank + i * self.world
        valid = j < self.total
        return (*self.dataset[j if valid else 0], valid)


class WithValid(Dataset):
    """Appends ``valid=True`` to every item so train and eval batches have one shape."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return (*self.dataset[i], True)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way, to continue a resumed run's data order.

    The global permutation of an epoch depends only on (seed, epoch); rank r takes every world-th
    index of it. Skipping the first ``consumed`` samples of the *global* order is therefore skipping
    ``consumed // world_size`` on each rank, whatever the world size was when the run stopped.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.start = 0

    def skip_global(self, consumed: int) -> None:
        """Skip the first ``consumed`` samples of this epoch's global order (0 resets)."""
        self.start = consumed // self.num_replicas

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self) -> int:
        return super().__len__() - self.start


class Position(Protocol):
    """Where training is in the data, in samples, so a resume continues the epoch exactly."""

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``'s training order (its rest, when a restored position belongs to it)."""

    def state(self, epoch: int, consumed_batches: int) -> dict:
        """A JSON-able position after this rank took ``consumed_batches`` batches since ``set_epoch`` (every
        rank took as many), or the start of ``epoch`` when that is not the one set: what a checkpoint stores,
        free of world size, workers and batch size."""

    def restore(self, epoch: int, samples_in_epoch: int, state: dict | None) -> None:
        """Continue ``epoch`` from a checkpoint's ``state`` (None: a checkpoint that only counted samples) when
        :meth:`set_epoch` starts it."""


class FolderPosition:
    """:class:`Position` over a :class:`ResumableSampler`: the samples consumed of the epoch's global order."""

    def __init__(self, sampler: ResumableSampler, batch: int) -> None:
        self.sampler, self.batch = sampler, batch
        self.epoch, self.start, self.restored = 0, 0, None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.start = self.restored[1] if self.restored is not None and self.restored[0] == epoch else 0
        self.restored = None
        self.sampler.set_epoch(epoch)
        self.sampler.skip_global(self.start)

    def state(self, epoch: int, consumed_batches: int) -> dict:
        if epoch != self.epoch:
            return {"kind": "folder", "epoch": epoch, "samples_in_epoch": 0}
        return {"kind": "folder", "epoch": epoch,
                "samples_in_epoch": self.start + consumed_batches * self.batch * self.sampler.num_replicas}

    def restore(self, epoch: int, samples_in_epoch: int, state: dict | None) -> None:
        self.restored = (epoch, int(state["samples_in_epoch"]) if state and "samples_in_epoch" in state
                         else samples_in_epoch)


@dataclass
class Data:
    """Everything the trainer needs from the data side."""

    train_loader: DataLoader
    val_loader: DataLoader
    position: Position
    num_train: int
    num_val: int
    skipped: dict[str, int]
    labels_sha256: str | None  # of the training labels.json files; None for synthetic data
    speedup_hint: str = ""  # what would make loading faster, for a run that waited on it
    val_labels_sha256: str | None = None  # of the validation folders' labels.json (shards.json); None: synthetic
    sources: list[dict] | None = None  # a mix's sources, weights, sizes and draws an epoch (scale_ocr.data.mix)
    # --batch-pixels: the micro-batches' sample counts vary; (first, count) -> the samples every rank together took in
    # those micro-batches of the epoch (None: -b samples each), and a rank's mean samples per micro-batch
    step_samples: Callable[[int, int], int] | None = None
    micro_batch: float | None = None

    def taken(self, first: int, count: int, fixed: int) -> int:
        """Samples every rank together took in micro-batches ``first`` to ``first + count - 1`` of the epoch's order:
        ``fixed`` (a step of -b samples a micro-batch), or where they vary what the position dealt."""
        return fixed if self.step_samples is None else self.step_samples(first, count)

    def identity(self) -> dict[str, str | None]:
        """What a checkpoint records of its data, so a resume can tell the same from another (None: seeded synthetic
        data or a cache, nothing recorded to compare)."""
        return {"train_sha256": self.labels_sha256, "val_sha256": self.val_labels_sha256}


def speedup_hint(workers: int, local_world: int) -> str:
    """One sentence on how to take loading off the training ranks' critical path."""
    cores = os.cpu_count() or 1
    spare = max(0, cores - local_world)  # one busy core per rank at least
    if workers == 0:
        return (f"loading runs inside each rank (--workers 0); --workers N decodes in N background processes per rank "
                f"(this host: {cores} cores for {local_world} local ranks), or pre-render the data "
                "(--data-cache for synthetic words)")
    return (f"{workers} loader workers per rank do not keep up; raise --workers (this host: {cores} cores, "
            f"{spare} beyond one per rank) or pre-render the data (--data-cache for synthetic words)")


def labels_digest(paths: tuple[str, ...]) -> str:
    """SHA-256 over the training folders' labels.json files (a shard set's index), to tell datasets apart in W&B."""
    from scale_ocr.data.shards import INDEX, is_shard_set

    h = hashlib.sha256()
    for p in paths:
        h.update(read_user_bytes(Path(p) / (INDEX if is_shard_set(p) else "labels.json"), what="the labels",
                                 limit=LABELS_LIMIT, follow=True))
    return h.hexdigest()


def _workers(cfg: DataConfig, dist: DistInfo) -> int:
    if cfg.workers is not None:
        return cfg.workers
    if dist.device.type != "cuda":
        return 0  # on CPU the ranks already use every core for compute
    return max(0, min(4, (os.cpu_count() or 1) // dist.local_world_size - 1))


def build_loaders(train_ds: Dataset, val_ds: Dataset, collate, cfg: DataConfig, batch_size: int, seed: int,
                  dist: DistInfo, skipped: dict[str, int], labels_sha256: str | None,
                  widths: tuple[Sequence[int], int] | None = None) -> Data:
    """This rank's train and validation loaders over a task's datasets (items: ``(input, target)`` pairs; ``collate``
    takes ``(input, target, valid)`` items). ``widths``: each training sample's width as the model reads it, and the
    model's input height, for micro-batches filled to ``cfg.batch_pixels``."""
    workers = _workers(cfg, dist)
    common = dict(collate_fn=collate, num_workers=workers, pin_memory=dist.device.type == "cuda",
                  persistent_workers=workers > 0)
    # The loader draws its workers' base seed from this generator rather than the global RNG, so
    # starting an epoch's iterator does not shift the augmentation stream a resumed run restores.
    gen = torch.Generator().manual_seed(seed * 1000 + dist.rank)
    varying = {}
    if widths is not None:  # --batch-pixels: the sampler is the position (scale_ocr.data.pixel_batches)
        position = _pixel_position(len(train_ds), cfg.batch_pixels, seed, dist, *widths)
        train_loader = DataLoader(WithValid(train_ds), batch_sampler=position, generator=gen, **common)
        varying = {"step_samples": position.samples, "micro_batch": position.mean_samples()}
    elif len(train_ds) < batch_size * dist.world_size:
        raise UserError(
            f"{len(train_ds)} training samples cannot fill one batch of {batch_size} on each of "
            f"{dist.world_size} ranks; add samples or lower --batch-size"
        )
    elif hasattr(train_ds, "position"):  # a streamed set: its position is the batch sampler
        position = train_ds.position(seed, dist.world_size, dist.rank, workers, batch_size, dist.rank == 0)
        train_loader = DataLoader(WithValid(train_ds), batch_sampler=position, generator=gen, **common)
    else:
        sampler = ResumableSampler(train_ds, num_replicas=dist.world_size, rank=dist.rank, shuffle=True,
                                   seed=seed, drop_last=True)
        position = FolderPosition(sampler, batch_size)
        train_loader = DataLoader(WithValid(train_ds), batch_size=batch_size, sampler=sampler, drop_last=True,
                                  generator=gen, **common)
    val_loader = DataLoader(EvalShard(val_ds, dist.rank, dist.world_size), batch_size=batch_size, shuffle=False,
                            **common)
    describe = getattr(train_ds, "describe", None)  # a mix says its sources
    return Data(train_loader, val_loader, position, len(train_ds), len(val_ds), skipped, labels_sha256,
                speedup_hint(workers, dist.local_world_size), labels_digest(cfg.val_path) if cfg.val_path else None,
                describe() if describe else None, **varying)


def _pixel_position(samples: int, budget: int, seed: int, dist: DistInfo, widths: Sequence[int], height: int):
    """The :class:`~scale_ocr.data.pixel_batches.PixelPosition` of ``samples`` crops ``widths`` wide at ``height``,
    within ``budget`` pixels a micro-batch; a budget or set that cannot fill one is refused in one line."""
    from scale_ocr.data.pixel_batches import PixelPlan, PixelPosition

    try:
        plan = PixelPlan(widths, height, budget, dist.world_size, seed)
    except ValueError:  # the plan's one check: a budget under the widest crop
        widest = max(widths) * height
        raise UserError(f"--batch-pixels {budget} cannot hold the widest training crop, {max(widths)} x {height} = "
                        f"{widest} pixels; give at least {widest}, or a smaller --max-width") from None
    position = PixelPosition(plan, dist.rank)
    if len(position) == 0:
        raise UserError(f"{samples} training crops cannot fill one micro-batch of --batch-pixels {budget} on each of "
                        f"{dist.world_size} ranks; add crops or lower --batch-pixels")
    return position

