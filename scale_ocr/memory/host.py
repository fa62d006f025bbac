"""Host memory that tensors free goes back to the operating system at once, when a rank's memory is capped.

glibc's dynamic mmap threshold (raised by each freed mmapped block, up to 32 MiB) leaves the buffers training frees
and reallocates every step in a fragmented heap, so a rank's peak grows past its live tensors; a fixed threshold
(``mallopt(M_MMAP_THRESHOLD)``) keeps it at them. It costs speed (every large buffer is faulted in and zeroed at
each step), so it applies only under a memory limit (``RLIMIT_DATA``/``RLIMIT_AS``). docs/memory.md, "Capped CPU
ranks and glibc".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
THRESHOLD = 1 << 20  # blocks of 1 MiB and more are mmapped and unmapped on free


def memory_capped() -> bool:
    """This process runs under a finite data-segment or address-space limit."""
    return any(resource.getrlimit(r)[0] != resource.RLIM_INFINITY for r in (resource.RLIMIT_DATA, resource.RLIMIT_AS))


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at 1 MiB for this process when its memory is capped, unless the user set
    ``MALLOC_MMAP_THRESHOLD_``; True if it was set here. A no-op (False) on other C libraries."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not memory_capped():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD))
