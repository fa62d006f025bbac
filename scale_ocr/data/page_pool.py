"""Pages read in parallel for ``scale-ocr make-dataset``: spawned workers that a Ctrl-C, a SIGTERM or an error in
the parent ends at once, with no worker traceback and no worker left behind."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from multiprocessing import get_context

from scale_ocr.errors import EXIT_FAULT, RunStopped


def _quiet_worker() -> None:
    """A worker ignores Ctrl-C (sent to the whole process group): the parent reports it once and stops workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop(pool: ProcessPoolExecutor) -> None:
    """End the workers now: pages queued are cancelled and a page being read is not waited for."""
    workers = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.join(10)
    pool.shutdown(wait=True)


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


def parallel_map(fn: Callable, items: Sequence, jobs: int) -> Iterator:
    """``fn`` over ``items`` in order, in ``jobs`` spawned processes (PDFium is not safe across threads or
    forks of a process that has used it), or inline for one job. Close the iterator to stop: an exception, a
    Ctrl-C or SIGTERM (:func:`scale_ocr.errors.stop_on_sigterm`) in the parent ends every worker at once."""
    if jobs <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    pool = None
    try:
        with _workers_start_deaf():
            pool = ProcessPoolExecutor(max_workers=min(jobs, len(items)), mp_context=get_context("spawn"),
                                       initializer=_quiet_worker)
            results = pool.map(fn, items, chunksize=1)  # starts the workers
        yield from results
    except BrokenProcessPool:
        _stop(pool)
        raise RunStopped("a worker process reading pages died (killed, or out of memory); run again with fewer "
                         "--jobs or a lower --dpi", EXIT_FAULT) from None
    except BaseException:
        if pool is not None:
            _stop(pool)
        raise
    pool.shutdown()
