"""DeepSpeed JSON: load a preset or the user's file and fill ``"auto"`` from the run config.

The convention is Hugging Face Trainer's: any value written ``"auto"`` takes the run's setting, and
an explicit value that contradicts a flag is an error rather than a silent override.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from scale_ocr.disk import JSON_LIMIT, read_user_text
from scale_ocr.errors import JSON_ERRORS, UserError, json_problem, printable, shown
from scale_ocr.strategies.base import shard_size
from scale_ocr.strategies.ds_keys import check_keys, parsed_by_deepspeed
from scale_ocr.strategies.nvme import nvme_sections

PRESET_DIRS = (
    Path(__file__).resolve().parents[2] / "ds_configs",  # source checkout / editable install
    Path(__file__).resolve().parents[1] / "ds_configs",  # wheel install (package data)
)


def preset_path(name: str) -> Path:
    """The shipped JSON for a preset such as ``zero3_offload``."""
    for d in PRESET_DIRS:
        if (d / f"{name}.json").is_file():
            return d / f"{name}.json"
    raise UserError(f"DeepSpeed preset {name}.json not found in {', '.join(map(str, PRESET_DIRS))}; reinstall "
                    "scale-ocr")


def _not_json(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number, nor a DeepSpeed setting")  # Python's json reads NaN, Infinity


def load_ds_config(path: str | Path) -> dict[str, Any]:
    """Parse a DeepSpeed JSON file, turning any problem into one sentence about the file."""
    p = Path(path)
    try:
        data = json.loads(read_user_text(p, what="--ds-config", limit=JSON_LIMIT, follow=True),
                          parse_constant=_not_json)
    except JSON_ERRORS as exc:
        raise UserError(
            f"--ds-config {p} is not valid JSON: {json_problem(exc)}; "
            "fix the file (DeepSpeed configs are strict JSON: no comments or trailing commas)"
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"--ds-config {p} must hold a JSON object of DeepSpeed settings")
    return data


def _fill(node: dict[str, Any], key: str, value: Any, source: str, flag: str) -> None:
    """Set ``node[key]`` to ``value`` if it is "auto" or absent; refuse a contradicting explicit value."""
    current = node.get(key, "auto")
    if current == "auto":
        node[key] = value
    elif current != value and not (isinstance(current, (int, float)) and isinstance(value, (int, float))
                                   and float(current) == float(value)):
        raise UserError(
            f"{source}: {key}={shown(current)} contradicts {flag} (which gives {value!r}); "
            f'set it to "auto" or change the flag'
        )


def resolve_ds_config(raw: dict[str, Any], *, source: str, micro_batch: int, grad_accum: int, world_size: int,
                      clip_grad: float, precision: str, lr: float, weight_decay: float,
                      nvme_path: str | None = None, nvme_default: str | None = None, device_type: str = "cuda",
                      shard_size: int | None = None, local_world: int = 1) -> dict[str, Any]:
    """A copy of ``raw`` with every ``"auto"`` filled and the batch arithmetic checked.

    fp16/bf16 ``"auto"`` follow ``--precision``: DeepSpeed then holds 16-bit weights with fp32 master
    partitions, the layout ZeRO's memory savings are defined for (with fp32 weights it still clones an fp32 master);
    autocast stays on around the forward, so the CTC loss is still computed in fp32. Models with BatchNorm are the
    exception (see :func:`keep_fp32_weights`).

    An NVMe section's ``nvme_path`` follows ``--nvme-path``, else (when "auto") ``nvme_default``, the run's own
    folder. ``overlap_comm`` "auto" is on where ranks have a device and off on CPU ranks, which have no second stream
    to overlap on. ``zero_hpz_partition_size`` "auto": see :func:`fill_hpz`.
    """
    check_keys(raw, source)  # unknown or removed keys, against the installed DeepSpeed's own config classes
    cfg = copy.deepcopy(raw)
    _fill(cfg, "train_micro_batch_size_per_gpu", micro_batch, source, "--batch-size")
    _fill(cfg, "gradient_accumulation_steps", grad_accum, source, "--grad-accum")
    _fill(cfg, "train_batch_size", micro_batch * grad_accum * world_size, source,
          "--batch-size x --grad-accum x world size")
    _fill(cfg, "gradient_clipping", float(clip_grad), source, "--clip-grad")
    fp16 = cfg.setdefault("fp16", {})
    if fp16.get("enabled", "auto") == "auto":
        fp16["enabled"] = precision == "fp16"
    bf16 = cfg.setdefault("bf16", {})
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = precision == "bf16"
    if fp16["enabled"] and bf16["enabled"]:
        raise UserError(f"{source}: fp16 and bf16 are both enabled; enable at most one")
    if "scheduler" in cfg:
        raise UserError(
            f"{source}: remove the \"scheduler\" section; scale-ocr sets the learning rate itself (--sched, --lr)"
        )
    zero = cfg.get("zero_optimization")
    if isinstance(zero, dict) and zero.get("overlap_comm") == "auto":
        zero["overlap_comm"] = device_type != "cpu"
    fill_hpz(zero if isinstance(zero, dict) else {}, source, shard_size, world_size, local_world)
    for section in nvme_sections(cfg):
        if nvme_path is not None:
            _fill(section, "nvme_path", nvme_path, source, "--nvme-path")
        elif section.get("nvme_path", "auto") == "auto" and nvme_default is not None:
            section["nvme_path"] = nvme_default
    opt = cfg.get("optimizer")
    if isinstance(opt, dict):
        params = opt.setdefault("params", {})
        for key, value in (("lr", lr), ("weight_decay", weight_decay), ("betas", [0.9, 0.999]), ("eps", 1e-8)):
            if params.get(key, "auto") == "auto":
                params[key] = value
    leftover = _find_auto(cfg)
    if leftover:
        raise UserError(f"{source}: no run setting fills \"auto\" at {printable(leftover, 200)}; give it a value")
    return parsed_by_deepspeed(cfg, source)  # DeepSpeed's own value checks, before any process group or model


def fill_hpz(zero: dict[str, Any], source: str, flag: int | None, world: int, local_world: int) -> None:
    """Fill and check ``zero_hpz_partition_size``: ZeRO++ hpZ's secondary weight partition over that many ranks.
    "auto" is ``--shard-size`` (``flag``) or the ranks per node; DeepSpeed turns hpZ off at 1, silently."""
    key = "zero_hpz_partition_size"
    if key not in zero:
        if flag is not None:
            raise UserError(f"{source}: --shard-size sets zero_optimization.{key} (ZeRO++ hpZ), which this JSON does "
                            f'not have; add "{key}": "auto" (as ds_configs/zero3_hpz.json does) or drop --shard-size')
        return
    if zero[key] == "auto":
        zero[key] = shard_size(flag, world, local_world, source)
        if zero[key] == 1:
            why = "--shard-size 1" if flag else "one rank per node"
            raise UserError(f'{source}: {key} "auto" is 1 ({why}), which turns ZeRO++ hpZ off; pass --shard-size 2 '
                            "or more, or use --strategy zero3")
    elif flag is not None:
        _fill(zero, key, flag, source, "--shard-size")
    value = zero[key]
    if isinstance(value, int) and value > 1:
        if world % value:
            raise UserError(f"{source}: {key} {value} does not divide the {world} ranks of this job; give a divisor "
                            f'of {world}, or "auto" (--shard-size, else the ranks per node)')
        if zero.get("stage") != 3:
            raise UserError(f"{source}: {key} {value} needs ZeRO stage 3 (hpZ partitions ZeRO-3's weights); "
                            f"set \"stage\": 3 or remove {key}")


def keep_fp32_weights(cfg: dict[str, Any], raw: dict[str, Any], model) -> bool:
    """Turn DeepSpeed's 16-bit weights off again for a model with BatchNorm when they came from "auto"; True if it did.

    DeepSpeed casts the whole module, BatchNorm's running statistics included, while autocast computes BatchNorm in
    fp32: the two cannot run together, and bf16 running statistics drift.
    """
    from scale_ocr.precision import has_batchnorm

    if not has_batchnorm(model):
        return False
    changed = False
    for key in ("fp16", "bf16"):
        if cfg[key]["enabled"] and raw.get(key, {}).get("enabled", "auto") == "auto":
            cfg[key]["enabled"] = False
            changed = True
    return changed


def _find_auto(node: Any, path: str = "") -> str | None:
    if node == "auto":
        return path or "<root>"
    if isinstance(node, dict):
        for k, v in node.items():
            found = _find_auto(v, f"{path}.{k}" if path else k)
            if found:
                return found
    return None
