"""Property-based fuzzing of the configuration a run starts from (docs/faults.md, "Fuzzing").

* ``--config FILE`` (JSON or YAML, flat or by section): every field with values of every JSON/YAML type, numbers
  NaN, infinite, negative and past 64 bits, strings with NUL, lone surrogates and 300-byte path components,
  unknown keys; and files that are not YAML/JSON at all. Driven through the start-up a training run makes before
  its process group: ``parse_config`` (defaults, file, flags, the registries' resolve, the output directory),
  ``resolve_auto``, ``check_launch`` and the task.
* ``--ds-config FILE``: the shipped presets mutated (values replaced by any JSON value, ``"auto"``, NaN; keys
  removed, added, misspelt), through ``load_ds_config`` and ``resolve_ds_config`` as the DeepSpeed strategy calls
  them.

Each ends in one UserError line (:mod:`test_fuzz_oracle`) or in a config whose every value the run's own
consumers take: the optimizer and its schedule, the seeds' generators, the process group's timeout, path
names a file system can hold; and for DeepSpeed, DeepSpeed's own config parser.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import logging
import math
import os
import tempfile
import types
import typing
from pathlib import Path

import numpy as np
import torch
import yaml
from hypothesis import example, given
from hypothesis import strategies as st
from test_fuzz_oracle import outcome, warnings_checked

from scale_ocr.cli.args import parse_config
from scale_ocr.config import SECTIONS, RunConfig
from scale_ocr.distributed.process_group import peek_launch
from scale_ocr.models.factory import list_models
from scale_ocr.optim import build_optimizer_spec, default_warmup, lr_factor
from scale_ocr.planning.auto import resolve_auto
from scale_ocr.strategies.ds_config import keep_fp32_weights, load_ds_config, preset_path, resolve_ds_config
from scale_ocr.strategies.ds_keys import top_level_keys, zero_keys
from scale_ocr.strategies.nvme import nvme_sections
from scale_ocr.strategies.registry import check_launch, list_strategies
from scale_ocr.tasks import create_task

HINTS = {f.name: typing.get_type_hints(section)[f.name] for section in SECTIONS.values()
         for f in dataclasses.fields(section)}
PATH_FIELDS = ("train_path", "val_path", "vocab_file", "data_cache", "init_from", "ds_config", "nvme_path",
               "output_dir", "resume")
UNBOUNDED = ("max_weight_growth",)  # a float that may be infinite: "inf: no bound"

ODD_TEXT = st.sampled_from(["", "\x00", "a\x00b", "\ud800", "a" * 300, "a/" * 3000, "auto", "none", "1e-3", ".nan",
                            "-inf", "32x128", "0x0", "yes", "\x1b[2J\n", "\u202e", "~", "ddp", "zero3_nvme"])
NUMBERS = st.one_of(st.integers(-3, 70), st.integers(), st.integers(2**31, 10**30), st.floats(),
                    st.sampled_from([0.5, 1e-3, 1e300, -0.0, 2**63, 2**64]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, ODD_TEXT, st.text(max_size=10))
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6), inner, max_size=3), max_leaves=6)


def _field_values(name: str) -> st.SearchStrategy:
    """Values a user might write for one field: its choices and kinds first, then anything."""
    likely = {"arch": st.sampled_from(list_models()), "strategy": st.sampled_from([*list_strategies(), "auto"]),
              "input_size": st.lists(st.integers(-1, 9000), min_size=2, max_size=2)}
    return st.one_of(likely.get(name, SCALARS), ANY)


FIELDS = st.sampled_from(sorted(HINTS))
FLAT = st.dictionaries(FIELDS, st.none(), max_size=5).flatmap(
    lambda keys: st.fixed_dictionaries({k: _field_values(k) for k in keys}))
CONFIG = st.one_of(
    FLAT,
    st.builds(lambda flat, section: {section: flat}, FLAT, st.sampled_from(sorted(SECTIONS))),
    st.builds(lambda flat, extra: {**flat, **extra}, FLAT, st.dictionaries(st.text(max_size=8), ANY, max_size=2)),
    ANY,
)


def _path_ok(value: str) -> bool:
    """A name a file system can hold: encodable, no NUL, no component over 255 bytes, under PATH_MAX."""
    try:
        raw = os.fsencode(value)
    except UnicodeEncodeError:
        return False
    return b"\x00" not in raw and len(raw) < 4096 and all(len(part) <= 255 for part in raw.split(b"/"))


def _typed(name: str, value: object) -> bool:
    """``value`` has the type the field declares (``int | None``, ``tuple[str, ...]``, ``tuple[int, int]``)."""
    hint = HINTS[name]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    if value is None:
        return union and type(None) in typing.get_args(hint)
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    for kind in kinds:
        origin = typing.get_origin(kind)
        if origin is tuple:
            inner = typing.get_args(kind)[0]
            if isinstance(value, tuple) and all(isinstance(v, inner) and not isinstance(v, bool) for v in value):
                return True
        elif kind is float and isinstance(value, float):
            return math.isfinite(value) or name in UNBOUNDED
        elif kind is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        elif kind in (str, bool) and type(value) is kind:
            return True
    return False


def _check_accepted(cfg: RunConfig) -> None:
    """Every value of an accepted config is one the run's consumers take."""
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            assert _typed(f.name, value), (f.name, value)
            if f.name in PATH_FIELDS and value is not None:
                assert all(_path_ok(v) for v in (value if isinstance(value, tuple) else (value,))), (f.name, value)
    build_optimizer_spec(cfg.optim).build(torch.nn.Linear(2, 2))  # torch checks lr, weight decay
    factor = lr_factor(cfg.optim.sched, 100, default_warmup(cfg.optim, 100))
    assert all(math.isfinite(factor(s)) and factor(s) >= 0 for s in (0, 1, 50, 99))
    seed = cfg.train.seed
    np.random.default_rng([seed, 0])  # synthetic data
    torch.Generator().manual_seed(seed * 1000 + 7)  # the loader's generator, rank 7
    torch.Generator().manual_seed(seed + 1 + 7 + 7919 * 10**6)  # a resumed rank's augmentation stream
    datetime.timedelta(seconds=cfg.strategy.dist_timeout + 60)  # the process group's timeout


def _start(path: str, out: str | None) -> RunConfig:
    """What ``scale_ocr/train.py`` does with its command line before it starts a process group."""
    flags = [f"--output-dir={out}"] if out is not None else []  # "=": a value such as "-inf" is not a flag
    cfg = resolve_auto(parse_config(["--config", path, *flags]), *peek_launch())
    check_launch(cfg.strategy, *peek_launch())
    create_task(cfg.model)
    return cfg


def _write(tmp: str, data: object, as_yaml: bool) -> str:
    path = Path(tmp) / ("run.yaml" if as_yaml else "run.json")
    text = yaml.safe_dump(data, allow_unicode=False) if as_yaml else json.dumps(data)
    path.write_text(text, encoding="utf-8")
    return str(path)


@given(data=CONFIG, as_yaml=st.booleans(), out=st.one_of(st.just("run"), ODD_TEXT))
@example(data={"output_dir": "a\x00b"}, as_yaml=False, out="run")  # a NUL no file name can hold
@example(data={}, as_yaml=False, out="a" * 300)  # a name longer than a file system allows (ENAMETOOLONG)
@example(data={"seed": -1}, as_yaml=True, out="run")  # numpy's generators take no negative seed
@example(data={"wd": -1.0}, as_yaml=False, out="run")  # torch's AdamW refuses a negative weight decay
@example(data={"dist_timeout": 1e300}, as_yaml=False, out="run")  # past what a timedelta holds
@example(data={"gpu_memory_cap_gb": float("nan")}, as_yaml=False, out="run")
@example(data={"vocab_file": "\n"}, as_yaml=False, out="run")  # echoed raw in the message
def test_config_file(data, as_yaml, out):
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(tmp, data, as_yaml)
        # A file's output_dir is used as given (nothing is created before the process group); without one, the
        # flag takes generated values too.
        out = None if "output_dir" in json.dumps(data) else str(Path(tmp) / out) if out == "run" else out
        cfg, _ = outcome(_start, path, out)
        if cfg is not None:
            _check_accepted(cfg)


@given(text=st.one_of(st.text(max_size=60), st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
                      st.sampled_from(["lr: [", "{a: 1", "- 1\n- 2", "lr: !!python/object:os.system x", "&a [*a]",
                                       "lr: 1e-3\nlr: 2e-3", "a" * 5000, "[" * 1200, "x: " + "9" * 5000])),
       as_yaml=st.booleans())
def test_config_file_text(text, as_yaml):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("run.yaml" if as_yaml else "run.json")
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        cfg, _ = outcome(_start, str(path), str(Path(tmp) / "run"))
        if cfg is not None:
            _check_accepted(cfg)


# --- DeepSpeed JSON ----------------------------------------------------------------------------------------------

PRESETS = ("zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_nvme")
KNOWN = sorted(top_level_keys() | zero_keys() | {"fp16", "bf16", "optimizer", "scheduler", "enabled", "params",
                                                  "type", "device", "nvme_path", "lr", "stage"})
DS_VALUES = st.one_of(st.just("auto"), SCALARS, ANY,
                      st.fixed_dictionaries({}, optional={"enabled": SCALARS, "device": SCALARS, "type": SCALARS,
                                                          "params": ANY, "nvme_path": SCALARS, "stage": NUMBERS}))
KW = dict(source="ds.json", micro_batch=8, grad_accum=2, world_size=1, clip_grad=1.0, lr=1e-3, weight_decay=0.01)


def _nodes(node: dict) -> list[dict]:
    """Every object in a JSON tree, the root first."""
    found = [node]
    for v in node.values():
        if isinstance(v, dict):
            found += _nodes(v)
    return found


@st.composite
def ds_configs(draw) -> dict:
    """A shipped preset (or nothing), changed one to three times: a value replaced, a key removed or added."""
    name = draw(st.sampled_from((*PRESETS, None)))
    cfg = copy.deepcopy(load_ds_config(preset_path(name))) if name else {}
    for _ in range(draw(st.integers(1, 3))):
        node = draw(st.sampled_from(_nodes(cfg)))
        action = draw(st.sampled_from(["set", "set", "add", "remove"]))
        if action == "remove" and node:
            del node[draw(st.sampled_from(sorted(node)))]
        elif action == "set" and node:
            node[draw(st.sampled_from(sorted(node)))] = draw(DS_VALUES)
        else:
            node[draw(st.one_of(st.sampled_from(KNOWN), st.text(max_size=8)))] = draw(DS_VALUES)
    return cfg


class _WithBatchNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(2)


def _deepspeed_parses(cfg: dict) -> None:
    """DeepSpeed's own parser, which ``deepspeed.initialize`` runs first, takes the resolved config."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        DeepSpeedConfig(copy.deepcopy(cfg))
    finally:
        logger.setLevel(level)


@given(raw=ds_configs(), precision=st.sampled_from(["fp32", "bf16", "fp16"]))
@example(raw={"zero_optimization": []}, precision="fp32")  # a section that is not an object
@example(raw={"fp16": 5}, precision="fp16")
@example(raw={"optimizer": {"type": "AdamW", "params": []}}, precision="fp32")
@example(raw={"zero_optimization": {"stage": 7}}, precision="fp32")  # DeepSpeed's own value checks
@example(raw={"bf16": {"enabled": "false"}}, precision="fp32")  # a string DeepSpeed reads as true
@example(raw={"optimizer": {"type": "AdamW", "params": {"eps": float("nan")}}}, precision="fp32")  # DeepSpeed takes it
def test_ds_config(raw, precision):
    with tempfile.TemporaryDirectory() as tmp, warnings_checked():
        path = Path(tmp) / "ds.json"
        path.write_text(json.dumps(raw), encoding="utf-8")
        loaded, _ = outcome(load_ds_config, path)
        if loaded is None:
            return
        cfg, _ = outcome(resolve_ds_config, loaded, **KW, precision=precision, nvme_default=str(Path(tmp) / "nvme"),
                         device_type="cpu")
        if cfg is None:
            return
        text = json.dumps(cfg, allow_nan=False)  # what DeepSpeed is given is strict JSON
        assert '"auto"' not in text, text
        assert cfg["train_batch_size"] == 16 and cfg["train_micro_batch_size_per_gpu"] == 8
        assert cfg["gradient_accumulation_steps"] == 2 and cfg["gradient_clipping"] == 1.0
        halves = (cfg["fp16"]["enabled"], cfg["bf16"]["enabled"])
        assert all(isinstance(h, bool) for h in halves) and not all(halves), halves
        assert all(isinstance(s["nvme_path"], str) for s in nvme_sections(cfg))
        keep_fp32_weights(cfg, loaded, _WithBatchNorm())
        _deepspeed_parses(cfg)


def test_vocab_file_that_is_not_utf8(tmp_path):
    vocab = tmp_path / "chars.txt"
    vocab.write_bytes("abcé".encode("latin-1"))
    _, message = outcome(_start, _write(str(tmp_path), {"vocab_file": str(vocab)}, False), str(tmp_path / "run"))
    assert message == (f"--vocab-file {vocab} is not UTF-8 text (byte 0xe9 at offset 3); save it as UTF-8, or pass "
                       "the right file")
