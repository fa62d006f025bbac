"""Whole-model files written one tensor at a time, so that writing one never holds the whole model.

The layout is written first, from names, shapes and dtypes, then each tensor's bytes into their place as it arrives.
:class:`TorchFile` lays out with ``torch.save`` of fake tensors under ``torch.serialization.skip_data``, torch's own
way to fill storage bytes in a later pass (records carry no CRC: torch writes them with ``compute_crc32`` off).
"""

from __future__ import annotations

import json
import math
import struct
import sys
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from scale_ocr.checkpoint.manifest import CHECKPOINT_FILE_LIMIT
from scale_ocr.disk import open_user_file

_LOCAL_HEADER = b"PK\x03\x04"
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file: its name, shape and dtype (what is known before its values are)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _raw(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s bytes in memory order (little-endian hosts, as both formats are), without a copy when it is a
    contiguous CPU tensor."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


class PiecewiseFile:
    """A file laid out for ``specs`` in ``f`` (empty, readable, writable, seekable), whose tensors arrive one at a
    time, in the specs' order."""

    def __init__(self, f: BinaryIO, specs: Iterable[TensorSpec]) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("scale-ocr writes model files on little-endian hosts only")
        self.f, self.specs, self.written = f, list(specs), 0
        self.offsets = self._layout()

    def _layout(self) -> list[int]:
        """Write everything but the tensors' bytes; return where each tensor's bytes start."""
        raise NotImplementedError

    def put(self, tensor: torch.Tensor) -> None:
        """The next tensor's values, checked against its spec."""
        spec = self.specs[self.written]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"{spec.name}: got {tuple(tensor.shape)} {tensor.dtype}, the file holds "
                             f"{spec.shape} {spec.dtype}")
        self.f.seek(self.offsets[self.written])
        self.f.write(_raw(tensor))
        self.written += 1

    def close(self) -> None:
        """Check that every tensor arrived (the caller's atomic file then flushes and renames it)."""
        if self.written != len(self.specs):
            raise ValueError(f"{len(self.specs) - self.written} of {len(self.specs)} tensors were never written")


class TorchFile(PiecewiseFile):
    """A ``torch.save`` file of the dict ``{spec.name: tensor}``."""

    def _layout(self) -> list[int]:
        from torch._subclasses.fake_tensor import FakeTensorMode  # what skip_data materializes; no memory

        with FakeTensorMode():
            fake = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in self.specs}
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(fake, self.f)
        self.f.flush()
        # torch names each storage's record data/<n>, n counting storages as the pickler meets them: the dict's order.
        with zipfile.ZipFile(self.f) as archive:
            records = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
        offsets = []
        for n, spec in enumerate(self.specs):
            info = records.get(f"data/{n}")
            if info is None or info.file_size != spec.nbytes:
                raise RuntimeError(f"torch.save laid out {spec.name} unexpectedly (record data/{n}); this torch "
                                   f"{torch.__version__} is not one scale-ocr knows how to write piece by piece")
            offsets.append(self._data_start(info))
        return offsets

    def _data_start(self, info: zipfile.ZipInfo) -> int:
        self.f.seek(info.header_offset)
        header = self.f.read(30)
        if header[:4] != _LOCAL_HEADER:
            raise RuntimeError(f"torch.save wrote no zip record header for {info.filename}")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.header_offset + 30 + name_len + extra_len


class SafetensorsFile(PiecewiseFile):
    """A safetensors file, with ``metadata`` (strings) as its header's ``__metadata__``."""

    def __init__(self, f: BinaryIO, specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> None:
        self.metadata = dict(metadata or {})
        super().__init__(f, specs)

    def _layout(self) -> list[int]:
        header: dict[str, object] = {"__metadata__": self.metadata} if self.metadata else {}
        starts, at = [], 0
        for spec in self.specs:
            if spec.dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"{spec.name}: safetensors holds no {spec.dtype}")
            header[spec.name] = {"dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [at, at + spec.nbytes]}
            starts.append(at)
            at += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode("utf-8")
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.f.write(struct.pack("<Q", len(text)) + text)
        base = 8 + len(text)
        self.f.truncate(base + at)  # the gap the bytes fill: sparse, no memory
        return [base + s for s in starts]


class TorchFileReader:
    """The tensors of a ``torch.save`` file of ``{name: tensor}``, read one at a time, never the whole file.

    The layout comes from ``torch.load(weights_only=True, map_location="meta")`` (``layout``: meta tensors, no
    memory), which records where each storage lies in the file; :meth:`read` then reads one tensor's bytes from
    there (the caller loads ``layout``, so that refusing a crafted file is its one line). A mapping of the file would
    do it too, but a private writable one (torch's) counts the whole file against a data-segment cap.
    """

    def __init__(self, path: Path, layout: dict[str, torch.Tensor]) -> None:
        self.path, self.layout = path, layout

    def read(self, name: str) -> torch.Tensor:
        meta = self.layout[name]
        storage = meta.untyped_storage()
        at = getattr(storage, "_checkpoint_offset", None)  # torch sets it on storages it loads to the meta device
        if at is None:
            raise RuntimeError(f"torch {torch.__version__} did not say where {name} lies in {self.path}")
        if not meta.numel():
            return torch.empty(meta.shape, dtype=meta.dtype)
        size = meta.element_size()
        # The elements a view can reach, from its first: its storage may be larger (a slice saved with its base).
        span = 1 + sum((n - 1) * st for n, st in zip(meta.shape, meta.stride(), strict=True))
        raw = torch.empty(span * size, dtype=torch.uint8)
        with open_user_file(self.path, what="the weights file", limit=CHECKPOINT_FILE_LIMIT, follow=True) as f:
            f.seek(at + meta.storage_offset() * size)
            if f.readinto(raw.numpy()) != span * size:
                raise EOFError(f"{self.path} ends inside {name}")
        values = raw.view(meta.dtype)
        return values.view(meta.shape) if meta.is_contiguous() else values.as_strided(meta.shape, meta.stride()).clone()

