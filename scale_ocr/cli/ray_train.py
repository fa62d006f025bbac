"""Ray Train: scale_ocr's own training inside ``ray.train.torch.TorchTrainer`` (``scale-ocr ray-train``).

The driver checks the training flags as ``scale_ocr/train.py`` does, then hands them to a ``TorchTrainer``; Ray
starts the workers and their process group, which :func:`~scale_ocr.distributed.process_group.init_distributed`
joins (launcher ``ray``). scale_ocr's checkpoint is the source of truth: every worker trains into the same
``--output-dir`` with ``--resume auto``, so a group Ray restarts (``--max-failures``) continues from the newest
checkpoint there. A worker that ends on purpose (exit 2, 4 or 74) returns its code and line instead of raising, so
Ray does not retry what would fail again. Usage: docs/launchers.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scale_ocr.errors import (
    EXIT_FAULT,
    EXIT_PEER_LOST,
    EXIT_USER_ERROR,
    LINE_LIMIT,
    UserError,
    first_line,
    is_peer_lost,
    printable,
    report_user_errors,
    say,
)

INSTALL_HINT = "pip install 'scale-ocr[ray]'"
# Stops whose code means "try again", left to Ray's restarts: a peer lost, and a preemption (75, EXIT_PREEMPTED; no
# signal handler is armed under Ray, see _train, but that is what the code would mean).
RETRIED_EXITS = (EXIT_PEER_LOST, 75)
# Ray Train's print patch sends print() through its logger as well as to the console: every line twice.
WORKER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


@dataclass(frozen=True)
class RayOptions:
    """How Ray runs the job: the flags before ``--``."""

    num_workers: int
    max_failures: int = 0
    cpus_per_worker: float = 1.0
    use_gpu: bool = False
    address: str | None = None
    storage_path: str | None = None
    log_level: str = "ERROR"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scale-ocr ray-train",
        usage="scale-ocr ray-train --num-workers N [--max-failures K] [options] -- TRAIN_FLAGS...",
        description="Train with Ray Train: N workers of a Ray cluster run scale-ocr's trainer together "
        "(ray.train.torch.TorchTrainer); the flags after -- are `scale-ocr train`'s. A worker that dies makes Ray "
        "restart the group up to K times, and the run continues from its last checkpoint in --output-dir, which "
        "every worker must reach (a shared folder across nodes). Needs " + INSTALL_HINT + ".")
    parser.add_argument("--num-workers", type=_positive_int, required=True, metavar="N",
                        help="training processes (ranks): ScalingConfig(num_workers=N)")
    parser.add_argument("--max-failures", type=_failures, default=0, metavar="K",
                        help="worker-group restarts Ray makes after a worker fails, each resuming from the last "
                        "checkpoint: FailureConfig(max_failures=K); -1: without limit (default: 0)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="C",
                        help="CPUs Ray reserves for each worker; a CPU rank also runs this many threads unless "
                        "--threads says otherwise (default: 1)")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker, NCCL between them")
    parser.add_argument("--address", metavar="ADDR",
                        help="the Ray cluster, HOST:PORT of its head; default: $RAY_ADDRESS, else a "
                        "cluster started on this machine by `ray start`, else a new one-machine cluster")
    parser.add_argument("--storage-path", metavar="DIR",
                        help="where Ray keeps its own records of the run (default: Ray's, ~/ray_results); "
                        "scale-ocr's checkpoints stay in --output-dir")
    parser.add_argument("--ray-log-level", dest="log_level", default="ERROR", metavar="LEVEL",
                        help="level of Ray Train's own console lines: scale-ocr prints its own for what it "
                        "handles; INFO shows Ray's worker-group decisions, with the tracebacks of restarts "
                        "(default: ERROR)")
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a whole number of at least 1")
    return value


def _failures(text: str) -> int:
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"{text} is not a number of restarts (0 or more, or -1 for no limit)")
    return value


def split_args(argv: list[str]) -> tuple[RayOptions, list[str]]:
    """The Ray options before ``--`` and the training flags after it."""
    if "--" in argv:
        cut = argv.index("--")
        ours, train = argv[:cut], argv[cut + 1:]
    else:
        ours, train = argv, []
    parser = build_parser()
    known, extra = parser.parse_known_args(ours)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)} (training flags go after --, e.g. "
                     "`scale-ocr ray-train --num-workers 2 -- crnn_mobilenet_v3_small --strategy ddp`)")
    return RayOptions(**vars(known)), train


def import_ray():
    """Ray Train's modules, or one line naming the install; Ray Train's V2 API, which hands rank 0's return value
    to the driver (``Result.return_value``: how a worker's outcome reaches it)."""
    try:
        import ray
        import ray.train.torch  # noqa: F401 - the TorchTrainer and its config
    except ImportError as exc:
        raise UserError(f"scale-ocr ray-train needs Ray Train ({printable(first_line(exc), 200)}); install it with "
                        f"`{INSTALL_HINT}`") from None
    if "return_value" not in {f.name for f in dataclasses.fields(ray.train.Result)}:
        raise UserError(f"scale-ocr ray-train needs Ray Train's V2 API, and Ray {ray.__version__} gives V1 here: "
                        "unset RAY_TRAIN_V2_ENABLED (or set it to 1), or upgrade Ray with "
                        f"`pip install -U {INSTALL_HINT.split(' ', 2)[2]}`")
    return ray


def prepare_train_args(train_argv: list[str], opts: RayOptions) -> tuple[list[str], Any]:
    """The training flags checked here as ``train.py`` checks them, and the run directory made absolute.

    Ray runs the training function in a folder of its own on each worker, so a relative ``--output-dir`` (or its
    default, ``runs/latest``) is resolved against the driver's folder, where the user meant it.
    """
    from scale_ocr.cli.args import parse_config
    from scale_ocr.strategies import check_launch
    from scale_ocr.tracking.wandb_logger import wandb_env

    cfg = parse_config(train_argv)
    check_launch(cfg.strategy, opts.num_workers, "ray")
    wandb_env(cfg.logging.wandb_mode)  # the workers inherit the driver's W&B variables
    if opts.use_gpu and cfg.strategy.backend == "gloo":
        raise UserError("--use-gpu puts each worker on a GPU with NCCL, but the training flags say --backend gloo; "
                        "drop one of them")
    if not opts.use_gpu and cfg.strategy.backend == "nccl":
        raise UserError("--backend nccl needs GPUs: add --use-gpu (one GPU per worker) or drop --backend")
    out = str(Path(cfg.output.output_dir).absolute())
    return [*train_argv, "--output-dir", out], cfg


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """Ray's training function: scale_ocr's run on this worker. Returns its outcome, which reaches the driver as
    rank 0's ``Result.return_value``. A lost peer ends the process and any other fault is raised: Ray restarts
    the worker group.

    Args:
        config: ``argv``, the training flags (with an absolute ``--output-dir``); optional ``cwd``, the driver's
            folder, and ``started``, the driver's ``time.time()`` when it began (see :func:`continue_own_run`).
    """
    _enter(config.get("cwd"))
    try:
        return {"exit_code": 0, "summary": _train(continue_own_run(config["argv"], config.get("started")))}
    except UserError as exc:
        if exc.exit_code in RETRIED_EXITS:
            raise
        line = f"scale-ocr: {exc.prefix}: {printable(str(exc).strip(), LINE_LIMIT)}"
        return {"exit_code": exc.exit_code, "line": line}
    except Exception as exc:
        if UserError.__name__ + ":" in str(exc):  # raised in a DataLoader worker, which wraps it in its own type
            return {"exit_code": EXIT_USER_ERROR, "line": f"scale-ocr: error: {_wrapped_user_error(exc)}"}
        if is_peer_lost(exc):  # the line, then the worker ends as a dead peer's would: Ray restarts the group
            say(f"scale-ocr: error: rank {os.environ.get('RANK', '?')} lost contact with another rank "
                  f"({printable(first_line(exc), 160)}); Ray Train restarts the workers if --max-failures allows, "
                  "and they resume from the last checkpoint", err=True)
            os._exit(EXIT_PEER_LOST)  # not raise: Ray would print the traceback of what is only a lost peer
        raise


def continue_own_run(argv: list[str], started: float | None) -> list[str]:
    """The flags for this attempt: after Ray restarted the workers, ``--resume auto`` wherever an explicit
    ``--resume PATH`` or ``none`` was given, so the restart continues from this job's own newest checkpoint
    instead of the first attempt's starting point (which would move this job's checkpoints aside).

    A checkpoint of this job is one the run directory's ``checkpoints/latest`` names and that was written since
    the driver started; the run directory's lock keeps any other job from writing there meanwhile.
    """
    from scale_ocr.checkpoint.pointer import POINTER, pointed_checkpoint
    from scale_ocr.cli.args import parse_config

    cfg = parse_config(argv)
    checkpoints = Path(cfg.output.output_dir) / "checkpoints"
    pointer = checkpoints / POINTER
    if started is None or cfg.checkpoint.resume == "auto" or not pointer.is_file() or pointer.stat().st_mtime < started:
        return argv
    if os.environ.get("RANK", "0") == "0":
        say(f"scale-ocr: Ray Train restarted the workers: continuing from this job's own "
            f"{printable(str(pointed_checkpoint(checkpoints)), 400)}, not --resume "
            f"{printable(cfg.checkpoint.resume, 200)}")
    return [*argv, "--resume", "auto"]


def _enter(cwd: str | None) -> None:
    """Work in the driver's folder when this host has it, so relative paths in the flags mean what they meant
    there (on another node without it, paths must be absolute: the run directory already is)."""
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)


def _wrapped_user_error(exc: BaseException) -> str:
    """Our sentence from an exception that carries a UserError's text in its last line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[-1] if lines else type(exc).__name__
    prefix = f"{UserError.__name__}: "
    return printable(text[len(prefix):] if text.startswith(prefix) else text, LINE_LIMIT)


def _train(argv: list[str]) -> dict:
    """``scale_ocr/train.py``'s main, for a process group Ray has already started and will tear down itself.

    Ray calls the training function in a thread, where Python cannot install signal handlers: preemption is
    Ray's to handle (its workers are restarted and resume from the last checkpoint), so no SIGTERM handler is set.
    """
    from scale_ocr.cli.args import parse_config
    from scale_ocr.distributed.process_env import prepare_process
    from scale_ocr.distributed.process_group import init_distributed, peek_launch
    from scale_ocr.planning.auto import resolve_auto
    from scale_ocr.run.control import StopSignal
    from scale_ocr.run.watchdog import Watchdog
    from scale_ocr.strategies import check_launch
    from scale_ocr.train import run

    prepare_process()
    cfg = resolve_auto(parse_config(argv), *peek_launch())
    check_launch(cfg.strategy, *peek_launch())
    dist = init_distributed(cfg.strategy.backend, cfg.strategy.dist_timeout, cfg.strategy.threads)
    watchdog = Watchdog(dist.rank, dist.world_size, cfg.strategy.dist_timeout, dist.is_main, dist.round_id).start()
    try:
        return run(cfg, dist, StopSignal(), watchdog, list(argv or []))
    finally:
        watchdog.close()


def build_trainer(opts: RayOptions, train_argv: list[str], cfg):
    """The ``TorchTrainer`` for ``scale-ocr train`` flags already passed through :func:`prepare_train_args`."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    try:
        from ray.train import LoggingConfig  # Ray Train V2's (not in every release of it)
        logging = {"logging_config": LoggingConfig(log_level=opts.log_level.upper())}
    except ImportError:
        logging = {}
    run_config = RunConfig(
        name=f"scale-ocr-{Path(cfg.output.output_dir).name}-{os.getpid()}",
        storage_path=opts.storage_path,
        failure_config=FailureConfig(max_failures=opts.max_failures),
        worker_runtime_env={"env_vars": WORKER_ENV}, **logging)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"argv": train_argv, "cwd": os.getcwd(), "started": time.time()},
        # The group's own timeout is a minute past --dist-timeout, as init_distributed sets it, so the watchdog's
        # line naming the silent rank comes first.
        torch_config=TorchConfig(backend=cfg.strategy.backend, timeout_s=int(cfg.strategy.dist_timeout) + 60),
        scaling_config=ScalingConfig(num_workers=opts.num_workers, use_gpu=opts.use_gpu,
                                     resources_per_worker={"CPU": opts.cpus_per_worker}),
        run_config=run_config)


def connect(ray, opts: RayOptions) -> None:
    """Join the Ray cluster (unless this driver already did: a script that called ``ray.init`` itself)."""
    import logging

    if ray.is_initialized():
        return
    where = opts.address or os.environ.get("RAY_ADDRESS") or "this machine"
    try:
        ray.init(address=opts.address, logging_level=getattr(logging, opts.log_level.upper(), logging.WARNING))
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UserError(f"cannot join the Ray cluster at {printable(where, 200)} "
                        f"({printable(first_line(exc), 200)}); start one with `ray start --head`, or fix --address "
                        "or RAY_ADDRESS; a cluster with token authentication also needs RAY_AUTH_MODE=token and its "
                        "token (see examples/ray/README.md)") from None


def warn_if_short(ray, opts: RayOptions) -> None:
    """Say so when the cluster cannot place the workers now: Ray then waits for nodes (an autoscaling cluster
    adds them; a fixed one never does), retrying its start every minute."""
    have = ray.cluster_resources()
    need = {"CPU": opts.num_workers * opts.cpus_per_worker, "GPU": opts.num_workers if opts.use_gpu else 0}
    short = [f"{need[k]:g} {k}s (it has {have.get(k, 0):g})" for k in need if need[k] > have.get(k, 0)]
    if short:
        say(f"scale-ocr: warning: {opts.num_workers} workers need {' and '.join(short)} in the Ray cluster; Ray "
            "waits until nodes join (an autoscaling cluster adds them): lower --num-workers or "
            "--cpus-per-worker, or add nodes with `ray start --address HEAD:PORT`; Ctrl-C stops", err=True)


def failure(exc: BaseException, out: str) -> UserError:
    """One line for a run Ray Train gave up on (its restarts used up, or a failure it does not retry): what failed
    on which rank, and how to continue."""
    from ray.exceptions import RayActorError

    from scale_ocr.errors import RunStopped

    failures = getattr(exc, "worker_failures", None) or {}
    # Ray wraps a training function's exception with its traceback text; the exception itself is in _base_exc
    # (UserExceptionWithTraceback, Ray 2.60). A dead worker's entry is a RayActorError.
    causes = {rank: getattr(err, "_base_exc", err) for rank, err in sorted(failures.items())}
    stopped = [c for c in causes.values() if isinstance(c, UserError)]
    if stopped:  # e.g. preempted (75) more often than --max-failures allows: its own line and code
        return RunStopped(str(stopped[0]), stopped[0].exit_code, stopped[0].prefix)
    if causes:
        what = "; ".join(f"rank {r}: {printable(first_line(c).rstrip('.'), 160)}" for r, c in causes.items())
    else:
        cause = getattr(exc, "controller_failure", exc)
        what = printable(" ".join(str(cause).split()), 400)
    lost = any(isinstance(c, RayActorError) or is_peer_lost(c) for c in causes.values())
    return RunStopped(f"Ray Train gave up on the run (--max-failures): {what}; the checkpoints in {out} are kept, "
                      "and the same command continues from the newest", EXIT_PEER_LOST if lost else EXIT_FAULT)


def finish(trainer, out: str) -> int:
    """Run ``trainer`` (built on :func:`train_loop_per_worker`) and end as its rank 0 ended: the exit code, after
    printing rank 0's line when it is not 0. A run Ray gave up on raises :func:`failure`'s one line."""
    from ray.train import TrainingFailedError

    try:
        result = trainer.fit()
    except TrainingFailedError as exc:
        raise failure(exc, out) from None
    outcome = result.return_value or {"exit_code": EXIT_FAULT, "line": "scale-ocr: error: rank 0 of the Ray Train "
                                      "run returned no outcome; its output above says why"}
    if outcome["exit_code"] != 0:
        say(outcome["line"], err=True)
    return outcome["exit_code"]


def fit(opts: RayOptions, train_argv: list[str]) -> int:
    """Check the flags, join the cluster, run the TorchTrainer and end as rank 0 ended; returns the exit code."""
    argv, cfg = prepare_train_args(train_argv, opts)  # first: a mistake in the flags needs no cluster, nor Ray
    ray = import_ray()
    connect(ray, opts)
    warn_if_short(ray, opts)
    return finish(build_trainer(opts, argv, cfg), argv[-1])


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    """``scale-ocr ray-train`` / ``python -m scale_ocr.cli.ray_train``."""
    opts, train_argv = split_args(list(sys.argv[1:] if argv is None else argv))
    return fit(opts, train_argv)


if __name__ == "__main__":
    sys.exit(main())
