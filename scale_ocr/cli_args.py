"""Command-line parsing built from the config dataclasses' field metadata."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

from scale_ocr.config import SECTIONS, RunConfig
from scale_ocr.errors import UserError


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_input_size(text: str) -> tuple[int, int]:
    parts = text.lower().replace(",", "x").split("x")
    try:
        nums = [int(p) for p in parts if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HxW, e.g. 32x128") from None
    if len(nums) == 1:
        return nums[0], 4 * nums[0]
    if len(nums) == 2:
        return nums[0], nums[1]
    raise argparse.ArgumentTypeError(f"{text!r} is not HxW, e.g. 32x128")


def _base_type(annotation: Any) -> Any:
    """``int | None`` -> int, ``tuple[str, ...]`` -> str."""
    hint = annotation
    if isinstance(hint, str):
        hint = eval(hint, {"tuple": tuple})  # noqa: S307 - our own annotations only
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _base_type(args[0])
    if origin is tuple:
        return typing.get_args(hint)[0]
    return hint


def build_parser(prog: str = "scale-ocr train") -> argparse.ArgumentParser:
    """The training CLI: every config field becomes a flag, grouped by section."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Train an OCR model under any distributed strategy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only flags the user gave override the config file
    )
    parser.add_argument("--config", help="JSON or YAML file with config values (flat or by section)")
    # Injected by the deepspeed launcher; the value is also in $LOCAL_RANK, which we read instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, dest="local_rank", help=argparse.SUPPRESS)
    parser.add_argument("--amp", action="store_const", const="bf16", dest="precision",
                        help="docTR spelling of mixed precision: same as --precision bf16")
    parser.add_argument("--wb", action="store_const", const="auto", dest="wandb_mode",
                        help="docTR's W&B switch; scale-ocr always logs to W&B (see --wandb-mode)")
    for section_name, section in SECTIONS.items():
        group = parser.add_argument_group(section_name)
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            meta = dict(f.metadata)
            kw = dict(meta["argparse"])
            flags = list(meta["flags"]) or [_flag(f.name)]
            if flags == ["arch"]:
                group.add_argument("arch", nargs="?", help=meta["help"], default=argparse.SUPPRESS)
                continue
            if f.name == "input_size":
                kw["type"] = _parse_input_size
            elif "action" not in kw:
                kw.setdefault("type", _base_type(hints[f.name]))
            default = f.default if f.default is not dataclasses.MISSING else None
            group.add_argument(*flags, dest=f.name, help=f"{meta['help']} (default: {default})", **kw)
            for alias in meta["aliases"]:
                group.add_argument(alias, dest=f.name, help=argparse.SUPPRESS, **kw)
    return parser


def _load_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path} does not exist")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - any parse error is the user's file
        raise UserError(
            f"--config {path} is not valid {p.suffix.lstrip('.') or 'JSON'}: {exc}".splitlines()[0]
        ) from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path} must hold a mapping of config fields")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    known = {f.name for s in SECTIONS.values() for f in dataclasses.fields(s)}
    unknown = sorted(set(flat) - known)
    if unknown:
        raise UserError(f"--config {path} has unknown keys {unknown}; see `scale-ocr train --help`")
    for k in ("train_path", "val_path", "input_size", "wandb_tags"):
        if isinstance(flat.get(k), list):
            flat[k] = tuple(flat[k])
        elif isinstance(flat.get(k), str) and k != "input_size":
            flat[k] = (flat[k],)
    if isinstance(flat.get("input_size"), (str, int)):
        flat["input_size"] = _parse_input_size(str(flat["input_size"]))
    return flat


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """Defaults, then ``--config FILE``, then flags, into one frozen :class:`RunConfig`."""
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    if "config" in ns:
        values.update(_load_file(ns.pop("config")))
    ns.pop("local_rank", None)
    for k in ("train_path", "val_path", "wandb_tags"):
        if k in ns:
            ns[k] = tuple(ns[k])
    values.update(ns)
    return RunConfig.from_flat(values)
