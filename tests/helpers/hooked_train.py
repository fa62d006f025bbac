"""``scale_ocr/train.py`` with test hooks installed first: what a test launches (under torchrun or python) to reach
a moment a real run cannot be stopped at from outside. Hook options come before the training arguments::

    hooked_train.py [--stall-save SECONDS] [--stall-in-dcp SECONDS] [--resave-on-resume] TRAIN_ARGS...

``--stall-save SECONDS``
    from the second checkpoint on, every rank sleeps after writing its files, before the barrier that completes
    the save: a rank killed then dies mid-write (the checkpoint's ``step_N.tmp`` is there, ``latest`` not yet
    moved), and the first checkpoint, saved at once, is complete to fall back on.
``--stall-in-dcp SECONDS``
    every rank sleeps inside torch.distributed.checkpoint's write of each checkpoint's tensors (``step_N.tmp`` is
    there): a signal sent then meets DCP's own handling (it wraps a Ctrl-C in a CheckpointException).
``--resave-on-resume``
    a resumed run saves the state it loaded, re-sharded by its own engine, before its first step, so a test can
    compare it bitwise with the checkpoint it came from.

The hooks patch the classes in this process only; the package knows nothing of them.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any


def stall_saves(seconds: float) -> None:
    """From the second checkpoint on, each rank sleeps ``seconds`` once its part is written, before the save
    completes (the first needs no stall: only a later one is caught mid-write)."""
    from scale_ocr.checkpoint.manager import CheckpointManager

    write = CheckpointManager.write_shards
    saves = 0

    def write_then_stall(self, strategy, folder, *args) -> None:
        nonlocal saves
        write(self, strategy, folder, *args)
        saves += 1
        if saves > 1:
            time.sleep(seconds)

    CheckpointManager.write_shards = write_then_stall


def stall_in_dcp(seconds: float) -> None:
    """Each rank sleeps ``seconds`` inside DCP's write of its data, before writing it."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write = FileSystemWriter.write_data

    def stall_then_write(self, *args, **kwargs):
        time.sleep(seconds)
        return write(self, *args, **kwargs)

    FileSystemWriter.write_data = stall_then_write


def resave_on_resume() -> None:
    """A resumed run saves a checkpoint as soon as its trainer state is restored (before training on)."""
    from scale_ocr.run.trainer import Trainer

    restore = Trainer.restore

    def restore_then_save(self, meta: dict[str, Any]) -> str:
        where = restore(self, meta)
        self.save_checkpoint()
        return where

    Trainer.restore = restore_then_save


def install(argv: list[str]) -> list[str]:
    """Install the hooks the leading options of ``argv`` ask for; the rest of ``argv`` (train.py's arguments)."""
    argv = list(argv)
    while argv and argv[0] in ("--stall-save", "--stall-in-dcp", "--resave-on-resume"):
        option = argv.pop(0)
        if option == "--stall-save":
            stall_saves(float(argv.pop(0)))
        elif option == "--stall-in-dcp":
            stall_in_dcp(float(argv.pop(0)))
        else:
            resave_on_resume()
    return argv


if __name__ == "__main__":
    # the repository root, as train.py puts it, not tests/helpers
    sys.path[0] = str(Path(__file__).resolve().parents[2])
    gc.disable()  # as train.py does when launched: the modules' objects are frozen once imported, not walked
    train_args = install(sys.argv[1:])
    from scale_ocr.train import main

    gc.freeze()
    gc.enable()
    sys.exit(main(train_args))
