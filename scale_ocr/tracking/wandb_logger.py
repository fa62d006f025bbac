"""Weights & Biases: one run per job, offline unless an API key is configured, never fatal (docs/wandb.md).

The W&B variables read here (``WANDB_MODE``, ``WANDB_INIT_TIMEOUT``) are checked at start, before the run directory
is claimed (:func:`wandb_env`): a value W&B cannot use is one line, exit 2, like a flag's. Once running, any W&B
trouble becomes one warning and the run carries on with ``metrics.jsonl``, except a full disk: W&B's writer
drops records silently then, so the room left is checked before each call and a full disk stops the run
(:class:`~scale_ocr.disk.DiskFault`, exit 74).
"""

from __future__ import annotations

import math
import netrc
import os
import re
import secrets
import string
import warnings
from pathlib import Path
from typing import Any

from scale_ocr.config import LoggingConfig
from scale_ocr.disk import (
    DiskFault,
    KiB,
    check_entry,
    disk_fault,
    free_bytes,
    raise_or_defer,
    read_user_text,
    size_text,
    write_atomic,
)
from scale_ocr.errors import UserError, printable, say, shown
from scale_ocr.tracking.jsonl import clean

RUN_ID_FILE = "wandb_run_id"
EXAMPLE_LIMIT = 200  # characters of a label or prediction in the W&B examples table
# Below this much free space on its file system, W&B's writer would lose records without a word: a record is a few
# KiB, an examples table with its images some hundreds.
WANDB_MIN_FREE = 1 << 20
_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL)", re.IGNORECASE)
# A W&B run id as W&B and new_run_id write it; it becomes part of a folder's name, so nothing else is used.
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def warn(message: str) -> None:
    """One visible line on stderr (rank 0 only calls this)."""
    say(f"scale-ocr: warning: {printable(message, 1000)}", err=True)


def has_api_key(env: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether W&B credentials exist locally (env var or ~/.netrc); no network involved."""
    if env.get("WANDB_API_KEY"):
        return True
    try:
        host = re.sub(r"^https?://", "", env.get("WANDB_BASE_URL", "api.wandb.ai")).split("/")[0]
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_mode(flag: str, env: dict[str, str] | os._Environ = os.environ) -> str:
    """``--wandb-mode`` if given, else ``WANDB_MODE``/``WANDB_DISABLED``, else online with a key, offline without."""
    if flag != "auto":
        return flag
    if env.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled"
    mode = env.get("WANDB_MODE", "").lower()
    if mode:
        return {"dryrun": "offline", "run": "online"}.get(mode, mode)
    return "online" if has_api_key(env) else "offline"


WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")  # what wandb.Settings(mode=) takes
INIT_TIMEOUT_MAX = 24 * 3600.0


def wandb_env(flag: str, env: dict[str, str] | os._Environ = os.environ) -> tuple[str, float]:
    """The W&B mode (:func:`resolve_mode`) and ``WANDB_INIT_TIMEOUT`` in seconds (default 60), every W&B variable
    read here checked: a mode W&B does not know, a timeout that is no number of seconds above 0, is one line (a
    :class:`UserError`, exit 2), at start, rather than a traceback or a wait after the run began. Nothing is checked
    when W&B is disabled: its variables are not read then."""
    mode = env.get("WANDB_MODE", "").strip().lower()
    if flag == "auto" and mode and mode not in WANDB_MODES and env.get("WANDB_DISABLED", "").lower() not in (
            "1", "true", "yes"):
        raise UserError(f"WANDB_MODE={shown(env['WANDB_MODE'])} is not a W&B mode; set it to one of "
                        f"{', '.join(WANDB_MODES)}, or unset it (or give --wandb-mode)")
    mode = resolve_mode(flag, env)
    timeout = 60.0
    text = env.get("WANDB_INIT_TIMEOUT", "").strip()
    if mode != "disabled" and text:
        try:
            timeout = float(text)
        except ValueError:
            timeout = math.nan
        if not 0 < timeout <= INIT_TIMEOUT_MAX:  # NaN fails it too
            raise UserError(f"WANDB_INIT_TIMEOUT={shown(env['WANDB_INIT_TIMEOUT'])} is not a number of seconds W&B "
                            f"may take to start (above 0, at most {INIT_TIMEOUT_MAX:.0f}); set it to e.g. 60, or "
                            "unset it (or --wandb-mode disabled)")
    return mode, timeout


def redact(value: Any, env: dict[str, str] | os._Environ = os.environ) -> Any:
    """A copy of ``value`` with secrets from the environment replaced, and secret-named keys dropped."""
    secrets = {v for k, v in env.items() if _SECRET_NAME.search(k) and len(v) >= 8}

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items() if not _SECRET_NAME.search(str(k))}
        if isinstance(node, (list, tuple)):
            return [walk(v) for v in node]
        if isinstance(node, str) and any(s in node for s in secrets):
            return "<redacted>"
        return node

    return walk(value)


def new_run_id() -> str:
    """An 8-character run id in W&B's alphabet."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbLogger:
    """Logs to an open W&B run; the first failure disables it with a warning."""

    def __init__(self, run) -> None:
        self.run = run
        self.broken = False

    def _room(self) -> Path:
        """W&B's run folder, after checking its file system has room: W&B itself does not say when it has none."""
        where = Path(getattr(self.run, "dir", None) or ".")
        free = free_bytes(where)
        if free is not None and free < WANDB_MIN_FREE:
            raise OSError(28, f"{size_text(free)} free, W&B needs {size_text(WANDB_MIN_FREE)} to write safely")
        return where

    def _guard(self, what: str, fn, *args, **kwargs) -> None:
        if self.broken:
            return
        try:
            self._room()
            fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - logging must never stop training, but a full disk stops the run
            self.broken = True
            fault = disk_fault(exc, Path(getattr(self.run, "dir", None) or "."), "W&B's files in",
                               "metrics.jsonl and every checkpoint written are kept")
            if fault is not None:
                raise_or_defer(fault)
                return
            warn(f"W&B {what} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                 "continuing with metrics.jsonl only")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._guard("log", self.run.log, {k: clean(v) for k, v in metrics.items()}, step=step)

    def log_examples(self, examples: list[dict[str, Any]], step: int) -> None:
        """A table with one row per example; (H, W, 3) arrays become images, texts (labels, predictions) are shown
        escaped and cut as messages show them (:func:`scale_ocr.errors.printable`), the rest stays as it is."""
        if not examples:
            return

        def table():
            import wandb

            columns = list(examples[0])
            t = wandb.Table(columns=columns)
            for row in examples:
                t.add_data(*(wandb.Image(v) if hasattr(v, "shape") else printable(v, EXAMPLE_LIMIT)
                             if isinstance(v, str) else v for v in (row[c] for c in columns)))
            self.run.log({"val/examples": t}, step=step)

        self._guard("table", table)

    def summary(self, metrics: dict[str, Any]) -> None:
        self._guard("summary", self.run.summary.update, {k: clean(v) for k, v in metrics.items()})

    def close(self) -> None:
        self._guard("finish", self.run.finish)


def open_wandb(cfg: LoggingConfig, run_dir: Path, run_config: dict[str, Any], resume: bool = False):
    """Start (or, when resuming, reopen) this job's single W&B run; None when disabled or unavailable.

    W&B's files go under ``$WANDB_DIR/wandb`` when set, else ``run_dir/wandb``; the run id file stays in ``run_dir``.
    """
    mode, timeout = wandb_env(cfg.wandb_mode)  # checked at start already (train's main); here for API callers
    if mode == "disabled":
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import wandb
    except Exception as exc:  # noqa: BLE001 - a broken install is as good as none
        warn(f"wandb cannot be imported ({type(exc).__name__}: {exc}); logging to metrics.jsonl only. "
             "`pip install wandb` to enable it")
        return None
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR"):  # set-but-empty makes wandb's settings fail
        if os.environ.get(var) == "":
            del os.environ[var]
    wandb_dir = os.environ.get("WANDB_DIR", str(run_dir))
    if wandb_dir == str(run_dir) and not _own_wandb_folder(run_dir):
        return None
    run_id = _run_id(run_dir / RUN_ID_FILE) if resume else new_run_id()
    kwargs = dict(
        project=os.environ.get("WANDB_PROJECT", cfg.wandb_project), entity=cfg.wandb_entity,
        group=cfg.wandb_group, tags=list(cfg.wandb_tags) or None, name=cfg.run_name, id=run_id,
        resume="allow", dir=wandb_dir, config=redact(run_config), reinit="finish_previous",
        settings=wandb.Settings(init_timeout=timeout, console="off",
                                silent=True),
    )
    run = _init(wandb, mode, kwargs)
    if run is None:
        return None
    try:
        write_atomic(run_dir / RUN_ID_FILE, run.id + "\n", what="the W&B run id", kept="nothing was trained yet")
    except DiskFault as fault:
        raise_or_defer(fault)
    return WandbLogger(run)


def _own_wandb_folder(run_dir: Path) -> bool:
    """``run_dir/wandb`` made a folder of this user's, never a link: W&B would write its files through one (a link
    planted there after the run's start-up check). False, with a warning, when it is not."""
    folder = run_dir / "wandb"
    try:
        os.mkdir(folder)  # a link in its place is not followed: EEXIST
    except FileExistsError:
        pass
    except OSError as exc:
        warn(f"W&B's folder {folder} cannot be created ({os.strerror(exc.errno or 0)}); logging to metrics.jsonl only")
        return False
    try:
        check_entry(folder, directory=True)
    except UserError as exc:
        warn(f"W&B is not started: {exc}; logging to metrics.jsonl only")
        return False
    return True


def _run_id(id_file: Path) -> str:
    """The W&B run id a resumed run continues (its ``wandb_run_id`` file), or a new one, with a warning, when that
    file is missing, unreadable or holds no run id."""
    try:
        os.lstat(id_file)
    except FileNotFoundError:
        return new_run_id()
    try:
        run_id = read_user_text(id_file, what="the run's W&B run id", limit=4 * KiB).strip()
    except UserError as exc:
        run_id = str(exc)
    if _RUN_ID.fullmatch(run_id):
        return run_id
    warn(f"{id_file} holds no W&B run id ({printable(run_id, 80)}); this job logs to a new W&B run")
    return new_run_id()


def _init(wandb, mode: str, kwargs: dict[str, Any]):
    try:
        return wandb.init(mode=mode, **kwargs)
    except Exception as exc:  # noqa: BLE001 - W&B raises many types; none may end the run
        reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    if mode != "online":
        warn(f"W&B could not start ({reason}); logging to metrics.jsonl only")
        return None
    warn(f"W&B online mode could not start ({reason}); logging offline to {kwargs['dir']}/wandb instead - "
         "upload later with `wandb sync`")
    try:
        return wandb.init(mode="offline", **kwargs)
    except Exception as exc:  # noqa: BLE001
        warn(f"W&B offline mode failed too ({type(exc).__name__}); logging to metrics.jsonl only")
        return None
