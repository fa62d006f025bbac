"""What every scale_ocr process sets in its environment before it runs a kernel or launches a job.

``train.py``, the ``scale-ocr`` dispatcher and Ray's training function call :func:`prepare_process` first: the
processes they launch inherit the variables, and a user's own value of each is kept.
"""

from __future__ import annotations

from scale_ocr.distributed.extensions import use_environment_extensions
from scale_ocr.distributed.kernel_cache import room_for_shapes


def prepare_process() -> None:
    """DeepSpeed's ops where ``make install`` built them (no job waits on a compiler), and room in oneDNN's kernel
    cache for many input shapes (read at the first CPU kernel, so this comes before it)."""
    use_environment_extensions()
    room_for_shapes()
