"""No silent hangs: heartbeats between ranks, a named culprit, and a line a minute on long waits.

Every rank's daemon thread bumps a counter in the rendezvous store every few seconds and watches the others'. When
this rank has made no progress for ``--dist-timeout`` seconds and a peer's counter has not moved for as long, it
prints one line naming that rank and exits :data:`EXIT_PEER_LOST` (counters, not clocks: hosts need no common
time). Rank 0 also prints an ``alive`` line whenever a minute passes without a log line.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time

from scale_ocr.errors import EXIT_PEER_LOST, say

ALIVE_EVERY = 60.0  # seconds between "alive" lines while nothing else is printed


def _connect_store(timeout: float):
    """A client of the job's rendezvous store (torchrun's agent, or rank 0's process), None without one."""
    import torch.distributed as tdist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return tdist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout),
                              wait_for_workers=False)
    except Exception:  # noqa: BLE001 - without a store the job still runs; the backend's timeout remains
        return None


class Watchdog:
    """Heartbeat thread of one rank.

    Args:
        rank: this process's global rank.
        world_size: ranks in the job.
        timeout: seconds of silence (``--dist-timeout``) before a peer counts as stopped.
        is_main: rank 0 prints the ``alive`` lines.
        round_id: :attr:`~scale_ocr.distributed.process_group.DistInfo.round_id`, the same on every rank of this round.
    """

    def __init__(self, rank: int, world_size: int, timeout: float, is_main: bool, round_id: str = "") -> None:
        self.rank, self.world, self.timeout, self.is_main = rank, world_size, timeout, is_main
        self.interval = max(0.5, min(5.0, timeout / 20))
        # A peer's last beat is seen up to two intervals late; judging at timeout - 2 intervals keeps the
        # whole detection within --dist-timeout of the moment the peer went silent.
        self.threshold = max(self.interval, timeout - 2 * self.interval)
        now = time.monotonic()
        self.last_progress = self.last_line = now
        self.step, self.total = 0, 0
        self.store = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last changed)
        self._store_ok = now
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Keys are unique per launch round: an elastic restart must not read the dead round's counters.
        self.prefix = f"scale_ocr/heartbeat/{round_id or os.environ.get('MASTER_PORT', '')}"

    def start(self) -> Watchdog:
        if self.world > 1:
            self.store = _connect_store(timeout=max(2.0, 2 * self.interval))
        if self.store is not None:
            try:  # where this rank runs, so a peer on the same host can end it if it stops responding
                self.store.set(f"{self.prefix}/where/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
            except Exception:  # noqa: BLE001 - only an optimisation of the clean-up
                pass
        self._thread = threading.Thread(target=self._run, name="scale-ocr-watchdog", daemon=True)
        self._thread.start()
        return self

    def progress(self, step: int, total: int) -> None:
        """The loop finished an optimizer step."""
        self.last_progress = time.monotonic()
        self.step, self.total = step, total

    def printed(self) -> None:
        """The loop printed a line itself; no ``alive`` line is needed for a while."""
        self.last_line = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            stale = self._beat(now)
            stuck = now - self.last_progress
            if stale and stuck >= self.threshold:
                self._fail(stale, stuck)
            if self.is_main and now - self.last_line >= ALIVE_EVERY:
                self.last_line = now
                where = f"step {self.step}/{self.total}" if self.total else "starting"
                say(f"scale-ocr: alive: {where}, {stuck:.0f} s since the last completed step; "
                      f"{self.world - len(stale)} of {self.world} ranks responding", err=True)

    def _beat(self, now: float) -> list[int]:
        """Bump our counter, read the others'; returns the ranks silent for ``timeout`` (-1: the store)."""
        if self.store is None:
            return []
        try:
            self.store.add(f"{self.prefix}/{self.rank}", 1)
            for r in range(self.world):
                if r == self.rank:
                    continue
                value = self.store.add(f"{self.prefix}/{r}", 0)
                seen = self._seen.get(r)
                if seen is None or seen[0] != value:
                    self._seen[r] = (value, now)
            self._store_ok = now
        except Exception:  # noqa: BLE001 - the store's host itself may be the stopped process
            if now - self._store_ok >= self.threshold:
                return [-1]
            return []
        return sorted(r for r, (_, t) in self._seen.items() if now - t >= self.threshold)

    def _end_local(self, stale: list[int]) -> None:
        """SIGKILL silent peers on this host: a stopped process ignores the launcher's SIGTERM, which would
        leave the job waiting (torchrun waits 30 s) for a rank that can no longer take part."""
        for r in stale:
            key = f"{self.prefix}/where/{r}"
            try:
                if r < 0 or not self.store.check([key]):  # get() would wait for a missing key
                    continue
                host, pid = self.store.get(key).decode().split()
                if host == socket.gethostname() and int(pid) != os.getpid():
                    os.kill(int(pid), signal.SIGKILL)
            except Exception:  # noqa: BLE001 - no record, another host, or already gone
                pass

    def _fail(self, stale: list[int], stuck: float) -> None:
        host = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        who = ", ".join(f"rank {r}" if r >= 0 else f"the rendezvous store at {host} (rank 0's process unless "
                        "torchrun hosts it)" for r in stale)
        # Every surviving rank sees the same silence; the lowest of them says so, once for the job.
        self._end_local(stale)
        survivors = [r for r in range(self.world) if r not in stale and not (r == 0 and -1 in stale)]
        if survivors and self.rank != min(survivors):
            os._exit(EXIT_PEER_LOST)
        say(f"scale-ocr: error: {who} stopped responding: no heartbeat for over {self.timeout:.0f} s "
              f"(--dist-timeout) while rank {self.rank} waited {stuck:.0f} s at step {self.step}; ending the job. "
              "The process was stopped, hung or killed: check that host; with --save-every or the default "
              "timed checkpoints, `--resume auto` continues from the last one", err=True)
        os._exit(EXIT_PEER_LOST)
