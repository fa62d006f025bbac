"""Command-line parsing built from the config dataclasses' field metadata."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, NoReturn

from scale_ocr.config import SECTIONS, RunConfig
from scale_ocr.disk import JSON_LIMIT, read_user_text
from scale_ocr.errors import UserError
from scale_ocr.run.resolve import resolve
from scale_ocr.run.run_dir import check_output_dir


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_input_size(text: str) -> tuple[int, int]:
    parts = text.lower().replace(",", "x").split("x")
    try:
        nums = [int(p) for p in parts]  # int() takes the spaces around a number, not an empty part ("32x")
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


def _argparse_kw(f: dataclasses.Field, hints: dict[str, Any]) -> dict[str, Any]:
    """``add_argument`` keywords for a config field: its metadata, plus a ``type`` from its annotation."""
    kw = dict(f.metadata["argparse"])
    if f.name == "input_size":
        kw["type"] = parse_input_size
    elif "action" not in kw:
        kw.setdefault("type", _base_type(hints[f.name]))
    return kw


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a refused flag is a :class:`UserError`: under a launcher every rank parses the same command line,
    and argparse's own refusal (a usage line, then the error) would be printed by each rank; a UserError is one line,
    printed by rank 0 alone (:func:`scale_ocr.errors.report_user_errors`), with argparse's exit code 2."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; `{self.prog} --help` lists the flags")


def build_parser(prog: str = "scale-ocr train") -> argparse.ArgumentParser:
    """The training CLI: every config field becomes a flag, grouped by section."""
    parser = _OneLineParser(
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
            # argparse formats help with %: a literal "13%" must not break --help
            text = meta["help"].replace("%", "%%")
            flags = list(meta["flags"]) or [_flag(f.name)]
            if flags == ["arch"]:
                group.add_argument("arch", nargs="?", help=text, default=argparse.SUPPRESS)
                continue
            kw = _argparse_kw(f, hints)
            default = f.default if f.default is not dataclasses.MISSING else None
            group.add_argument(*flags, dest=f.name, help=f"{text} (default: {str(default).replace('%', '%%')})", **kw)
            for alias in meta["aliases"]:
                group.add_argument(alias, dest=f.name, help=argparse.SUPPRESS, **kw)
    return parser


_KINDS = {int: "a whole number (int)", float: "a number (float)", str: "text (str)",
          parse_input_size: "a size HxW such as 32x128, or [H, W]"}


class _BadValue(Exception):
    """A config-file value that its field's flag would not accept."""


def _fields() -> dict[str, tuple[dict[str, Any], bool]]:
    """Every config field's ``add_argument`` keywords, and whether it takes None (null)."""
    fields = {}
    for section in SECTIONS.values():
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            fields[f.name] = (_argparse_kw(f, hints), type(None) in typing.get_args(hints[f.name]))
    return fields


def _expected(kw: dict[str, Any], optional: bool) -> str:
    """What a field accepts, in words, for the error message."""
    if kw.get("action") is argparse.BooleanOptionalAction:
        what = "true or false"
    elif "choices" in kw:
        what = "one of " + ", ".join(kw["choices"])
    else:
        what = _KINDS.get(kw["type"], kw["type"].__name__)
    if kw.get("nargs") == "+":
        what += " or a list of them"
    return what + " or null" if optional else what


def _file_value(value: Any, kw: dict[str, Any], optional: bool) -> Any:
    """A config-file value converted and checked as argparse treats the flag's text.

    Raises:
        _BadValue: the flag would refuse it.
    """
    if value is None:
        if optional:
            return None
        raise _BadValue
    if kw.get("action") is argparse.BooleanOptionalAction:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise _BadValue  # "yes", 1, ...: YAML reads unquoted yes/no as booleans already
    if kw.get("nargs") == "+":
        return tuple(_file_scalar(v, kw) for v in (value if isinstance(value, list) else [value]))
    return _file_scalar(value, kw)


def _file_scalar(value: Any, kw: dict[str, Any]) -> Any:
    """One value (not a list, except [H, W] for a size) converted by the flag's ``type`` and ``choices``."""
    typ = kw["type"]
    if typ is parse_input_size and isinstance(value, list) and len(value) == 2:
        value = "x".join(str(_file_scalar(v, {"type": int})) for v in value)
    # A boolean is an int to Python but never a number, size or name to a user.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise _BadValue
    try:
        if isinstance(value, str) or typ in (str, parse_input_size):
            out = typ(str(value))  # exactly what the flag does with its text: YAML reads 1e-3 as a string
        elif typ is int and not float(value).is_integer():
            raise _BadValue  # 2.5 epochs; 2.0 is the number two and is kept
        else:
            out = typ(value)
    except (ValueError, OverflowError, argparse.ArgumentTypeError):
        raise _BadValue from None
    if "choices" in kw and out not in kw["choices"]:
        raise _BadValue
    return out


def _load_file(path: str) -> dict[str, Any]:
    p = Path(path)
    text = read_user_text(p, what="--config", limit=JSON_LIMIT, follow=True)
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
    fields = _fields()
    unknown = sorted(set(flat) - set(fields))
    if unknown:
        raise UserError(f"--config {path} has unknown keys {unknown}; see `scale-ocr train --help`")
    for key, value in flat.items():
        kw, optional = fields[key]
        try:
            flat[key] = _file_value(value, kw, optional)
        except _BadValue:
            shown = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
            raise UserError(f"--config {path}: {key} = {shown[:80]} is not {_expected(kw, optional)}; "
                            "fix the value or remove the key to keep the default") from None
    return flat


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """Defaults, then ``--config FILE``, then flags, into one frozen :class:`RunConfig`, resolved (the model's and
    task's defaults filled in: :func:`scale_ocr.run.resolve.resolve`)."""
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    if "config" in ns:
        values.update(_load_file(ns.pop("config")))
    ns.pop("local_rank", None)
    fields = _fields()
    for k in ns:
        if k in fields and fields[k][0].get("nargs") == "+":
            ns[k] = tuple(ns[k])  # argparse gives lists; the frozen config holds tuples
    values.update(ns)
    cfg = resolve(RunConfig.from_flat(values))
    check_output_dir(cfg.output.output_dir)  # here, not in OutputConfig: the config classes do no I/O
    return cfg
