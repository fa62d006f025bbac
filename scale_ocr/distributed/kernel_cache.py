"""oneDNN's kernel cache: room for the kernels of many input shapes.

oneDNN, which runs torch's convolutions and LSTMs on CPU, compiles a kernel for each operator and input shape and
keeps the 1,024 it used last. A recognizer reading crops at their own width (``--max-width``) meets hundreds of
shapes an epoch, each with its dozens of kernels, so that cache cycles and each step compiles its kernels again.
``train.py``, Ray's training function and every ``scale-ocr`` command raise the capacity to :data:`CAPACITY` unless
the user set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (:func:`scale_ocr.distributed.process_env.prepare_process`). oneDNN
reads it once, when it builds its first kernel, so they set it before anything runs. Measured on 4,096 text lines of
32 to 1,024 pixels at their own width, 2 CPU ranks (benchmarks/results/README.md, pixel_batches): 61.7 lines/s
against 49.5 in micro-batches filled to a pixel budget, 40.4 against 33.7 in batches of 8 lines. A run of one input
shape builds the same few kernels either way.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
CAPACITY = 16384


def room_for_shapes(env: MutableMapping[str, str] = os.environ) -> str:
    """Set oneDNN's cache capacity unless the user did (inherited by the processes a launcher starts); the capacity
    in force. Call before the process's first CPU kernel."""
    return env.setdefault(VARIABLE, str(CAPACITY))
