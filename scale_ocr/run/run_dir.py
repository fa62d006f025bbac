"""The run directory: where a run writes its config, metrics, checkpoints and models (``--output-dir``)."""

from __future__ import annotations

import os
from pathlib import Path

from scale_ocr.checkpoint.pointer import POINTER
from scale_ocr.disk import LOCK_NAME, RUN_FILES, RUN_MARKERS, check_entry, clear_pending, disk_fault, open_own
from scale_ocr.errors import UserError, say
from scale_ocr.run.shared_dir import TOKEN_PREFIX, check_shared


def check_output_dir(path: str | os.PathLike[str]) -> None:
    """Refuse an output directory that cannot be created or written, before any work starts.

    Nothing is created here: the path is only checked, so every rank may call this. A directory that
    does not exist yet is judged by its nearest existing parent, which is where it will be created. A path
    with a file among its parents, or a directory that is not writable, is a UserError.
    """
    target = Path(path).absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"--output-dir {path}: {existing} is a file, not a directory; "
                        "pick another --output-dir or move that file away")
    # X as well as W: creating or writing an entry needs both on the directory that holds it.
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {path}: {existing} is not writable by this user; "
                        "pick a writable --output-dir or fix the directory's permissions")




def check_run_entries(run_dir: Path) -> None:
    """Refuse a run directory holding a link or another user's file where this run writes (rank 0, holding the lock).

    Checked before the directory is tidied, resumed or moved aside, so nothing in it is touched first.
    """
    for name in RUN_FILES:
        check_entry(run_dir / name, directory=name in ("checkpoints", "wandb"))
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir():
        for entry in sorted(ckpts.iterdir()):
            if entry.name == POINTER or entry.name.startswith("step_"):
                check_entry(entry, directory=entry.name != POINTER)


class RunLock:
    """An exclusive lock on a run directory, held by global rank 0 for the whole job.

    ``flock`` on ``DIR/.scale-ocr.lock``: the kernel drops it when the holder exits or dies (even from
    ``kill -9``), so a stale lock needs no clean-up; the file's content only names the holder for the
    message a second job prints. (On network filesystems without ``flock`` support, the lock is
    advisory at best; one job per directory remains the user's contract there.)
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; returns None on success, else a description of the holder."""
        import fcntl
        import json
        import socket
        import sys
        import time

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_own(self.path, os.O_RDWR | os.O_CREAT)  # never through a link, never another user's file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8"))
                return (f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: "
                        f"{' '.join(holder['argv'])[:120]}")
            except (OSError, ValueError, KeyError, TypeError):
                return "another process"
            finally:
                os.close(fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv,
                "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, (json.dumps(info) + "\n").encode())
        except OSError as exc:
            self.release()
            fault = disk_fault(exc, self.path, "the run's lock file", "nothing was written to the run directory")
            if fault is None:
                raise
            raise fault from None
        return None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def previous_run(run_dir: Path) -> list[str]:
    """Entries of ``run_dir`` besides the lock (and a killed job's shared-directory token): what an earlier job
    left there."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_NAME and not p.name.startswith(TOKEN_PREFIX))


def move_aside(run_dir: Path) -> Path:
    """Move an earlier run's files out of ``run_dir`` into a sibling ``NAME.old-TIMESTAMP`` folder.

    Only a directory that holds a scale-ocr run is moved; anything else in a non-empty directory is the
    user's and is refused rather than touched.
    """
    import time

    entries = previous_run(run_dir)
    if not any(e in RUN_MARKERS for e in entries):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise UserError(f"--output-dir {run_dir} is not empty and holds no scale-ocr run ({shown}); "
                        "pick a new or empty directory")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    dest.mkdir()
    for name in entries:
        (run_dir / name).replace(dest / name)
    return dest


def claim(run_dir: Path, checkpoints, dist) -> tuple[RunLock, Path | None]:
    """Lock the run directory, tidy it, and find the checkpoint to resume (a collective).

    Rank 0 takes the lock, removes half-written ``step_N.tmp`` folders, and, when this job does not
    continue the run the directory holds, moves that run aside. Every rank then learns whether that
    worked and resolves ``--resume`` from the tidied directory. Returns the held lock (release it at the end) and
    the checkpoint to resume, or None for a fresh start.
    """
    from scale_ocr.distributed.process_group import all_reduce_sum

    clear_pending()  # a disk fault held by an earlier run in this process is not this run's
    lock, problem = RunLock(run_dir), None
    if dist.is_main:
        try:
            holder = lock.acquire()
            if holder is not None:
                raise UserError(f"--output-dir {run_dir} is in use by another scale-ocr job ({holder}); wait for it "
                                "to end, or pick another --output-dir")
            check_run_entries(run_dir)
            for name in checkpoints.clean_partial():
                say(f"scale-ocr: removed {checkpoints.dir / name}, left by an interrupted save")
            source = checkpoints.resolve()
            ours = source is not None and source.resolve().is_relative_to(run_dir.resolve())
            if not ours and previous_run(run_dir):
                dest = move_aside(run_dir)
                say(f"scale-ocr: {run_dir} held an earlier run that this job does not continue; moved it to "
                      f"{dest}")
        except UserError as exc:
            problem = exc
    (failed,) = all_reduce_sum([float(problem is not None)], dist.device)
    if problem is not None:
        lock.release()
        raise problem
    if failed:
        raise UserError("rank 0 could not claim the run directory (its message says why)")
    try:
        check_shared(run_dir, dist)  # before any other rank reads the directory (--resume) or writes in it
    except BaseException:
        lock.release()
        raise
    return lock, checkpoints.resolve()
