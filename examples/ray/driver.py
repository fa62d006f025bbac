"""A Ray Train driver for scale-ocr, with the ``TorchTrainer`` written out: the pieces to put in your own driver.

``scale-ocr ray-train`` runs the same in one command (see README.md here)::

    ray start --head --num-cpus 4                     # or use a cluster you have: export RAY_ADDRESS=HEAD:6379
    python examples/ray/driver.py --num-workers 2 --max-failures 2 -- \\
        crnn_mobilenet_v3_small --strategy ddp --max-steps 200 --save-every 50 --output-dir runs/ray

The flags before ``--`` are ``scale-ocr ray-train``'s, those after it ``scale-ocr train``'s. Each worker runs
scale-ocr's own training (:func:`scale_ocr.cli.ray_train.train_loop_per_worker`) into the one ``--output-dir``,
which must be a folder every worker reaches (a shared filesystem across nodes): when a worker dies, Ray restarts
the group up to ``max_failures`` times and it continues from scale-ocr's newest checkpoint there.
"""

from __future__ import annotations

import os
import sys
import time

import ray
from ray.train import FailureConfig, LoggingConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from scale_ocr.cli.ray_train import WORKER_ENV, finish, prepare_train_args, split_args, train_loop_per_worker
from scale_ocr.errors import report_user_errors


@report_user_errors  # a mistake in the flags, here or in a worker, is one line and exit 2
def main(argv: list[str]) -> int:
    opts, flags = split_args(argv)
    flags, _ = prepare_train_args(flags, opts)  # checked before the cluster is involved; --output-dir made absolute
    ray.init(logging_level="WARNING")  # $RAY_ADDRESS, else the cluster `ray start` started on this machine
    trainer = TorchTrainer(
        train_loop_per_worker,  # scale-ocr's trainer; Ray has set RANK, WORLD_SIZE, ... and started the group
        # the flags; the driver's folder, for relative paths; its start, which tells a restart (continue_own_run)
        train_loop_config={"argv": flags, "cwd": os.getcwd(), "started": time.time()},
        scaling_config=ScalingConfig(num_workers=opts.num_workers, use_gpu=opts.use_gpu),
        run_config=RunConfig(
            storage_path=opts.storage_path,  # Ray's own records of the run (default ~/ray_results)
            failure_config=FailureConfig(max_failures=opts.max_failures),
            worker_runtime_env={"env_vars": WORKER_ENV},  # print() straight to the console, not twice
            logging_config=LoggingConfig(log_level="ERROR"),  # scale-ocr prints its own line for what it handles
        ),
    )
    return finish(trainer, flags[-1])  # rank 0's exit code; a run Ray gave up on is one line


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
