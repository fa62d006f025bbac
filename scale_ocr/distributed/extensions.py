"""DeepSpeed's compiled ops: built once by the install step into this environment, found there by every launch.

``TORCH_EXTENSIONS_DIR`` defaults to a cache every venv on the host shares; an unset one points at the venv's own
folder, which ``make install`` fills. The venv's ``bin`` goes first on ``PATH``: two ninjas with different build-log
formats discard each other's log and rebuild every op from scratch.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from scale_ocr.errors import first_line, report_user_errors, say

VARIABLE = "TORCH_EXTENSIONS_DIR"
# DeepSpeed's op builders (by accelerator-neutral class name) that scale_ocr's strategies load on a CPU host.
OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")


def environment_extensions_dir() -> Path | None:
    """``<venv>/torch_extensions`` when running in a writable virtual environment, else None (torch's default)."""
    if sys.prefix == sys.base_prefix or not os.access(sys.prefix, os.W_OK):
        return None
    return Path(sys.prefix) / "torch_extensions"


def use_environment_extensions() -> None:
    """Build and find DeepSpeed's ops in this environment's folder unless the user chose one (inherited by the
    processes a launcher starts)."""
    folder = environment_extensions_dir()
    if folder is not None:
        os.environ.setdefault(VARIABLE, str(folder))
    scripts = Path(sysconfig.get_path("scripts"))
    path = os.environ.get("PATH", "").split(os.pathsep)
    if (scripts / "ninja").is_file() and path[0] != str(scripts):  # split always gives at least [""]
        os.environ["PATH"] = os.pathsep.join([str(scripts), *(p for p in path if p != str(scripts))])


def build_ops() -> list[str]:
    """Build (or load, when already built) each op this accelerator supports; one line per op."""
    from deepspeed.accelerator import get_accelerator

    lines = []
    for class_name in OPS:
        builder = get_accelerator().create_op_builder(class_name)
        if builder is None or not builder.is_compatible(verbose=False):
            lines.append(f"{class_name.removesuffix('Builder')}: not supported here, skipped")
            continue
        try:
            builder.load(verbose=False)
        except Exception as exc:  # noqa: BLE001 - a failed JIT build raises anything from RuntimeError to OSError
            first = first_line(exc)
            lines.append(f"{builder.NAME}: did not build ({first}); a job that needs it will build it then")
            continue
        lines.append(f"{builder.NAME}: built")
    return lines


@report_user_errors
def main() -> int:
    """``python -m scale_ocr.distributed.extensions``: build DeepSpeed's ops where `make install` keeps them."""
    use_environment_extensions()
    say(f"scale-ocr: DeepSpeed ops in {os.environ.get(VARIABLE, 'torch default')}: " + "; ".join(build_ops()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
