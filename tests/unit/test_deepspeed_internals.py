"""The private DeepSpeed and fairscale attributes scale_ocr relies on are still there in the installed versions.

Every row of ``deepspeed_internals.PRIVATE_ATTRIBUTES`` is checked on its class: a class attribute (method,
property), a dataclass field, or an assignment in the source of the class or one of its bases (``self.attr =`` in
``__init__``; ``param.attr =`` for what ``zero.Init`` attaches to parameters).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from importlib.metadata import version
from pathlib import Path

import pytest

from scale_ocr.strategies import deepspeed_internals
from scale_ocr.strategies.deepspeed_internals import PRIVATE_ATTRIBUTES, Private

PACKAGE = Path(deepspeed_internals.__file__).resolve().parents[1]


def _load(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _source_name(cls: type, attr: str) -> str:
    """``attr`` as written in ``cls``'s source: a name-mangled ``_C__x`` is ``__x`` there."""
    prefix = f"_{cls.__name__.lstrip('_')}__"
    return attr[len(prefix) - 2:] if attr.startswith(prefix) else attr


def has_attribute(cls: type, attr: str) -> bool:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if hasattr(cls, attr) or attr in fields:
        return True
    assigned = re.compile(rf"\.{re.escape(_source_name(cls, attr))}\s*(:[^=\n]+)?=(?!=)")
    for klass in cls.__mro__[:-1]:  # the class and its bases, not object
        try:
            if assigned.search(inspect.getsource(klass)):
                return True
        except (OSError, TypeError):  # a class built in C has no source
            continue
    return False


def _library(row: Private) -> str:
    return row.cls.split(".")[0]


@pytest.mark.parametrize("row", PRIVATE_ATTRIBUTES,
                         ids=[f"{r.cls.rpartition('.')[2]}.{r.attr}" for r in PRIVATE_ATTRIBUTES])
def test_installed_class_has_the_attribute(row: Private):
    lib = _library(row)
    pytest.importorskip(lib)
    cls = _load(row.cls)
    assert has_attribute(cls, row.attr), (
        f"{row.cls} has no attribute {row.attr!r} in {lib} {version(lib)} (scale_ocr's {row.used_by} relies on it; "
        f"checked against DeepSpeed 0.19.8 and fairscale 0.4.13): update scale_ocr/strategies/deepspeed_internals.py "
        f"for this version, and the {lib} bound in pyproject.toml")


def test_every_row_names_a_user_and_every_function_documents_its_rows():
    for row in PRIVATE_ATTRIBUTES:
        if "." in row.used_by:  # read outside this module
            module, _, fn = row.used_by.rpartition(".")
            assert hasattr(importlib.import_module(module), fn), row
        else:
            fn = getattr(deepspeed_internals, row.used_by)
            assert f"``{row.cls}.{row.attr}``" in fn.__doc__, row


def test_private_names_are_read_only_through_the_module():
    """No other module of the package reads one of the table's underscore names directly."""
    names = {row.attr for row in PRIVATE_ATTRIBUTES if row.attr.startswith("_")}
    offenders = [f"{p.relative_to(PACKAGE.parent)}: {name}" for p in PACKAGE.rglob("*.py")
                 if p.name != "deepspeed_internals.py" for name in names if name in p.read_text(encoding="utf-8")]
    assert not offenders, "read these through scale_ocr/strategies/deepspeed_internals.py:\n" + "\n".join(offenders)


def test_a_missing_attribute_is_reported():
    class Engine:
        def __init__(self):
            self.present = 1

    assert has_attribute(Engine, "present") and has_attribute(Engine, "__init__")
    assert not has_attribute(Engine, "_zero3_consolidated_16bit_state_dict")
