"""Files of a run directory: ours or refused, written whole or not at all, and a full disk as one line.

- **No links, no foreign files**: an entry that is a symbolic link, not a regular file, or owned by another user
  (root included) is refused in one line (:func:`check_entry`); files written in place are opened ``O_NOFOLLOW``
  and checked with ``fstat`` before a byte is written.
- **Whole or nothing**: other files go to ``.NAME.tmpPID`` beside the name, fsynced, then renamed over it
  (:func:`write_atomic`); a rename replaces a link that appeared after the check instead of following it.
- **Disk faults** (ENOSPC, EDQUOT, EFBIG, EIO) become one :class:`DiskFault` line, exit :data:`EXIT_DISK_FULL`. A
  rank-0-only write :func:`defer` s its fault so the loop's next agreement ends every rank together.
- **One way in for user files** (:func:`open_user_file`, :func:`read_user_bytes`, :func:`read_user_text`,
  :func:`read_user_json`): every file a command reads from a user's path (run files, configs, indexes, PDFs,
  caches, weights) is opened non-blocking and checked with ``fstat`` before a byte is read: a regular file only
  (no FIFO to block on, no device to read forever), at most its kind's size cap, and, inside a run or dataset
  folder, never through a link. A parse into typed records follows before anything is allocated from it.
- **One way out for outputs** (:func:`check_output`): an output a command writes (an export, a plot) never
  replaces a run's own file.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from scale_ocr.errors import JSON_ERRORS, RunStopped, UserError, json_problem, shown

# EX_IOERR from sysexits.h: an input/output error. Here: the disk is full, over quota or over the file size
# limit (or failing); nothing kept was damaged, so rerunning after freeing space continues from the last checkpoint.
EXIT_DISK_FULL = 74
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
# torch.save to a path reports a failed write without its errno; these are the words it uses.
_TORCH_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed writing", "iostream error",
                         "file write failed")
_REASONS = {errno.ENOSPC: "the file system is full", errno.EDQUOT: "the disk quota is used up",
            errno.EFBIG: "the file size limit (ulimit -f) is reached", errno.EIO: "the device reported an I/O error"}


class DiskFault(RunStopped):
    """A write failed for lack of space (or a failing disk): one line, exit :data:`EXIT_DISK_FULL`."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_DISK_FULL)


def _refuse(path: Path, problem: str) -> UserError:
    return UserError(f"{path} {problem}; scale-ocr never writes through a link or into another user's file: "
                     "remove it (or move the run away) and rerun, or pick another --output-dir or output path")


def _judge(path: Path, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, f"is a symbolic link (to {os.readlink(path)})")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")


def check_entry(path: str | os.PathLike[str], directory: bool = False) -> None:
    """Refuse ``path`` if it is a link, another user's, or not a regular file (a directory with ``directory``).

    Nothing there is fine: it will be created.
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    _judge(path, st)
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        raise _refuse(path, "is not a directory" if directory else "is not a regular file")


def open_own(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
    """``os.open`` that never follows a link and keeps the descriptor only of our own regular file.

    Do not pass ``O_TRUNC``: truncate with ``os.ftruncate`` after this returns, once the file is known to be ours.
    """
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            check_entry(path)  # raises: a link
        raise
    st = os.fstat(fd)
    try:
        _judge(path, st)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, "is not a regular file")
    except UserError:
        os.close(fd)
        raise
    return fd


def write_atomic(path: str | os.PathLike[str], data: bytes | str | Callable[[BinaryIO], None], *, what: str,
                 kept: str, needed: int | None = None) -> None:
    """Write ``path`` whole or not at all: a temp file beside it, fsynced, renamed over it.

    Args:
        path: the file.
        data: its content, or a function that writes it to the binary file it is given.
        what: what the file is, for the message (``"the model"``).
        kept: what a failed write leaves intact, for the message.
        needed: bytes the file needs, when known.

    Raises:
        UserError: ``path`` is a link or another user's file.
        DiskFault: the disk is full, over quota or the file size limit (the temp file is removed).
    """
    with atomic_file(path, what=what, kept=kept, needed=needed) as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)


@contextmanager
def atomic_file(path: str | os.PathLike[str], *, what: str, kept: str, needed: int | None = None) -> Iterator[BinaryIO]:
    """The binary file (readable, writable and seekable) that becomes ``path`` when the ``with`` block ends without
    an exception: a temp file beside it, fsynced, renamed over it. An exception removes the temp file; a disk
    fault becomes one :class:`DiskFault` line (arguments as :func:`write_atomic`)."""
    path = Path(path)
    check_entry(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a killed process of the same pid: a link is removed, never followed
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with suppress(OSError):
            os.unlink(tmp)
        fault = disk_fault(exc, path, what, kept, needed)
        if fault is not None:
            raise fault from None
        raise


def _errno_of(exc: BaseException) -> int | None:
    """The disk errno in ``exc``'s chain (DCP's per-rank failures included); 0 for torch's errno-less write
    failure; None when ``exc`` is not a disk fault."""
    stack, seen, torch_write = [exc], set(), False
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e.errno
        torch_write = torch_write or any(s in str(e) for s in _TORCH_WRITE_FAILURES)
        failures = getattr(e, "failures", None)  # CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            stack += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        stack += [e.__cause__, e.__context__]
    return 0 if torch_write else None


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged user may still write on ``path``'s file system (None when unknown)."""
    for p in (path, *path.parents):
        with suppress(OSError):
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
    return None


def _guess(path: Path, needed: int | None) -> int:
    """Which fault an errno-less failed write was: little space left, else a file size limit, else I/O."""
    free = free_bytes(path)
    if free is not None and free < max(needed or 0, 1 << 20):
        return errno.ENOSPC
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return errno.EFBIG
    return errno.EIO


def size_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} bytes"


def disk_fault(exc: BaseException, path: Path, what: str, kept: str, needed: int | None = None) -> DiskFault | None:
    """``exc`` as a one-line :class:`DiskFault` about writing ``path``, or None when it is not a disk fault."""
    code = _errno_of(exc)
    if code is None:
        return None
    code = code or _guess(path, needed)
    reason = _REASONS[code]
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        reason += "" if limit == resource.RLIM_INFINITY else f" ({size_text(limit)} a file)"
    facts = [f"{errno.errorcode[code]}: {reason}"]
    if needed:
        facts.append(f"{size_text(needed)} needed")
    free = free_bytes(path)
    if free is not None and code in (errno.ENOSPC, errno.EDQUOT):
        facts.append(f"{size_text(free)} free there")
    fix = {errno.EIO: "check the disk (dmesg) and run the same command again",
           errno.EFBIG: "raise the file size limit (ulimit -f) and run the same command again"}.get(
        code, "free space there (or pick another path) and run the same command again")
    return DiskFault(f"could not write {what} {path} ({', '.join(facts)}); {kept}; {fix}")


def tree_bytes(path: Path) -> int | None:
    """Bytes of the files under ``path`` (None when it does not exist): the size a save of the same state needs."""
    if not path.is_dir():
        return None
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def remove_tree(path: Path) -> None:
    """Remove a folder this run created (a partial checkpoint); a link is unlinked, never followed."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


_pending: list[DiskFault] = []  # a rank-0-only write that failed, until every rank ends together


def defer(fault: DiskFault) -> None:
    """Hold ``fault`` until the ranks' next agreement (the first one is the one reported)."""
    if not _pending:
        _pending.append(fault)


def pending() -> DiskFault | None:
    return _pending[0] if _pending else None


def take_pending() -> DiskFault | None:
    """The held fault, forgotten here (it is about to be raised)."""
    return _pending.pop() if _pending else None


def clear_pending() -> None:
    """A new run starts with nothing held (several runs may share one process, as tests do)."""
    _pending.clear()


def raise_or_defer(fault: DiskFault) -> None:
    """Raise at once in a one-process job; hold it for the next agreement when peers would otherwise wait."""
    import torch.distributed as tdist

    if tdist.is_initialized() and tdist.get_world_size() > 1:
        defer(fault)
    else:
        raise fault


# --- Reading what a user hands us -----------------------------------------------------------------------------

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
JSON_LIMIT = 64 * MiB  # a run's config.json or metrics.json, a shards.json, a labels.json: far below this
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a non-regular entry is, in words."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def open_user_file(path: str | os.PathLike[str], *, what: str, limit: int, follow: bool = False,
                   missing: str | None = None) -> BinaryIO:
    """Open a file a user handed us (``what``, e.g. ``"the run's config.json"``) for reading, or refuse it in one line.

    Args:
        path: the file.
        what: what it is, for the message.
        limit: the most bytes such a file can hold; a larger one is refused before a byte is read.
        follow: a link is followed only for a path the user typed (it names what the user meant); an entry found
            inside a run or dataset folder is read only as itself.
        missing: the whole line to say when nothing is at ``path`` (not even a link), where the caller knows what
            the file is for and how to make it; else the line says it does not exist.

    The open is non-blocking (a FIFO never blocks it); the descriptor's ``fstat`` must show a regular file.

    Raises:
        UserError: missing, a link (without ``follow``), not a regular file, unreadable, or over ``limit``.
    """
    path = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise _unreadable(path, what, exc, missing) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{what} {shown(path)} is {kind_of(st.st_mode)}, not a regular file; pass a regular file")
        if st.st_size > limit:
            raise UserError(f"{what} {shown(path)} holds {size_text(st.st_size)}, more than such a file can "
                            f"({size_text(limit)}); it is not what it claims to be: pass the right file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _unreadable(path: Path, what: str, exc: OSError, missing: str | None = None) -> UserError:
    if exc.errno == errno.ENOENT and missing is not None and not os.path.lexists(path):
        return UserError(missing)
    if exc.errno == errno.ENOENT:
        return UserError(f"{what} {shown(path)} does not exist; check the path")
    if exc.errno == errno.ELOOP:
        return UserError(f"{what} {shown(path)} is a symbolic link (to {shown(os.readlink(path))}); scale-ocr reads "
                         "the files of a run or a dataset only as themselves: put the file itself there")
    if exc.errno == errno.EACCES:
        return UserError(f"{what} {shown(path)} cannot be read by this user (permission denied); fix its permissions")
    return UserError(f"{what} {shown(path)} cannot be opened ({errno.errorcode.get(exc.errno, exc.errno)}: "
                     f"{os.strerror(exc.errno or 0)}); check the path")


def read_user_bytes(path: str | os.PathLike[str], *, what: str, limit: int, follow: bool = False,
                    missing: str | None = None) -> bytes:
    """The bytes of a user's file, read through :func:`open_user_file` (arguments as there); a file that grew past
    ``limit`` while it was read is refused too."""
    with open_user_file(path, what=what, limit=limit, follow=follow, missing=missing) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UserError(f"{what} {shown(Path(path))} grew past {size_text(limit)} while it was read; pass a file that "
                        "is not being written")
    return data


def read_user_text(path: str | os.PathLike[str], *, what: str, limit: int, follow: bool = False,
                   missing: str | None = None) -> str:
    """A user's file as UTF-8 text (arguments as :func:`open_user_file`); other bytes are refused in one line."""
    data = read_user_bytes(path, what=what, limit=limit, follow=follow, missing=missing)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {shown(Path(path))} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
                        f"{exc.start}); save it as UTF-8, or pass the right file") from None


def refuse_json_constant(name: str) -> float:
    """``json.loads``' ``parse_constant``: NaN and Infinity, which Python writes but JSON does not have, refused."""
    raise ValueError(f"it holds {name}, which JSON does not have")


def read_user_json(path: str | os.PathLike[str], *, what: str, limit: int = JSON_LIMIT, follow: bool = False,
                   nan_ok: bool = False, missing: str | None = None):
    """A user's JSON file, parsed (arguments as :func:`open_user_file`). ``NaN`` and ``Infinity``, which Python
    writes but JSON does not have, are refused unless ``nan_ok`` (a run's metrics may hold a NaN loss); the caller
    then validates the records before it uses them."""
    text = read_user_text(path, what=what, limit=limit, follow=follow, missing=missing)
    try:
        return json.loads(text) if nan_ok else json.loads(text, parse_constant=refuse_json_constant)
    except JSON_ERRORS as exc:
        raise UserError(f"{what} {shown(Path(path))} is not valid JSON ({json_problem(exc)}); pass the file "
                        "scale-ocr wrote, or repair it") from None


# --- Writing a command's outputs ------------------------------------------------------------------------------

LOCK_NAME = ".scale-ocr.lock"
RUN_MARKERS = ("config.json", "metrics.jsonl", "metrics.json", "checkpoints", "last_model.pt")
# Every entry a run writes; each must be a plain file (or folder) of this user, never a link.
RUN_FILES = (*RUN_MARKERS, "best_model.pt", "wandb_run_id", "wandb")


def is_run_dir(path: Path) -> bool:
    """``path`` is a run directory: it holds a run's lock or its config.json beside its metrics or checkpoints."""
    return (path / LOCK_NAME).exists() or ((path / "config.json").exists()
                                           and any((path / n).exists() for n in RUN_MARKERS[1:]))


def check_output(path: str | os.PathLike[str], flag: str) -> Path:
    """Refuse an output (``flag`` names it) that would replace a run's own file, or anything inside a checkpoint,
    or that is a link or another user's; returns the path. Nothing is written here."""
    path = Path(path)
    folder = path.parent.resolve()
    inside_checkpoint = any(p.name == "checkpoints" and is_run_dir(p.parent) for p in (folder, *folder.parents))
    if inside_checkpoint or (path.name in (*RUN_FILES, LOCK_NAME) and is_run_dir(folder)):
        raise UserError(f"{flag} {shown(path)} would replace a file of the run in {shown(folder)}; an output never "
                        "replaces a run's own files: pick another path")
    if not folder.is_dir():
        raise UserError(f"{flag} {shown(path)}: the folder {shown(path.parent)} does not exist; create it or pick "
                        "another path")
    check_entry(path)
    return path
