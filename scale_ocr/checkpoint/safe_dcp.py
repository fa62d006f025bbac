"""Read torch.distributed.checkpoint (DCP) folders without ever executing code from them.

Stock DCP unpickles ``.metadata`` with plain :mod:`pickle` and non-tensor entries with ``weights_only=False``: a
crafted checkpoint could run anything. Here only the classes DCP writes are resolved, and anything else is refused.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from scale_ocr.checkpoint.manifest import CHECKPOINT_FILE_LIMIT
from scale_ocr.disk import open_user_file
from scale_ocr.errors import UserError, first_line, printable, shown
from scale_ocr.strategies.flat_shard import FlatShard, shard_or_default

# Everything a .metadata written by torch 2.x references (found by logging find_class on real ones):
# the DCP dataclasses, and what their fields hold. None of these runs code when called with data.
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorStorageMetadata",
        "BytesStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),  # file, offset, length of an entry
    "torch": frozenset({"Size"}),  # shapes and offsets; dtypes are checked by type below
    "torch.serialization": frozenset({"_get_layout"}),  # torch.strided etc. pickle as a name lookup
    "pathlib": frozenset({"PosixPath"}),  # StorageMeta.checkpoint_id
    "pathlib._local": frozenset({"PosixPath"}),  # the same, pickled by Python >= 3.13
}
_CRAFTED = "which a checkpoint never holds; refusing to load it (it may have been crafted to run code): " \
           "use a checkpoint written by scale-ocr"


class _Refused(Exception):
    """A pickle referred to a global outside the allow-list; carries its dotted name."""


class _MetadataUnpickler(pickle.Unpickler):
    # Names must match exactly, so dotted lookups such as "PosixPath.touch" (protocol 4) are refused.
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def read_metadata_file(path: Path) -> Metadata:
    """Unpickle a DCP ``.metadata`` file, resolving only DCP's own classes; anything else is one line."""
    try:
        with open_user_file(path, what="the checkpoint's metadata", limit=CHECKPOINT_FILE_LIMIT) as f:
            metadata = _MetadataUnpickler(f).load()
    except _Refused as exc:
        raise UserError(f"checkpoint {path} refers to `{exc}`, {_CRAFTED}") from None
    except Exception as exc:  # noqa: BLE001 - truncated or garbage pickles raise many types
        raise UserError(f"checkpoint {path} cannot be read ({type(exc).__name__}); the file is truncated or "
                        "damaged: use an earlier checkpoints/step_N") from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"checkpoint {path} holds a {type(metadata).__name__}, not DCP metadata; {_CRAFTED}")
    return metadata


def load_tensors(path: Path, meta: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with a refused global reported as one line; ``meta``: the tensors are
    loaded to the meta device (shapes and dtypes, no memory; see
    :class:`scale_ocr.checkpoint.piecewise.TorchFileReader`)."""
    try:
        with open_user_file(path, what="the checkpoint file", limit=CHECKPOINT_FILE_LIMIT, follow=True) as f:
            return torch.load(f, weights_only=True, map_location="meta" if meta else None)
    except pickle.UnpicklingError as exc:
        refused = _global_of(exc)
        if refused is None:  # not a pickle a torch.save wrote (another format, or damaged): no attack to claim
            raise UserError(f"{shown(str(path))} is not a torch file ({_unpickler_words(exc)}); pass a model "
                            "file scale-ocr wrote (a run's best_model.pt, a checkpoint folder or an export)") from None
        raise UserError(f"checkpoint file {path} refers to `{refused}`, {_CRAFTED}") from None


def _global_of(exc: Exception) -> str | None:
    """The global a weights_only load refused (named "GLOBAL module.name" among several paragraphs); None when it
    refused something else (an opcode a torch.save never writes: the file is no torch pickle)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return found.group(1) if found else None


def _unpickler_words(exc: Exception) -> str:
    """weights_only's own reason (``Unsupported operand 56``), without its paragraphs about torch 2.6."""
    found = re.search(r"WeightsUnpickler error:\s*(.+)", str(exc))
    return printable((found.group(1) if found else first_line(exc)).strip()[:120])


class SafeFileSystemReader(FileSystemReader):
    """A DCP FileSystemReader whose ``.metadata`` goes through :func:`read_metadata_file` (read once)."""

    _cached: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._cached is None or kwargs.get("rank") is not None:
            self._cached = read_metadata_file(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(self._cached, "storage_meta", None) is None:  # as FileSystemReader does
            self._cached.storage_meta = StorageMeta()
        self._cached.storage_meta.load_id = self.load_id
        return self._cached


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner with non-tensor entries read by ``torch.load(weights_only=True)``; ``where``: the checkpoint
    folder, for the error message."""

    def __init__(self, where: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.where = where

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        # DefaultLoadPlanner's set-up (torch 2.14's _init_state_dict) replaces, in place, every value of a type it does
        # not know with None: each FlatShard goes through it as a marker and is put back after, in the state and in
        # the planner's flattened copy of it.
        hidden: dict[bytes, FlatShard] = {}

        def swap(d: dict[str, Any], back: bool) -> None:
            for k, v in d.items():
                if isinstance(v, dict):
                    swap(v, back)
                elif not back and isinstance(v, FlatShard):
                    d[k] = marker = b"scale-ocr-flat-shard-%d" % len(hidden)
                    hidden[marker] = v
                elif back and isinstance(v, bytes) and v in hidden:
                    d[k] = hidden[v]

        swap(state_dict, back=False)
        try:
            super().set_up_planner(state_dict, metadata, is_coordinator)
        finally:
            swap(state_dict, back=True)
        swap(self.state_dict, back=True)

    def lookup_tensor(self, index):
        return shard_or_default(self.state_dict, index, super().lookup_tensor)  # a FlatShard's box: its buffer

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            refused = _global_of(exc)
            if refused is None:
                raise UserError(f"checkpoint {self.where}: its entry `{fqn}` is not a torch pickle "
                                f"({_unpickler_words(exc)}); the checkpoint is damaged: use an earlier "
                                "checkpoints/step_N") from None
            raise UserError(f"checkpoint {self.where}: its entry `{fqn}` refers to `{refused}`, {_CRAFTED}") from None
        # What DefaultLoadPlanner.load_bytes (torch 2.14) does with the object, minus the unsafe load.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _user_error_in(exc: CheckpointException) -> UserError | None:
    # DCP runs each rank's steps under a wrapper that turns any exception into a CheckpointException
    # holding (exception, traceback) per rank; ours is the sentence to show.
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, UserError):
            return inner
    return None


def load(state: dict[str, Any], folder: Path, listed: set[str] | None, *, no_dist: bool = False) -> None:
    """``dcp.load(state, folder)``, executing nothing from the files.

    Every process reads ``.metadata`` on its own before any collective, so all ranks refuse together
    instead of one raising while the others wait. ``listed``: what :func:`.manifest.verify_manifest` returned (None:
    no manifest); every shard ``.metadata`` names must be among these. ``no_dist``: load in this process alone.
    """
    reader = SafeFileSystemReader(folder)
    metadata = reader.read_metadata()  # here, not inside dcp.load: DCP logs a traceback and retries on failure
    if listed is not None:
        unlisted = sorted({info.relative_path for info in metadata.storage_data.values()} - listed)
        if unlisted:
            raise UserError(f"checkpoint {folder} cannot be read: {unlisted[0]} is not in its manifest.json; "
                            "the checkpoint is damaged: use an earlier checkpoints/step_N")
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(folder), no_dist=no_dist)
    except CheckpointException as exc:
        raise (_user_error_in(exc) or exc) from None
