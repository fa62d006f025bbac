"""``scale_ocr/train.py`` recording which shard samples each rank trains on: ``keyed_train.py DIR TRAIN_ARGS...``.

Each sample's word is replaced by its shard key (digits), and every micro-batch the trainer takes is appended to
``DIR/keys-rank<R>.txt``, one key a line, as it is consumed: what a test of the data position compares across a
resume. The hooks patch classes in this process only (loader workers inherit them); the package knows nothing of them.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path


def install(out: Path) -> None:
    from scale_ocr.data.shard_reader import DecodeWord
    from scale_ocr.run.trainer import Trainer

    decode = DecodeWord.__call__

    def keyed(self, member, where):
        image, _ = decode(self, member, where)
        return image, member.key

    DecodeWord.__call__ = keyed
    step = Trainer.train_step

    def recorded(self, batches):
        def each():
            for batch in batches:
                with open(out / f"keys-rank{os.environ.get('RANK', '0')}.txt", "a") as f:
                    f.write("".join(w + "\n" for w in batch.words))
                yield batch

        return step(self, each())

    Trainer.train_step = recorded


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # the repository root, as train.py puts it
    gc.disable()
    install(Path(sys.argv[1]))
    from scale_ocr.train import main

    gc.freeze()
    gc.enable()
    sys.exit(main(sys.argv[2:]))
