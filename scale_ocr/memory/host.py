"""Host memory that tensors free goes back to the operating system at once, when a rank's memory is capped.

glibc's malloc serves large blocks with ``mmap`` and returns them on ``free``, but its threshold for "large" is
dynamic: each freed mmapped block raises it (up to 32 MiB), after which blocks of that size come from the
heap, whose freed space glibc keeps and fragments. Training frees and reallocates same-sized activation,
gradient and gathered-parameter buffers every step, so a process's resident and data size grow for several
steps past what its live tensors need: measured on 2 CPU ranks training a 255M-parameter ViTSTR under FSDP2
(bf16, batch 2), a rank's peak was 4.45 GiB with the dynamic threshold and 2.85 GiB with a fixed 1 MiB one,
the same tensors either way. A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_``
sets it) keeps the peak at the live tensors, which is what the memory model and a per-rank budget count.

It costs speed, though: every large buffer is then a fresh mapping whose pages the kernel faults in and zeroes
at each step (work no Python profile shows). Measured on 2 cores (while other jobs ran, alternating), the
hand-written loop of benchmarks.overhead trained crnn_mobilenet_v3_small at 27.8, 27.7 and 32.3 samples/s with
it and at 30.2, 44.2 and 38.5 without (one thread, batch 16). So it is applied only where memory decides whether a run
fits
at all: when the process runs under a memory limit (``RLIMIT_DATA``/``RLIMIT_AS``, which is how the benchmarks
give a CPU rank a device-sized budget); everywhere else glibc's default stands, unless the user sets
``MALLOC_MMAP_THRESHOLD_`` (glibc reads it itself, and it always wins).
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
