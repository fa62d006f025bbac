"""A user's DeepSpeed JSON checked against the installed DeepSpeed, in one line before anything starts (DeepSpeed
itself refuses later, with a traceback on every rank).

``zero_optimization`` keys are ``DeepSpeedZeroConfig``'s fields and aliases. Top-level keys are those
``DeepSpeedConfig`` asks its dict for (recorded, so a new release is followed without a list) plus
:data:`READ_BY_INITIALIZE`; an unknown one is only a warning, because a key read on a branch the recording did not
take would be refused wrongly, and configs carry ``"_comment"`` keys that DeepSpeed ignores.
"""

from __future__ import annotations

import copy
import difflib
import functools
import logging
import os
from typing import Any

from scale_ocr.errors import UserError, first_line, printable, say, shown

#: Top-level keys that ``deepspeed.initialize`` reads from the config itself (DeepSpeed 0.19.8,
#: ``deepspeed/__init__.py``), which ``DeepSpeedConfig`` does not: the data- and sequence-parallel mesh sizes.
#: ``tests/unit/test_ds_keys.py`` fails when ``initialize`` reads a key that is neither here nor recorded.
READ_BY_INITIALIZE = ("data_parallel_size", "sequence_parallel_size")


class _Recorder(dict):
    """A dict that adds every key looked up in it to ``asked`` (``get``, ``[]``, ``in``, ``in .keys()``)."""

    def __init__(self, asked: set[str], **items: Any) -> None:
        super().__init__(**items)
        self.asked = asked

    def get(self, key: Any, default: Any = None) -> Any:
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.asked.add(key)
        return super().__contains__(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.asked.add(key)
        return super().setdefault(key, default)

    def keys(self) -> Any:
        return _RecordingKeys(self.asked, {k: None for k in dict.__iter__(self)})

    def __copy__(self) -> _Recorder:  # DeepSpeedConfig parses a copy of the dict it is given
        return self


class _RecordingKeys(dict):
    def __init__(self, asked: set[str], items: dict) -> None:
        super().__init__(items)
        self.asked = asked

    def __contains__(self, key: Any) -> bool:
        self.asked.add(key)
        return super().__contains__(key)


@functools.lru_cache(maxsize=1)
def top_level_keys() -> frozenset[str]:
    """Every top-level key the installed DeepSpeed reads (including those it removed and refuses)."""
    import logging

    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    asked: set[str] = set()
    level = logger.level
    logger.setLevel(logging.WARNING)  # its "Config mesh_device ..." info line
    try:
        DeepSpeedConfig(_Recorder(asked, train_batch_size=1, train_micro_batch_size_per_gpu=1,
                                  gradient_accumulation_steps=1))
    finally:
        logger.setLevel(level)
    return frozenset(k for k in asked if isinstance(k, str)) | frozenset(READ_BY_INITIALIZE)


@functools.lru_cache(maxsize=1)
def zero_keys() -> frozenset[str]:
    """Every key ``zero_optimization`` may hold: ``DeepSpeedZeroConfig``'s fields and their aliases."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    return frozenset(fields) | frozenset(f.alias for f in fields.values() if f.alias)


def closest(key: str, known: frozenset[str]) -> str:
    """The known key nearest to ``key`` (difflib's ratio), as a message suggests it."""
    return (difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.0) or ["?"])[0]


def _shown(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 60 else text[:60] + "…"


#: Sections scale-ocr reads or fills before DeepSpeed sees the JSON: each must be an object where present.
OBJECTS = ("fp16", "bf16", "zero_optimization", "zero_optimization.offload_param",
           "zero_optimization.offload_optimizer", "optimizer", "optimizer.params")
_KINDS = {bool: "true or false", int: "a number", float: "a number", str: "a string", list: "an array",
          type(None): "null", dict: "an object"}


def check_shape(raw: dict[str, Any], source: str) -> None:
    """Refuse a section of :data:`OBJECTS` that is not an object, and a 16-bit ``enabled`` that is not a boolean."""
    for dotted in OBJECTS:
        *parents, key = dotted.split(".")
        node: Any = raw
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node and not isinstance(node[key], dict):
            raise UserError(f"{source}: {dotted} is {_KINDS.get(type(node[key]), 'not JSON')}, not an object; write it "
                            "as {...} (see ds_configs/) or remove it")
    for half in ("fp16", "bf16"):
        enabled = raw.get(half, {}).get("enabled", "auto")
        if not isinstance(enabled, bool) and enabled != "auto":
            why = " (DeepSpeed would read any string, \"false\" too, as true)" if isinstance(enabled, str) else ""
            raise UserError(f"{source}: {half}.enabled is {shown(enabled)}; write true, false or \"auto\"{why}")


#: DeepSpeed's pydantic model -> the JSON section it reads, for messages.
SECTION_OF = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedFP16Config": "fp16", "DeepSpeedBF16Config": "bf16",
              "DeepSpeedActivationCheckpointingConfig": "activation_checkpointing",
              "DeepSpeedCommsConfig": "comms_logger", "DeepSpeedFlopsProfilerConfig": "flops_profiler"}


def parsed_by_deepspeed(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """``cfg`` once the installed DeepSpeed's own parser takes it, else the first value it refuses as one line.

    ``train_batch_size`` is left out of the trial: it was checked against the job's world size, which a parser
    without a process group takes to be 1.
    """
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.utils import logger
        from pydantic import ValidationError
    except ImportError:
        return cfg
    trial = copy.deepcopy(cfg)
    trial.pop("train_batch_size", None)
    level = logger.level
    logger.setLevel(logging.ERROR)  # its info and warning lines, printed again by deepspeed.initialize
    try:
        DeepSpeedConfig(trial)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = printable(".".join(str(p) for p in (SECTION_OF.get(exc.title, exc.title), *err["loc"])), 120)
        raise UserError(f"{source}: DeepSpeed refuses {where} = {shown(err.get('input'), 60)}: "
                        f"{printable(err['msg'], 200)}; fix the value (ds_configs/README.md explains the presets' "
                        "values)") from None
    except Exception as exc:  # noqa: BLE001 - its parser asserts and indexes what it is given: the user's JSON
        raise UserError(f"{source}: DeepSpeed cannot read this config ({type(exc).__name__}: "
                        f"{printable(first_line(exc), 200)}); fix the value it names") from None
    finally:
        logger.setLevel(level)
    return cfg


def check_keys(raw: dict[str, Any], source: str) -> None:
    """Refuse unknown or removed ``zero_optimization`` keys and removed top-level keys (with the closest known key or
    DeepSpeed's own reason); warn of unknown top-level ones. Without DeepSpeed only :func:`check_shape` runs."""
    check_shape(raw, source)
    try:
        from scale_ocr.strategies.deepspeed_internals import removed_config_keys

        known, zero = top_level_keys(), zero_keys()
        removed_top, removed_zero = removed_config_keys()
    except ImportError:
        return
    section = raw.get("zero_optimization")
    for where, keys, allowed, removed in (("", raw, known, removed_top),
                                          ("zero_optimization.", section if isinstance(section, dict) else {},
                                           zero, removed_zero)):
        for key in keys:
            if key in removed:
                raise UserError(f"{source}: {_shown(where + key)}: {removed[key].strip()}")
            if key not in allowed and where:
                raise UserError(f"{source}: unknown key {_shown(where + key)}; did you mean "
                                f"{where + closest(key, allowed)!r}? (DeepSpeed refuses unknown zero_optimization "
                                "keys)")
    unknown = [key for key in raw if key not in known]
    if unknown and os.environ.get("RANK", "0") == "0":
        say(f"scale-ocr: warning: {printable(source, 400)}: DeepSpeed ignores the unknown top-level "
              f"key{'s' * (len(unknown) > 1)} "
              f"{', '.join(f'{_shown(k)} (did you mean {closest(k, known)!r}?)' for k in unknown[:3])}"
              f"{f' and {len(unknown) - 3} more' if len(unknown) > 3 else ''}; remove or respell "
              f"{'them' if len(unknown) > 1 else 'it'}", err=True)
