"""Resumable checkpoints in one format for every strategy and world size.

Layout of ``RUN_DIR/checkpoints/``::

    step_00000100/            DCP shards (model + optimizer by parameter name) and .metadata
    step_00000100/trainer.json  step, epoch, data position, LR schedule, best score, model and vocab
    step_00000100/rng_rank{r}.pt  each rank's RNG states
    latest                    name of the newest complete checkpoint

A checkpoint is written into ``step_N.tmp/`` and renamed only once every rank has finished (rank 0 writes
``manifest.json`` first), and ``latest`` moves after that, so a crash or kill during a save leaves the previous one
loadable.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as tdist

from scale_ocr.checkpoint.manifest import verify_manifest, write_manifest
from scale_ocr.checkpoint.pointer import POINTER, checkpoint_folder, latest_checkpoint, step_name
from scale_ocr.config import CheckpointConfig
from scale_ocr.disk import (
    DiskFault,
    disk_fault,
    pending,
    read_user_json,
    remove_tree,
    size_text,
    take_pending,
    tree_bytes,
    write_atomic,
)
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.errors import UserError, memory_for
from scale_ocr.strategies import Strategy
from scale_ocr.strategies.flat_shard import FlatShard, shard_or_default


def rng_state() -> dict[str, Any]:
    """Every RNG this process draws from, as tensors and plain numbers (loadable with weights_only)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a checkpoint state as this rank holds them (a :class:`FlatShard` counts its part)."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, FlatShard):
        return state.numel * state.dtype.itemsize
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state  # a DTensor: this rank's shard
        return local.numel() * local.element_size()
    return 0


def _save_planner():
    """DCP's default save planner, which also finds the boxes of a :class:`FlatShard` (what a DeepSpeed rank holds of
    each tensor, written from where it lies, one box at a time)."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class FlatShardSavePlanner(DefaultSavePlanner):
        def lookup_object(self, index):
            return shard_or_default(self.state_dict, index, super().lookup_object)

    return FlatShardSavePlanner()


class CheckpointManager:
    """Saves, finds and loads the checkpoints of ``run_dir/checkpoints``; ``identity`` must match on resume (model
    name, vocabulary)."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, dist: DistInfo, identity: dict[str, Any]) -> None:
        self.cfg, self.dir, self.dist, self.identity = cfg, run_dir / "checkpoints", dist, identity

    @property
    def at_end(self) -> bool:
        """Whether a run ends with a checkpoint of its last step: whenever checkpoints are on (``--save-every`` or
        ``--save-minutes``), so a finished run can be continued or exported, even one too short to have saved."""
        return bool(self.cfg.save_every or self.cfg.save_minutes)

    def due(self, step: int) -> bool:
        return self.cfg.save_every > 0 and step % self.cfg.save_every == 0

    def save(self, strategy: Strategy, trainer_state: dict[str, Any]) -> Path:
        """Write a complete checkpoint for ``trainer_state["step"]`` (a collective). A full disk on any rank raises
        :class:`DiskFault` on every rank together: ``step_N.tmp`` is removed and ``latest`` still names the previous
        checkpoint."""
        step = trainer_state["step"]
        final = self.dir / step_name(step)
        tmp = self.dir / f"{step_name(step)}.tmp"
        previous = self.latest_name()
        kept = (f"the partial checkpoint was removed and {previous}, the newest complete one, is kept" if previous
                else "the partial checkpoint was removed (no earlier checkpoint exists)")
        needed = tree_bytes(self.dir.parent / previous) if previous and self.dist.is_main else None

        def attempt(write) -> DiskFault | None:
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                write()
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
                fault = disk_fault(exc, final, "checkpoint", kept, needed)
                if fault is None:  # another failure (out of memory: every rank's DCP write raises it together)
                    if self.dist.is_main:
                        remove_tree(tmp)
                    raise
                return fault
            return None

        # Each stage ends in an agreement in place of a barrier: a fault on any rank ends every rank together.
        self._agree((pending() or attempt(lambda: self._begin(tmp))) if self.dist.is_main else None, tmp)
        self._agree(attempt(lambda: self.write_shards(strategy, tmp, kept)), tmp)  # every rank's shards are on disk
        self._agree(attempt(lambda: self._complete(tmp, final, trainer_state)) if self.dist.is_main else None, tmp)
        return final

    def _begin(self, tmp: Path) -> None:
        remove_tree(tmp)
        tmp.mkdir(parents=True)

    def _complete(self, tmp: Path, final: Path, trainer_state: dict[str, Any]) -> None:
        """Rank 0, once every rank's files are on disk: trainer.json and the manifest, then the rename and
        ``latest``."""
        meta = {**trainer_state, **self.identity, "world_size": self.dist.world_size, "format": 1}
        (tmp / "trainer.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        write_manifest(tmp)  # after the barrier: it covers every rank's files, and trainer.json
        remove_tree(final)
        tmp.replace(final)
        try:
            write_atomic(self.dir / POINTER, final.name + "\n", what="checkpoint pointer", kept="")
        except BaseException:
            remove_tree(final)  # complete but never `latest`: removed like a partial one
            raise
        self._prune()

    def _agree(self, fault: DiskFault | None, tmp: Path) -> None:
        """Every rank learns whether any rank met a disk fault; if one did, all raise it (rank 0 prints it)."""
        texts = [str(fault) if fault is not None else None]
        if tdist.is_initialized() and self.dist.world_size > 1:
            texts = [None] * self.dist.world_size
            tdist.all_gather_object(texts, str(fault) if fault is not None else None)
        first = next((t for t in texts if t), None)
        if first is None:
            return
        take_pending()  # raised now, with the message held or this one
        if self.dist.is_main:
            remove_tree(tmp)
        raise DiskFault(first)

    def write_shards(self, strategy: Strategy, folder: Path, kept: str = "") -> None:
        """This rank's part of a checkpoint into ``folder``: its shards of model and optimizer, and its RNG states.

        A save needs no more memory than training plus the largest piece; should even that not fit, the line says
        so (``kept``: what the failed save leaves).
        """
        import torch.distributed.checkpoint as dcp  # 1 s of imports a run that never saves need not pay

        state = strategy.checkpoint_state()
        held = state_bytes(state)
        with memory_for(f"checkpoint {folder.name.removesuffix('.tmp')} ({size_text(held)} of model and optimizer "
                        f"state on this rank, a tensor at a time)",
                        f"{kept or 'the partial checkpoint is removed at the next start'}; a save needs little beyond "
                        "what training holds: free memory on this host, or pick a strategy that shards or offloads "
                        "more (see `scale-ocr estimate-memory`)"):
            dcp.save(state, checkpoint_id=str(folder), planner=_save_planner())
        torch.save(rng_state(), folder / f"rng_rank{self.dist.rank}.pt")

    def _prune(self) -> None:
        if self.cfg.keep_last <= 0:
            return
        done = sorted(p for p in self.dir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in done[: -self.cfg.keep_last]:
            remove_tree(old)

    def latest_name(self) -> str | None:
        """``checkpoints/step_N`` of this run's newest complete checkpoint, None before the first."""
        path = latest_checkpoint(self.dir)
        return f"{self.dir.name}/{path.name}" if path is not None else None

    def clean_partial(self) -> list[str]:
        """Remove ``step_N.tmp`` folders that an interrupted save left (rank 0, holding the run lock)."""
        removed = []
        for tmp in sorted(self.dir.glob("step_*.tmp")):
            if tmp.is_dir() or tmp.is_symlink():
                remove_tree(tmp)
                removed.append(tmp.name)
        return removed

    def resolve(self) -> Path | None:
        """The checkpoint ``--resume`` names: None for a fresh start (``none``, or ``auto`` with nothing saved)."""
        spec = self.cfg.resume
        if spec in (None, "none"):
            return None
        if spec == "auto":
            return latest_checkpoint(self.dir)
        path = checkpoint_folder(Path(spec))  # a run directory's or a checkpoints directory's newest, or step_N
        if not (path / "trainer.json").is_file() or not (path / ".metadata").is_file():
            raise UserError(f"--resume {spec}: no complete checkpoint there (trainer.json and .metadata expected); "
                            "pass a checkpoints/step_N folder, a run directory, or `auto`")
        return path

    def load(self, path: Path, strategy: Strategy, seed: int) -> dict[str, Any]:
        """Restore model, optimizer and RNG from ``path``; returns the trainer state to continue from."""
        listed = verify_manifest(path, warn=self.dist.is_main)  # before reading anything in it
        try:
            meta = read_user_json(path / "trainer.json", what="the checkpoint's trainer.json", nan_ok=True)
        except UserError as exc:
            raise UserError(f"{exc}; the checkpoint is damaged") from None
        for key, ours in self.identity.items():
            if meta.get(key) != ours:
                raise UserError(
                    f"checkpoint {path} was trained with {key}={meta.get(key)!r}, this run uses {ours!r}; "
                    f"resume with the same {key} or start a new --output-dir"
                )
        from torch.distributed.checkpoint.api import CheckpointException

        from scale_ocr.checkpoint import safe_dcp

        state = strategy.checkpoint_load_target()  # the layout to fill, sharded as this strategy shards
        try:
            safe_dcp.load(state, path, listed)
        except UserError:
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises several types for damaged files;
            # CheckpointException (what a rank's failed read becomes) derives from BaseException
            cause = (str(exc).strip().splitlines() or [type(exc).__name__])[-1].split(". ")[0][:200]
            raise UserError(f"checkpoint {path} cannot be read ({cause}); a file in it is truncated or damaged: "
                            "resume from an earlier checkpoints/step_N") from None
        strategy.load_checkpoint_state(state)
        rng_file = path / f"rng_rank{self.dist.rank}.pt"
        if meta["world_size"] == self.dist.world_size and rng_file.is_file():
            set_rng_state(safe_dcp.load_tensors(rng_file))
        else:
            # Another world size: no saved stream belongs to this rank; derive one deterministically.
            torch.manual_seed(seed + 1 + self.dist.rank + 7919 * meta["step"])
        return meta
