"""Read an offline W&B run back from its ``.wandb`` transaction log (wandb ships no Python reader).

The file is a LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1, version), then 32 KiB blocks
of chunks, each framed by a CRC-32 (4 bytes), a length (2) and a type (1: full, 2: first, 3: middle,
4: last); a block's tail shorter than a frame header is padding. Reassembled payloads are protobuf
``Record`` messages from ``wandb.proto.wandb_internal_pb2``.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
FILE_HEADER = 7
FRAME = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_payloads(path: str | Path, verify: bool = True) -> Iterator[bytes]:
    """Reassembled record payloads of a ``.wandb`` file, in order."""
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:FILE_HEADER])
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path} is not a W&B transaction log (header {data[:FILE_HEADER]!r})")
    pos, pending = FILE_HEADER, b""
    while pos + FRAME <= len(data):
        room = BLOCK - pos % BLOCK
        if room < FRAME:  # block trailer padding
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + FRAME])
        chunk = data[pos + FRAME:pos + FRAME + length]
        if kind == 0 and length == 0:  # zero padding written at the end of a block
            pos += room
            continue
        if verify and zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: checksum mismatch at byte {pos}")
        pos += FRAME + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def _item(item) -> tuple[str, Any]:
    key = item.key or "/".join(item.nested_key)
    try:
        value = json.loads(item.value_json)
    except ValueError:
        value = item.value_json
    return key, value


@dataclass
class OfflineRun:
    """What an offline run recorded: its run record, config, history rows and final summary."""

    run_id: str | None = None
    project: str | None = None
    group: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    record_types: dict[str, int] = field(default_factory=dict)
    # Logged artifacts (a table is one, with its images): type and {path in the artifact: staged local file}.
    artifacts: dict[str, dict[str, Any]] = field(default_factory=dict)


def read_offline_run(path: str | Path) -> OfflineRun:
    """Parse a ``run-<id>.wandb`` file (or the offline run folder holding one)."""
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    if path.is_dir():
        path = next(path.glob("*.wandb"))
    run = OfflineRun()
    for payload in iter_payloads(path):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        run.record_types[kind] = run.record_types.get(kind, 0) + 1
        if kind == "run":
            run.run_id, run.project, run.group = rec.run.run_id, rec.run.project, rec.run.run_group
            for it in rec.run.config.update:
                k, v = _item(it)
                run.config[k] = v
        elif kind == "config":
            for it in rec.config.update:
                k, v = _item(it)
                run.config[k] = v
        elif kind == "history":
            run.history.append(dict(_item(it) for it in rec.history.item))
        elif kind == "artifact":
            files = {e.path: e.local_path for e in rec.artifact.manifest.contents}
            run.artifacts[rec.artifact.name] = {"type": rec.artifact.type, "files": files}
        elif kind == "summary":
            for it in rec.summary.update:
                k, v = _item(it)
                run.summary[k] = v
    # W&B wraps each config value as {"value": ...}; unwrap for readers.
    run.config = {k: v["value"] if isinstance(v, dict) and set(v) == {"value"} else v for k, v in run.config.items()}
    return run
