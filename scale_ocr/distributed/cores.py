"""The cores a job may use (CPU affinity, capped by the cgroup quota), and one line when its ranks' threads exceed
them: torch's intra-op threads meet at a barrier after each operator, so oversubscribed threads wait for descheduled
siblings at every operator. The user's thread count is honoured; its cost is said at start.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from scale_ocr.errors import say

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Cores:
    """Cores usable by this process: its affinity, and the cgroup's CPU quota in cores (the tightest along its path,
    None when unlimited)."""

    affinity: int
    quota: float | None

    @property
    def usable(self) -> int:
        """Whole cores the job can keep busy: the affinity, capped by the quota (rounded up: 1.5 cores run 2 threads
        at three-quarter speed rather than at a barrier's mercy)."""
        return max(1, min(self.affinity, math.ceil(self.quota))) if self.quota is not None else self.affinity


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _v2_quota(path: Path) -> float | None:
    """``cpu.max`` ("max 100000" or "200000 100000") of ``path`` in cores."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(path: Path) -> float | None:
    try:
        quota = int((path / "cpu.cfs_quota_us").read_text())
        period = int((path / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_quota(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota, in cores, on this process's cgroup and its ancestors (a parent's cap binds its
    children); None when no level caps it or there is no cgroup file system."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # cgroup v2's unified hierarchy
            base, read = root, lambda p: _v2_quota(p / "cpu.max")
        elif "cpu" in controllers.split(","):
            base = next((root / name for name in (controllers, "cpu,cpuacct", "cpu") if (root / name).is_dir()), None)
            read = _v1_quota
        else:
            continue
        if base is None:
            continue
        path = base / rel.lstrip("/")
        for level in (path, *path.parents):
            if base not in (level, *level.parents):
                break
            quota = read(level)
            if quota is not None:
                quotas.append(quota)
    return min(quotas) if quotas else None


def usable_cores() -> Cores:
    """This process's affinity and cgroup quota."""
    return Cores(_affinity(), cgroup_quota())


def oversubscription(threads: int, source: str, local_ranks: int, cores: Cores) -> str | None:
    """The start-up line when ``local_ranks`` x ``threads`` exceed ``cores.usable``; None when they fit.

    ``source`` says where the thread count came from (``--threads``, ``OMP_NUM_THREADS`` or the default), so the
    fix names the setting the user actually made.
    """
    total = threads * local_ranks
    if total <= cores.usable:
        return None
    fits = cores.usable // local_ranks
    quota = "none" if cores.quota is None else f"{cores.quota:g} cores"
    given = {"--threads": f"--threads {threads}", "OMP_NUM_THREADS": f"OMP_NUM_THREADS={threads}"}.get(
        source, f"{threads} thread{'s' * (threads > 1)} per rank")
    if fits == 0:  # more ranks than cores: no thread count helps
        fix = f"start at most {cores.usable} local ranks here, or give the job more cores"
    elif source == "--threads":
        fix = f"pass --threads {fits}"
    else:
        fix = f"export OMP_NUM_THREADS={fits} or pass --threads {fits}"
    ranks = f"{local_ranks} local rank{'s' * (local_ranks > 1)}"
    return (f"scale-ocr: warning: {given} x {ranks} = {total} threads on {cores.usable} usable "
            f"core{'s' * (cores.usable > 1)} (affinity {cores.affinity}, cgroup quota {quota}): threads wait for "
            "each other at every operator, and steps can run many times slower (20x measured at 2 x 2 on 2 cores); "
            f"{fix}")


def warn_if_oversubscribed(threads: int, source: str, local_ranks: int) -> None:
    """Print :func:`oversubscription`'s line, if any, on stderr (call on rank 0)."""
    line = oversubscription(threads, source, local_ranks, usable_cores())
    if line:
        say(line, err=True)
