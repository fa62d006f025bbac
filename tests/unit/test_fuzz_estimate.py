"""Property-based fuzzing of ``scale-ocr estimate-memory``'s numbers (docs/faults.md, "Fuzzing"; the probe's
E01-E04).

Any text for each numeric flag (``--params``, ``--largest-layer``, ``--world-size``, ``--batch-size``,
``--shard-size``, ``--per-node``, ``--mfu``, ``--flops-per-sample``, the model sizes): NaN, infinities, negatives,
huge and malformed numbers, given as ``--flag value`` or ``--flag=value``, with or without ``--time``/``--scaling``
on a datasheet device. The command prints a table of finite, non-negative figures, or refuses in one UserError
line (argparse's refusals included). Kept cheap: ``--params``, no model built, no host probing.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

from conftest import SURFACE_EXAMPLES
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_fuzz_oracle import outcome

from scale_ocr.cli.estimate_memory import main as _reported

main = _reported.__wrapped__  # the command itself: a refusal raises its UserError here

FLAGS = ("--params", "--largest-layer", "--world-size", "--batch-size", "--shard-size", "--per-node", "--mfu",
         "--flops-per-sample", "--model-width", "--mlp-ratio")
NUMBER_TEXT = st.one_of(
    st.integers(-3, 64).map(str), st.integers().map(str), st.floats().map(repr), st.floats(0, 1e30).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e308", "1e309", "-0", "0", "85e6", "1_000", "0x10", "1e6x", "", " 4",
                     "9" * 400, "٣", "\x1b[2J", "--time"]),
    st.text(max_size=8),
)
STRATEGIES = st.sampled_from(["ddp", "ddp,fsdp", "zero3", "fsdp,zero2_offload,hsdp", "single,zero3_hpz"])


@st.composite
def argvs(draw) -> list[str]:
    argv = ["--params", draw(st.sampled_from(["1e6", "85e6", "3e9"])), "--world-size", "8",
            "--strategies", draw(STRATEGIES)]
    for flag in draw(st.lists(st.sampled_from(FLAGS), max_size=4, unique=True)):
        value = draw(NUMBER_TEXT)
        argv += [f"{flag}={value}"] if draw(st.booleans()) else [flag, value]
    timing = draw(st.sampled_from([[], [], ["--time"], ["--time", "--scaling"]]))
    if timing:
        argv += [*timing, "--device", "h100", "--flops-per-sample", "3e9"]  # a later flag wins: fuzzed ones may too
    return argv + draw(st.sampled_from([[], ["--json"]]))


def _estimate(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def _finite(node) -> bool:
    if isinstance(node, dict):
        return all(_finite(v) for v in node.values())
    if isinstance(node, list):
        return all(_finite(v) for v in node)
    return not isinstance(node, float) or (math.isfinite(node) and node >= 0)


@settings(max_examples=SURFACE_EXAMPLES)
@given(argvs())
@example(["--params", "nan", "--world-size", "2"])  # E01
@example(["--params", "inf", "--world-size", "2"])
@example(["--params", "1e6", "--largest-layer", "nan", "--world-size", "2"])
@example(["--params=-1e9", "--world-size", "2"])  # E02
@example(["--params", "1e6", "--world-size", "2", "--time", "--device", "h100", "--flops-per-sample=-1e9"])
@example(["--params", "1e30", "--world-size", "1000000000", "--time", "--scaling", "--device", "h100",
          "--flops-per-sample", "1e40", "--batch-size", "1000000000000"])  # E04
def test_estimate_memory_numbers_give_a_table_or_one_line(argv):
    printed, _ = outcome(_estimate, argv)
    if printed is not None and "--json" in argv:
        doc = json.loads(printed)
        strategies = {k: v for k, v in doc["strategies"].items()}
        assert _finite(strategies), printed[:500]
        assert _finite(doc.get("time", {}).get("strategies", {})), printed[:500]
    elif printed is not None:  # every figure in the tables finite and not negative
        for token in printed.replace("(", " ").replace(")", " ").split():
            with contextlib.suppress(ValueError):
                assert math.isfinite(float(token)) and float(token) >= 0, token
