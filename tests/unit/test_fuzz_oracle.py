"""The oracle of the property-based fuzz tests (``test_fuzz_*.py``, docs/faults.md "Fuzzing").

Every generated input ends in one of two ways: the entry point returns (and the property checks that what it
accepted is valid), or it raises :class:`~scale_ocr.errors.UserError` whose message is one line: no line break,
nothing Python does not call printable (control characters, bidi overrides are escaped as ``shown`` escapes them)
and at most :data:`MESSAGE_LIMIT` characters, however large the input. Any other exception propagates out of
:func:`outcome`, so Hypothesis reports it, with its traceback and the smallest input it found: a bug.

The tests below check that the oracle bites.
"""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import event
from hypothesis.errors import InvalidArgument

from scale_ocr.errors import UserError, shown

MESSAGE_LIMIT = 1000  # characters of one message, whatever the size of the input it is about


def check_line(message: str, what: str = "message") -> None:
    """Assert ``message`` is one printable line of at most MESSAGE_LIMIT characters."""
    assert message.strip(), f"empty {what}"
    assert "\n" not in message, f"{what} spans lines: {message[:300]!r}"
    assert len(message) <= MESSAGE_LIMIT, f"{what} of {len(message)} characters: {message[:300]!r}…"
    assert message.isprintable(), f"{what} holds a raw control character: {message[:300]!r}"


def outcome(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    """``(result, None)`` when ``call`` returns, ``(None, message)`` when it raises a well-formed UserError."""
    try:
        result = call(*args, **kwargs)
    except UserError as exc:
        check_line(str(exc))
        _event(f"{getattr(call, '__name__', 'call')}: refused")
        return None, str(exc)
    _event(f"{getattr(call, '__name__', 'call')}: accepted")
    return result, None


def _event(what: str) -> None:
    """Count the outcome in ``--hypothesis-show-statistics`` (outside a property there is nothing to count)."""
    with contextlib.suppress(InvalidArgument):
        event(what)


@contextlib.contextmanager
def warnings_checked() -> Iterator[io.StringIO]:
    """Capture what the call prints to stderr (warnings such as DeepSpeed's ignored keys); each line must be
    one printable bounded line too."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        yield err
    for line in err.getvalue().splitlines():
        check_line(line, "warning line")


def _raise(exc: BaseException) -> None:
    raise exc


@pytest.mark.parametrize("message", [
    "a\nscale-ocr: all samples OK",  # a forged second line
    "bad name 'x\x1b[2J'",  # a raw escape sequence
    "bad name \u202egnp.exe",  # a bidi override
    "x" * (MESSAGE_LIMIT + 1),  # an input echoed whole
    "",
])
def test_oracle_refuses_a_malformed_user_error(message):
    with pytest.raises(AssertionError):
        outcome(_raise, UserError(message))


def test_oracle_passes_other_exceptions_through_and_accepts_a_good_line():
    with pytest.raises(KeyError):
        outcome(_raise, KeyError("polygons"))
    assert outcome(_raise, UserError(f"labels.json: the key {shown('a' * 10**6 + chr(10))} is not a file name")
                   )[1].endswith("(1000001 characters) is not a file name")
    assert outcome(len, "abc") == (3, None)
    with pytest.raises(AssertionError, match="warning line"), warnings_checked():
        print("scale-ocr: warning: key '\x1b[2J'", file=sys.stderr)
