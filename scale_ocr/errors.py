"""Errors a user can cause, reported as one line and exit code 2 instead of a traceback."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

EXIT_FAULT = 1  # the job failed for a reason that is not the user's mistake
EXIT_USER_ERROR = 2
EXIT_OUT_OF_MEMORY = 3  # distinct, so the benchmark runner can record an OOM as a result

F = TypeVar("F", bound=Callable[..., int])


EXIT_PEER_LOST = 69  # EX_UNAVAILABLE: another rank died or stopped responding (see scale_ocr.run.watchdog)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention for Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for a tool whose reader closed the pipe


class UserError(Exception):
    """A problem with the user's input (a path, a label, a flag, a config) and how to fix it.

    The message is printed as a single line prefixed with ``scale-ocr: error:``; keep it to one
    sentence that names the offending file or value and the fix.
    """

    exit_code = EXIT_USER_ERROR
    prefix = "error"
    by_this_rank = False  # printed by the rank that raised it, not by rank 0 alone (see found_by_every_rank)


# How long a rank other than 0 waits, after a mistake found before the ranks meet, for the launcher to end it.
RANK_ZERO_GRACE_S = 15.0


@contextlib.contextmanager
def found_by_every_rank(launcher_ends_the_rest: bool, rank_zero_waiting: Callable[[float], bool] | None = None,
                        grace_s: float | None = None) -> Iterator[None]:
    """Around the checks each rank makes on its own before the ranks meet (the flags, the launch, the device).

    Every rank finds the same mistake and only rank 0 prints it, but the ranks do not wait for each other. Where
    the launcher ends the other ranks as soon as one exits (``launcher_ends_the_rest``: torchrun, deepspeed,
    mpirun), it may end rank 0 before it printed, and the job would end with no line. So there a rank other than 0
    waits ``grace_s`` (default :data:`RANK_ZERO_GRACE_S`) before it exits: rank 0 prints, exits, and the launcher
    ends this rank meanwhile. A rank still here after the wait (a mistake only it made) prints its own line, naming
    itself. Where the launcher leaves every rank to exit by itself (srun), such a rank asks ``rank_zero_waiting``
    (given the grace) whether rank 0 is at the rendezvous, so passed the checks: then the mistake is its own and
    it prints it; otherwise rank 0 printed the same line and this rank exits without one.
    """
    try:
        yield
    except UserError as exc:
        rank = os.environ.get("RANK", "0")
        grace = RANK_ZERO_GRACE_S if grace_s is None else grace_s
        if rank == "0":
            raise
        if launcher_ends_the_rest:
            time.sleep(grace)  # the launcher ends this rank meanwhile if rank 0 failed too
            mine = True
        else:
            mine = rank_zero_waiting is not None and rank_zero_waiting(grace)
        if mine:
            exc.args = (f"rank {rank}: {str(exc).strip()}",)
            exc.by_this_rank = True
        raise


class RunStopped(UserError):
    """The run ended before its last step on purpose (diverged, preempted): one line, its own exit code.

    Args:
        message: what happened, what was kept and how to continue.
        exit_code: the documented code for this kind of stop.
        prefix: ``error`` for a failure, ``stopped`` for a requested stop such as preemption.
    """

    def __init__(self, message: str, exit_code: int, prefix: str = "error") -> None:
        super().__init__(message)
        self.exit_code, self.prefix = exit_code, prefix


def is_peer_lost(exc: BaseException) -> bool:
    """A collective failed because another rank died or went silent (gloo/NCCL wording)."""
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                   "Timed out waiting", "NCCL communicator was aborted", "DistNetworkError",
                                   "wait timeout after",  # the store: peers never arrived
                                   "waiting for clients"))  # rank 0's store: a rank never came (srun: it exited)


SHOWN_LIMIT = 80  # characters of a user's string (a label, a name) quoted in a message
PATH_LIMIT = 400  # characters of a path (an os.PathLike) in a message: its file name is at its end
LINE_LIMIT = 2000  # characters of one printed error line; beyond, it is cut and its length stated


def printable(text: str, limit: int | None = None) -> str:
    """``text`` safe for a terminal, a log or W&B: what Python does not call printable is escaped as ``repr``
    escapes it (newline, CR, ESC and other C0/C1 codes, bidi overrides, line separators), printable unicode stays.

    A text longer than ``limit`` characters is cut, ending in ``…`` and its full length in characters.
    """
    cut = text if limit is None or len(text) <= limit else text[:limit] + "…"
    safe = cut if cut.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return safe if cut is text else f"{safe} ({len(text)} characters)"


def shown(value: object, limit: int | None = None) -> str:
    """A user-supplied value as a message shows it: a string quoted as ``repr`` quotes it, anything else (a path,
    a number) as ``str`` writes it; control characters escaped and cut to ``limit`` characters (by default
    SHOWN_LIMIT, PATH_LIMIT for a path), e.g. ``'abc…' (1000000 characters)``. Use it for every file name, label and
    config value put in a message."""
    if limit is None:
        limit = PATH_LIMIT if isinstance(value, os.PathLike) else SHOWN_LIMIT
    if not isinstance(value, str):
        return printable(str(value), limit)
    cut = value if len(value) <= limit else value[:limit] + "…"
    return repr(cut) if cut is value else f"{cut!r} ({len(value)} characters)"


# What json.loads raises on a user's text: JSONDecodeError and UnicodeDecodeError are ValueErrors, as is a number
# past Python's 4,300-digit limit for int(); nesting past the interpreter's recursion limit is a RecursionError.
JSON_ERRORS = (ValueError, RecursionError)


def json_problem(exc: BaseException) -> str:
    """Why reading a user's file as JSON failed (one of :data:`JSON_ERRORS`), in words for a one-line message."""
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    if isinstance(exc, UnicodeDecodeError):
        return f"it is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start})"
    if isinstance(exc, RecursionError):
        return "it nests arrays or objects deeper than a JSON reader follows"
    if "digits" in str(exc):
        return "it holds a number of more than 4300 digits"
    return printable(first_line(exc), SHOWN_LIMIT)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for a one-line report."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _one_line(exc: BaseException) -> str:
    # A UserError raised inside a DataLoader worker is re-raised in the parent with the worker's
    # traceback folded into the message; its last non-empty line is our own sentence.
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[-1] if lines else type(exc).__name__
    prefix = f"{UserError.__name__}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, or the CPU allocator failing (a memory limit, or the host running out); also inside
    a checkpoint writer's per-rank failures (DCP's CheckpointException)."""
    text = str(exc)
    failures = getattr(exc, "failures", None)
    inner = [v[0] if isinstance(v, tuple) else v for v in failures.values()] if isinstance(failures, dict) else []
    return (type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError)
            or "DefaultCPUAllocator: can't allocate memory" in text or "CUDA out of memory" in text
            or any(isinstance(e, BaseException) and is_out_of_memory(e) for e in inner))


def _allocator_words(exc: BaseException) -> str:
    """What an out-of-memory error says of the allocation (``you tried to allocate N bytes``), without the C++
    source location torch puts first; else its first line, cut."""
    found = re.search(r"(DefaultCPUAllocator: can't allocate memory: you tried to allocate \d+ bytes|"
                      r"CUDA out of memory\. Tried to allocate [\d.]+ \w+)", str(exc))
    return found.group(1) if found else first_line(exc)[:160]


@contextlib.contextmanager
def memory_for(save: str, then: str) -> Iterator[None]:
    """Around a save: running out of memory in it ends this rank with one line that names the save and its bytes
    (``save``) and says what is kept and what to do (``then``), exit :data:`EXIT_OUT_OF_MEMORY`, instead of the
    training's advice about the batch size, which cannot help a write that comes after training."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit, UserError)) or not is_out_of_memory(exc):
            raise
        rank = os.environ.get("RANK", "0")
        ranks, first = [rank], _allocator_words(exc)
        failures = getattr(exc, "failures", None)  # DCP: every rank raises, holding each failed rank's exception
        if isinstance(failures, dict):
            failed = {r: v[0] if isinstance(v, tuple) else v for r, v in failures.items()}
            ranks = [str(r) for r, e in sorted(failed.items()) if isinstance(e, BaseException) and is_out_of_memory(e)]
            first = next((_allocator_words(failed[int(r)]) for r in ranks), first)
        stop = RunStopped(f"out of memory on rank {', '.join(ranks)} while writing {save} ({first}); {then}",
                          EXIT_OUT_OF_MEMORY)
        stop.by_this_rank = rank in ranks  # printed by the rank that ran out, whichever it is
        raise stop from None


def is_compile_failure(exc: BaseException) -> bool:
    """torch.compile failed: dynamo could not trace the model, or its backend (inductor's C++/Triton build) failed."""
    return type(exc).__module__.startswith(("torch._dynamo", "torch._inductor"))


def report_peer_lost(exc: BaseException) -> None:
    """One line for a collective that failed because a peer is gone. Every survivor sees it and names
    itself, as none can know who saw it first."""
    first = str(exc).strip().splitlines()[0][:160]
    then = ("torchrun restarts the job if it has restarts left (--max-restarts), and it resumes from the last "
            "checkpoint" if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
            else "the job ends: check the other ranks' output; `--resume auto` continues from the last checkpoint")
    say(f"scale-ocr: error: rank {os.environ.get('RANK', '0')} lost contact with another rank ({first}); {then}",
        err=True)


def terminal_safe(text: str) -> str:
    """``text`` with every line :func:`printable` and its tab-separated columns kept: what a command prints."""
    return "\n".join("\t".join(printable(cell) for cell in line.split("\t")) for line in text.split("\n"))


def require_installed(needed: tuple[str, ...] = ("torch", "torchvision")) -> None:
    """Exit with one line when this Python cannot import what scale-ocr is built on (a command run by the system's
    Python, where torch is in the project's .venv): called by the entry points before their first import of torch,
    so the user reads which Python and what to run, not an import traceback."""
    import importlib.util

    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        say(f"scale-ocr: error: {sys.executable} cannot import {' or '.join(missing)}: run scale-ocr with the Python "
            "it is installed in (.venv/bin/python after `make install`, or activate .venv), or install it into this "
            "one (pip install -e .)", err=True)
        raise SystemExit(EXIT_USER_ERROR)


def say(*parts: object, err: bool = False, every_rank: bool = True, end: str = "\n") -> None:
    """The one way the package writes to the terminal: ``parts`` joined by spaces, each line escaped
    (:func:`terminal_safe`), so no file name, label or config value a command prints can move the cursor, set the
    title, ring the bell or forge a ``scale-ocr:`` line. On stderr with ``err``; from rank 0 alone (or the rank
    unknown) unless ``every_rank``, so what every rank hits is said once per job."""
    if every_rank or os.environ.get("RANK", "0") == "0":
        stream = sys.stderr if err else sys.stdout
        try:
            stream.write(terminal_safe(" ".join(map(str, parts))) + end)
            stream.flush()
        except BrokenPipeError:  # the reader went away (`scale-ocr summary RUN | head -3`): stop quietly, as
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())  # Unix tools do (not a "lost rank")
            raise SystemExit(EXIT_BROKEN_PIPE) from None


def _say(line: str, every_rank: bool = False) -> None:
    say(line, err=True, every_rank=every_rank)


EXIT_TERMINATED = 143  # 128 + SIGTERM, for a command that is not a training (training's SIGTERM checkpoints: 75)
_INTERRUPTED: dict[str, str | Callable[[], str]] = {"hint": ""}  # what a Ctrl-C leaves (see :func:`on_interrupt`)


def on_interrupt(hint: str | Callable[[], str]) -> None:
    """What the one line after Ctrl-C (or a command's SIGTERM) adds: what is kept and how to continue. A command
    sets it as it starts (training: its checkpoints); none set, the line says only that it was interrupted. A
    callable is asked when the interrupt is reported, for a command whose answer depends on how far it got."""
    _INTERRUPTED["hint"] = hint


class Terminated(KeyboardInterrupt):
    """SIGTERM in a command that has nothing to checkpoint (make-dataset, make-shards): raised in the main thread
    like Ctrl-C, so its clean-up runs (``finally`` blocks remove partial output, workers are stopped)."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """Inside, SIGTERM raises :class:`Terminated`; the reporter ends the command with one line, exit 143."""
    import signal

    def _raise(signum, frame):
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread: the default stays
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupt_inside(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C (or :class:`Terminated`) that ``exc`` is or wraps: DCP's CheckpointException holds each rank's
    exception in ``failures``, so a Ctrl-C during a checkpoint save arrives as that, not as KeyboardInterrupt."""
    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, KeyboardInterrupt):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        stack += [e.__cause__, e.__context__]
    return None


def _interrupted(exc: KeyboardInterrupt) -> int:
    hint = _INTERRUPTED["hint"]
    hint = hint() if callable(hint) else hint
    if isinstance(exc, Terminated):
        _say(f"scale-ocr: stopped: SIGTERM received{'; ' + hint if hint else ''}")
        return EXIT_TERMINATED
    _say(f"scale-ocr: interrupted (Ctrl-C){'; ' + hint if hint else ''}")
    return EXIT_INTERRUPTED


def report_user_errors(main: F) -> F:
    """Decorate a CLI entry point so a :class:`UserError` prints one line and exits with code 2.

    Every rank prints to stderr only when it is rank 0 (or when the rank is unknown), so a
    2-process job shows the sentence once instead of once per rank.
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as exc:  # the whole message on one line, whatever a call site put in it
            _say(f"scale-ocr: {exc.prefix}: {printable(str(exc).strip(), LINE_LIMIT)}", exc.by_this_rank)
            return exc.exit_code
        except KeyboardInterrupt as exc:
            return _interrupted(exc)
        except Exception as exc:  # noqa: BLE001 - DataLoader workers wrap our errors in their own type
            if UserError.__name__ + ":" in str(exc):
                _say(f"scale-ocr: error: {printable(_one_line(exc), LINE_LIMIT)}")
                return EXIT_USER_ERROR
            if is_peer_lost(exc):
                report_peer_lost(exc)
                return EXIT_PEER_LOST
            if is_compile_failure(exc):
                _say(f"scale-ocr: error: torch.compile failed ({type(exc).__name__}: {first_line(exc)[:200]}); run "
                     "without --compile, or with --compile aot_eager to tell tracing from code generation")
                return EXIT_FAULT
            if is_out_of_memory(exc):
                first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
                _say(f"scale-ocr: error: out of memory on rank {os.environ.get('RANK', '0')} ({first}); lower "
                     "--batch-size or pick a strategy that shards more (see `scale-ocr estimate-memory`)",
                     every_rank=True)  # printed by the rank that ran out, whichever it is
                return EXIT_OUT_OF_MEMORY
            if interrupt_inside(exc) is not None:
                return _interrupted(interrupt_inside(exc))
            raise
        except BaseException as exc:  # not an Exception: DCP's CheckpointException wraps a Ctrl-C in a save
            if interrupt_inside(exc) is None or isinstance(exc, (SystemExit, GeneratorExit)):
                raise
            return _interrupted(interrupt_inside(exc))

    return wrapper  # type: ignore[return-value]


NAME_MAX, PATH_MAX = 255, 4096  # bytes: the longest file name and path Linux file systems take (ext4, XFS, Btrfs)


def path_problem(path: str) -> str | None:
    """Why no file system can name ``path`` (os calls would raise ValueError or ENAMETOOLONG on it), or None."""
    if "\x00" in path:
        return "holds a NUL character, which no file name can"
    try:
        raw = path.encode("utf-8")
    except UnicodeEncodeError:
        return "holds a lone surrogate (a \\ud800-style escape), which no file name can"
    longest = max(len(part) for part in raw.split(b"/"))
    if longest > NAME_MAX:
        return f"has a name of {longest} bytes, longer than the {NAME_MAX} a file system allows"
    if len(raw) >= PATH_MAX:
        return f"is {len(raw)} bytes long, longer than the {PATH_MAX - 1} a path may be"
    return None
