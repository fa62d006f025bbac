"""Write a whole-model file from pieces under a data-segment cap that the whole model does not fit in.

    capped_save.py OUT PIECES PIECE_MIB HEADROOM_MIB

The process caps its data segment (``ulimit -d``, RLIMIT_DATA: what the benchmarks give a CPU rank) at what it holds
after its imports plus ``HEADROOM_MIB``, then:

1. holds the whole model (``PIECES`` fp32 tensors of ``PIECE_MIB`` each, piece ``i`` filled with ``i``), as writing
   it with one ``torch.save`` would: it must run out of memory;
2. writes the same model to ``OUT`` as ``last_model.pt`` is written, each piece made only when the writer asks for it
   (as a sharded engine gathers it) and dropped after;
3. reads it back a tensor at a time, as ``scale-ocr export`` reads a run's ``.pt``, checking each piece's values.

Prints one JSON line: whether the whole model fitted, the cap, and the data segment's high-water marks over steps 2
and 3.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from scale_ocr.checkpoint.model_files import write_whole_model
from scale_ocr.checkpoint.piecewise import TorchFileReader
from scale_ocr.checkpoint.safe_dcp import load_tensors
from scale_ocr.memory.host import return_freed_memory
from scale_ocr.strategies.base import ModelPiece

MIB = 2**20


def data_bytes() -> int:
    """This process's data segment now (VmData), what RLIMIT_DATA caps."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def main() -> None:
    out, pieces, piece_mib, headroom_mib = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rows = piece_mib * MIB // 4 // 1024
    cap = data_bytes() + headroom_mib * MIB
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    return_freed_memory()  # as train.py does under a cap: freed tensors go back at once
    try:
        whole = [torch.full((rows, 1024), float(i)) for i in range(pieces)]
        fitted = True
        del whole
    except (RuntimeError, MemoryError):
        fitted = False
    high = 0

    def fetch(i: int) -> torch.Tensor:
        nonlocal high
        tensor = torch.full((rows, 1024), float(i))
        high = max(high, data_bytes())
        return tensor

    model = [ModelPiece(f"blocks.{i}.weight", (rows, 1024), torch.float32, lambda i=i: fetch(i)) for i in range(pieces)]
    start = data_bytes()
    write_whole_model(model, [out], True, kept="nothing")
    written, high = high, 0
    reader = TorchFileReader(out, load_tensors(out, meta=True))
    for i in range(pieces):
        assert bool((reader.read(f"blocks.{i}.weight") == i).all())
        high = max(high, data_bytes())
    print(json.dumps({"whole_fitted": fitted, "cap": cap, "start": start, "high": written, "read_high": high,
                      "piece": rows * 1024 * 4}))


if __name__ == "__main__":
    main()
