"""One strategy registry: a name maps to a strategy class plus preset arguments."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from scale_ocr.config import OptimConfig, StrategyConfig, TrainConfig
from scale_ocr.distributed.process_group import DistInfo
from scale_ocr.errors import UserError
from scale_ocr.strategies.base import Strategy, shard_size


@dataclass(frozen=True)
class StrategyEntry:
    cls: type[Strategy]
    description: str
    preset: dict[str, Any] = field(default_factory=dict)


_STRATEGIES: dict[str, StrategyEntry] = {}


def register_strategy(name: str, cls: type[Strategy], description: str, **preset: Any) -> None:
    """Register ``name`` as ``cls(**preset)``; a name can be registered once."""
    if name in _STRATEGIES:
        raise ValueError(f"strategy {name!r} is registered twice")
    _STRATEGIES[name] = StrategyEntry(cls, description, dict(preset))


def list_strategies() -> dict[str, str]:
    """Registered names and their one-line descriptions."""
    return {name: entry.description for name, entry in _STRATEGIES.items()}


def strategy_entry(name: str) -> StrategyEntry:
    if name not in _STRATEGIES:
        raise UserError(f"unknown strategy {name!r}; choose one of: {', '.join(_STRATEGIES)}")
    return _STRATEGIES[name]


def check_launch(cfg: StrategyConfig, world_size: int, launcher: str) -> StrategyEntry:
    """Refuse a strategy that cannot work with this launch, before any rendezvous can hang on it."""
    entry = strategy_entry(cfg.strategy)
    limit = entry.cls.max_world_size
    if limit is not None and world_size > limit:
        raise UserError(
            f"--strategy {cfg.strategy} runs in one process, but this job has {world_size} ranks "
            f"(launched by {launcher}); start it with plain `python` or pick ddp, fsdp or zero2"
        )
    if cfg.ds_config and not entry.cls.reads_ds_config:
        raise UserError(
            f"--ds-config is read by DeepSpeed strategies only, not --strategy {cfg.strategy}; "
            "use --strategy deepspeed (or zero1/zero2/zero3) with it"
        )
    if cfg.compile and not entry.cls.compiles:
        able = ", ".join(name for name, e in _STRATEGIES.items() if e.cls.compiles)
        raise UserError(f"--compile runs under {able}, not --strategy {cfg.strategy}; pick one of those or "
                        "drop --compile")
    if cfg.shard_size is not None:
        if not entry.cls.takes_shard_size(cfg, **entry.preset):
            shipped = replace(cfg, ds_config=None)  # the strategies as shipped, not under this run's JSON
            able = ", ".join(n for n, e in _STRATEGIES.items() if e.cls.takes_shard_size(shipped, **e.preset))
            raise UserError(f"--shard-size sets the shard groups of {able}, not of --strategy {cfg.strategy}; "
                            "pick one of those or drop --shard-size")
        shard_size(cfg.shard_size, world_size, world_size, f"--strategy {cfg.strategy}")  # divides the world size
    defaults = {f.name: f.default for f in fields(StrategyConfig)}
    tuned = [f"--{n.replace('_', '-')}" for n in ("bucket_mb", "static_graph") if getattr(cfg, n) != defaults[n]]
    if tuned and not entry.cls.tunes_reducer:
        able = ", ".join(name for name, e in _STRATEGIES.items() if e.cls.tunes_reducer)
        raise UserError(f"{' and '.join(tuned)} tune{'s' if len(tuned) == 1 else ''} DDP's gradient reducer "
                        f"({able}), which --strategy {cfg.strategy} does not use; drop "
                        f"{'it' if len(tuned) == 1 else 'them'} (DeepSpeed's buckets are set in its JSON)")
    return entry


def create_strategy(cfg: StrategyConfig, dist: DistInfo, train: TrainConfig, optim: OptimConfig,
                    run_dir: Path | None = None) -> Strategy:
    """Build the strategy named by ``cfg.strategy`` and check it suits the launch; ``run_dir`` is where it
    may keep scratch files."""
    entry = check_launch(cfg, dist.world_size, dist.launcher)
    return entry.cls(cfg, dist, train, optim, run_dir=run_dir, **entry.preset)
