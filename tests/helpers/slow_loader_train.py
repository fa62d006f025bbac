"""``scale_ocr/train.py`` whose rank 1 waits ``SECONDS`` for every batch: \
``slow_loader_train.py SECONDS TRAIN_ARGS...``.

A loader slower on one rank than on the others, as a rank reading from a slower disk is: the time breakdown must show
it as data wait on that rank, and as communication exposed on the others (they wait for it inside the collectives).
The hook patches the trainer in this process only; the package knows nothing of it.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path


def install(seconds: float) -> None:
    from scale_ocr.run.trainer import Trainer

    step = Trainer.train_step

    def slowed(self, batches):
        def each():
            for batch in batches:
                time.sleep(seconds)
                yield batch

        return step(self, each() if os.environ.get("RANK") == "1" else batches)

    Trainer.train_step = slowed


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, as train.py puts it
    gc.disable()
    install(float(sys.argv[1]))
    from scale_ocr.train import main

    gc.freeze()
    gc.enable()
    sys.exit(main(sys.argv[2:]))
