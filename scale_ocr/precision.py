"""Mixed precision as autocast over fp32 weights, the same for every strategy."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_factory(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A zero-argument callable returning the autocast context for ``precision`` on ``device``.

    Convolutions, matmuls and the LSTM run in the low precision; autocast keeps reductions and
    BatchNorm statistics in fp32, and the CTC loss turns autocast off itself.
    """
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = _DTYPES[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)
