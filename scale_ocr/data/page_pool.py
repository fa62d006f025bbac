"""Pages read in parallel for ``scale-ocr make-dataset``: spawned workers that a Ctrl-C, a SIGTERM or an error in
the parent ends at once, with no worker traceback, no worker left behind and no thread left to wait for.

Each worker has its own pipe, and the parent reads them in its main thread. ``concurrent.futures``' process pool
reads results in a helper thread instead: a worker stopped while it sends a page leaves that thread waiting for the
rest of the message forever, and the interpreter waits for the thread at exit (a SIGTERM ended the command with its
line printed, and then it hung: 2 of 30 stops)."""

from __future__ import annotations

import signal
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from scale_ocr.errors import EXIT_FAULT, RunStopped

IN_FLIGHT = 2  # items a worker holds: the one it reads and the next, so it never waits for the parent


def _serve(fn: Callable, conn: Connection) -> None:
    """A worker: ``fn`` over the items it is sent until it is sent None. It ignores Ctrl-C (sent to the whole
    process group): the parent reports it once and stops the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while (item := conn.recv()) is not None:
        try:
            reply = (True, fn(item))
        except Exception as exc:  # noqa: BLE001 - the parent raises it, as a call there would
            reply = (False, exc)
        try:
            conn.send(reply)
        except Exception as exc:  # noqa: BLE001 - a reply that does not pickle: the parent raises its text
            conn.send((False, RuntimeError(f"a page worker's reply could not be sent: {type(exc).__name__}: {exc}")))


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection
    held: deque = field(default_factory=deque)  # the indexes of the items it was sent and has not answered


@contextmanager
def _workers_start_deaf() -> Iterator[None]:
    """Around starting workers: they inherit SIGINT ignored (a Ctrl-C during their start-up prints no traceback),
    while the parent holds a Ctrl-C that arrives meanwhile (blocked) and takes it once its handler is back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _start(fn: Callable, count: int) -> list[_Worker]:
    ctx = get_context("spawn")  # PDFium is not safe across forks of a process that has used it
    workers = []
    with _workers_start_deaf():
        for _ in range(count):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(fn, child), daemon=True)
            workers.append(_Worker(process, parent))
            process.start()
            child.close()
    return workers


def _stop(workers: Sequence[_Worker], finished: bool) -> None:
    """End the workers: told to when they ``finished`` their items, else at once (a page being read is not waited
    for); none outlives this call."""
    for worker in workers:
        if finished and worker.process.is_alive():
            try:
                worker.conn.send(None)
            except OSError:
                pass
        elif worker.process.pid is not None:
            worker.process.terminate()
    for worker in workers:
        if worker.process.pid is None:
            continue
        worker.process.join(10)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()


def _died() -> RunStopped:
    return RunStopped("a worker process reading pages died (killed, or out of memory); run again with fewer --jobs "
                      "or a lower --dpi", EXIT_FAULT)


def parallel_map(fn: Callable, items: Sequence, jobs: int) -> Iterator:
    """``fn`` over ``items`` in order, in ``jobs`` spawned processes (``fn`` must pickle: a module's function), or
    inline for one job. An exception ``fn`` raises in a worker is raised here. Close the iterator to stop: an
    exception, a Ctrl-C or SIGTERM (:func:`scale_ocr.errors.stop_on_sigterm`) in the parent ends every worker."""
    if jobs <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    workers: list[_Worker] = []
    finished = False
    try:
        workers = _start(fn, min(jobs, len(items)))
        sent = given = 0
        answers: dict[int, object] = {}
        while given < len(items):
            for worker in workers:  # keep every worker busy
                while len(worker.held) < IN_FLIGHT and sent < len(items):
                    worker.conn.send(items[sent])
                    worker.held.append(sent)
                    sent += 1
            while given in answers:
                yield answers.pop(given)
                given += 1
            if given == len(items):
                break
            busy = [w for w in workers if w.held]
            ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy]))
            for worker in busy:
                if worker.conn in ready:
                    try:
                        ok, value = worker.conn.recv()
                    except (EOFError, OSError):
                        raise _died() from None
                    if not ok:
                        raise value
                    answers[worker.held.popleft()] = value
                elif worker.process.sentinel in ready:
                    raise _died()
        finished = True
    finally:
        _stop(workers, finished)
