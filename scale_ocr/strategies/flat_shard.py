"""A rank's flat range of a tensor (DeepSpeed's partitions) as the rectangular boxes a DCP checkpoint holds.

Each rank writes what it holds, in the tensor's own shape, so any strategy can read it back; :class:`FlatShard`
offers DCP what a DTensor does, and reads its values only when DCP reaches a box (docs/checkpoints.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, index of its first element in the flat order)


def flat_boxes(shape: tuple[int, ...], begin: int, end: int) -> list[Box]:
    """The boxes that elements ``[begin, end)`` of a ``shape`` tensor's row-major order make up, in that order: a
    partial row, whole rows, a partial row, recursively. Each box's values are ``flat[first:first + prod(sizes)]``."""
    if begin >= end:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first_row, first_off = divmod(begin, inner)
    last_row, last_off = divmod(end, inner)

    def within(row: int, lo: int, hi: int) -> list[Box]:  # part of one row of the first dimension
        return [((row, *off), (1, *size), row * inner + at) for off, size, at in flat_boxes(shape[1:], lo, hi)]

    if first_row == last_row:
        return within(first_row, first_off, last_off)
    boxes = []
    if first_off:
        boxes += within(first_row, first_off, inner)
        first_row += 1
    if last_row > first_row:
        boxes.append(((first_row, *([0] * (len(shape) - 1))), (last_row - first_row, *shape[1:]), first_row * inner))
    if last_off:
        boxes += within(last_row, 0, last_off)
    return boxes


@dataclass(eq=False)
class FlatShard:
    """Elements ``[start, start + numel)`` of a ``shape`` tensor's row-major order, held by this rank in a flat buffer.

    ``local`` returns this rank's ``numel`` elements as a 1-D tensor, each time DCP reaches a box; to load into, it
    must return a view of the engine's own buffer.
    """

    shape: tuple[int, ...]
    start: int
    numel: int
    dtype: torch.dtype
    local: Callable[[], torch.Tensor]

    def boxes(self) -> list[Box]:
        return flat_boxes(self.shape, self.start, self.start + self.numel)

    def box(self, offsets: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """The values of the box that begins at ``offsets`` (a view of what :attr:`local` returns)."""
        for off, sizes, first in self.boxes():
            if tuple(off) == tuple(offsets):
                at = first - self.start
                return self.local()[at:at + math.prod(sizes)].view(sizes)
        raise ValueError(f"no box of this rank's shard begins at {tuple(offsets)}")

    # DCP's protocol for objects that hold part of a tensor (what DTensor implements).
    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)),
                                                      properties=properties, size=torch.Size(self.shape)))
                for off, sizes, _ in self.boxes()]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)) for off, sizes, _ in self.boxes()]


def shard_or_default(state: dict[str, Any], index: Any, default: Callable[[Any], Any]) -> Any:
    """The tensor DCP asks for at ``index``: a box of a :class:`FlatShard`, else what ``default(index)`` finds."""
    obj = state.get(index.fqn)
    if isinstance(obj, FlatShard):
        return obj.box(index.offset)
    return default(index)
