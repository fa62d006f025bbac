"""``--gpu-memory-cap-gb``: make a GPU look smaller (``torch.cuda.set_per_process_memory_fraction``) for memory
experiments; a CPU host caps the data segment instead (``ulimit -d``), so the flag refuses CPU devices."""

from __future__ import annotations

import torch

from scale_ocr.errors import UserError

GIB = 2**30


def cap_device_memory(device: torch.device, gb: float | None) -> float | None:
    """Cap this process's allocations on ``device`` at ``gb`` GiB; returns the fraction of the device set."""
    if gb is None:
        return None
    if device.type != "cuda":
        raise UserError(f"--gpu-memory-cap-gb {gb:g} caps GPU memory, and this rank runs on {device.type}; on a CPU "
                        "host cap each process instead (`ulimit -d`, as `python -m benchmarks.max_model` does)")
    total = torch.cuda.get_device_properties(device).total_memory
    if gb * GIB > total:
        raise UserError(f"--gpu-memory-cap-gb {gb:g} is more than this GPU's {total / GIB:.1f} GiB; give at most that")
    fraction = gb * GIB / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction
