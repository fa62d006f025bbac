"""NVMe offload (ZeRO-Infinity): DeepSpeed's swap files under ``NVME_PATH/zero_stage_3/*/rankR``; the ``async_io``
op (libaio) is checked before the engine needs it, and a crashed run's swap files are never read back or counted."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from scale_ocr.errors import UserError, first_line

INSTALL_HINT = ("install libaio's headers (`apt-get install libaio-dev`, `dnf install libaio-devel`), or run "
                "`make install` as root, which does; or offload to host memory instead (--strategy zero3_offload)")


def nvme_sections(ds_config: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``offload_param`` / ``offload_optimizer`` sections of a DeepSpeed config that offload to NVMe."""
    zero = ds_config.get("zero_optimization", {})
    sections = (zero.get("offload_param"), zero.get("offload_optimizer"))
    return [s for s in sections if isinstance(s, dict) and s.get("device") == "nvme"]


def swap_folders(paths: list[Path], rank: int) -> list[Path]:
    """This rank's swap folders under each NVMe path (DeepSpeed's layout; ``rank`` is the global rank)."""
    return [folder for root in paths for folder in (root / "zero_stage_3").glob(f"*/rank{rank}")]


def check_async_io() -> None:
    """Load DeepSpeed's async_io op (building it the first time), or raise one sentence saying what is missing."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=False):
        raise UserError(f"NVMe offload needs DeepSpeed's async_io op, which needs libaio: {INSTALL_HINT}")
    try:
        builder.load(verbose=False)
    except Exception as exc:  # noqa: BLE001 - a failed JIT build raises anything from RuntimeError to OSError
        first = first_line(exc)
        raise UserError(f"DeepSpeed's async_io op (NVMe offload) did not build: {first}; needs a C++ "
                        f"compiler, ninja and libaio ({INSTALL_HINT})") from None


def prepare_swap(paths: list[Path], rank: int) -> None:
    """Create the NVMe paths and empty this rank's swap folders in them (only DeepSpeed's own files)."""
    for folder in swap_folders(paths, rank):
        shutil.rmtree(folder, ignore_errors=True)
    for root in paths:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create the NVMe offload directory {root}: {exc.strerror}; "
                            "pass a writable one with --nvme-path") from None


def swap_bytes(paths: list[Path], rank: int) -> int:
    """Bytes in this rank's swap files now (the state DeepSpeed moved out of memory)."""
    total = 0
    for folder in swap_folders(paths, rank):
        total += sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return total


def remove_swap(paths: list[Path], rank: int) -> None:
    """Delete this rank's swap folders, then each directory left empty (another rank may still be writing)."""
    for folder in swap_folders(paths, rank):
        shutil.rmtree(folder, ignore_errors=True)
    for root in paths:
        for d in [*sorted((root / "zero_stage_3").glob("*"), reverse=True), root / "zero_stage_3", root]:
            try:
                d.rmdir()
            except OSError:
                pass  # not empty (another rank's files) or already gone

