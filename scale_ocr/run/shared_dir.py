"""Every rank must see the run directory that rank 0 writes: checked once at start, before any work.

Rank 0 writes metrics and models there, every rank its checkpoint shards, and a resume reads what rank 0 wrote;
nodes that do not share ``--output-dir`` would each keep a part of the run. So rank 0 writes a token file with a
random name (no node or NFS negative cache can hold an older answer), every rank reads it back, and if any does not
see it every rank stops with one line naming those ranks and hosts.
"""

from __future__ import annotations

import os
import socket
from contextlib import suppress
from pathlib import Path

import torch
import torch.distributed as tdist

from scale_ocr.disk import KiB, read_user_bytes, write_atomic
from scale_ocr.errors import UserError, printable, shown

TOKEN_PREFIX = ".scale-ocr-shared-"  # the run directory's listing ignores these (run_dir.previous_run)
TOKEN_BYTES = 16
HOST_BYTES = 64  # a host name as gathered: HOST_NAME_MAX on Linux


def _write_token(run_dir: Path) -> tuple[bytes, BaseException | None]:
    """Rank 0: the token written in ``run_dir`` (zeros and the error when it could not be written)."""
    for stale in run_dir.glob(TOKEN_PREFIX + "*"):  # left by a killed job; rank 0 holds the directory's lock
        with suppress(OSError):
            stale.unlink()  # a link is removed, never followed
    token = os.urandom(TOKEN_BYTES)
    path = run_dir / (TOKEN_PREFIX + token.hex())
    try:
        write_atomic(path, token.hex(), what="the shared-directory check's token", kept="nothing else was written")
    except UserError as exc:  # a full disk (DiskFault) included
        return bytes(TOKEN_BYTES), exc
    except OSError as exc:
        return bytes(TOKEN_BYTES), UserError(f"could not write {shown(path, 200)} ({exc.strerror or exc}); make "
                                             "--output-dir writable by this user or pick another --output-dir")
    return token, None


def _sees(run_dir: Path, token: bytes) -> bool:
    """Whether this rank reads the token file back with the token in it."""
    try:
        seen = read_user_bytes(run_dir / (TOKEN_PREFIX + token.hex()), what="the shared-folder token", limit=KiB)
        return seen.strip() == token.hex().encode("ascii")
    except (OSError, UserError):
        return False


def _gather(seen: bool, device: torch.device) -> list[tuple[bool, str]]:
    """Every rank's answer and host name, in rank order (fixed-size bytes: no pickled objects between ranks)."""
    host = socket.gethostname().encode("utf-8", "replace")[:HOST_BYTES]
    mine = torch.zeros(1 + HOST_BYTES, dtype=torch.uint8, device=device)
    mine[0] = int(seen)
    mine[1:1 + len(host)] = torch.tensor(list(host), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(tdist.get_world_size())]
    tdist.all_gather(parts, mine)
    return [(bool(p[0]), bytes(p[1:].tolist()).rstrip(b"\0").decode("utf-8", "replace")) for p in parts]


def _ranks_text(ranks: list[int], hosts: list[str], limit: int = 8) -> str:
    """``rank 1 (on node2)`` / ``ranks 1 (on node2), 2 (on node3) and 5 more``."""
    named = [f"{r} (on {printable(hosts[r], 64)})" for r in ranks[:limit]]
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(named) + more


def check_shared(run_dir: Path, dist) -> None:
    """Stop every rank with one line unless all of them see the files rank 0 writes in ``run_dir`` (a collective).

    Call it once the directory exists (rank 0 has claimed it) and before any rank reads from it.

    Args:
        run_dir: ``--output-dir``.
        dist: this process's place in the job.

    Raises:
        UserError: on every rank, naming the ranks (and hosts) that do not see rank 0's file, and the fix.
    """
    if dist.world_size == 1:
        return
    token, problem = _write_token(run_dir) if dist.is_main else (bytes(TOKEN_BYTES), None)
    shared = torch.tensor(list(token), dtype=torch.uint8, device=dist.device)
    tdist.broadcast(shared, src=0)  # sent once the file is written: the others read only after that
    token = bytes(shared.tolist())
    if problem is not None:
        raise problem
    if token == bytes(TOKEN_BYTES):
        raise UserError("rank 0 could not write in the run directory to check that every rank sees it "
                        "(its message says why)")
    answers = _gather(_sees(run_dir, token), dist.device)
    if dist.is_main:
        with suppress(OSError):
            (run_dir / (TOKEN_PREFIX + token.hex())).unlink()  # every rank has looked: the gather is over
    blind = [rank for rank, (seen, _) in enumerate(answers) if not seen]
    if blind:
        hosts = [host for _, host in answers]
        raise UserError(
            f"{_ranks_text(blind, hosts)} cannot see the file that rank 0 (on {printable(hosts[0], 64)}) wrote in "
            f"--output-dir {shown(run_dir, 200)}: every rank writes its checkpoint shards there and a resume reads "
            "what rank 0 wrote; put --output-dir on storage that every node mounts at the same path (NFS, Lustre, "
            "a shared volume), or run all ranks on one node")
