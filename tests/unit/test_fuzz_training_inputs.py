"""Property-based fuzzing of training's own inputs (issue 55): a ``--data-cache`` file, a ``--init-from`` state dict,
and the data record a checkpoint carries into a resume. Each returns or ends in one UserError line
(:mod:`test_fuzz_oracle`), never another exception: whatever the file or the record holds.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import torch
from conftest import SURFACE_EXAMPLES
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fuzz_oracle import outcome

from scale_ocr.checkpoint.weights_io import read_state_dict
from scale_ocr.data.cache import TensorWords
from scale_ocr.run.same_data import same_data
from scale_ocr.vocab import Vocab

_DIR = Path(tempfile.mkdtemp(prefix="scale-ocr-fuzz-inputs-"))
_FLOATS = st.sampled_from([0.0, 0.5, -1.0, 1e38, float("nan"), float("inf"), -float("inf")])
_DTYPES = st.sampled_from([torch.float16, torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool])


@st.composite
def _tensors(draw) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=5))
    t = torch.zeros(shape, dtype=torch.float32)
    if t.numel():
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(_FLOATS)
    return t.to(draw(_DTYPES))


_VALUES = st.one_of(_tensors(), st.text(max_size=8), st.integers(), st.none(),
                    st.lists(st.text(alphabet="abcz\n\x1b", max_size=4), max_size=6))


def _file(name: str, payload: object, raw: bytes | None) -> Path:
    path = _DIR / name
    if raw is not None:
        path.write_bytes(raw)
    else:
        buf = io.BytesIO()
        torch.save(payload, buf)
        path.write_bytes(buf.getvalue())
    return path


@settings(max_examples=SURFACE_EXAMPLES)
@given(st.dictionaries(st.sampled_from(["images", "labels", "input_size", "chars", "other"]), _VALUES, max_size=5),
       st.one_of(st.none(), st.binary(max_size=64)))
def test_a_data_cache_loads_or_is_refused_in_one_line(payload, raw):
    words, _ = outcome(TensorWords, _file("cache.pt", payload, raw), Vocab("abc"), (2, 3))
    if words is not None:  # accepted: every image finite, every word a string of the vocabulary
        assert len(words) == words.images.shape[0] and bool(torch.isfinite(words.images).all())


@settings(max_examples=SURFACE_EXAMPLES)
@given(st.dictionaries(st.text(max_size=6), _VALUES, max_size=4), st.one_of(st.none(), st.binary(max_size=64)))
def test_an_init_from_file_reads_or_is_refused_in_one_line(payload, raw):
    state, _ = outcome(read_state_dict, _file("init.pt", payload, raw))
    if state is not None:
        assert all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point())


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                                                  max_size=3), max_leaves=8)


@settings(max_examples=SURFACE_EXAMPLES)
@given(st.one_of(_JSON, st.dictionaries(st.sampled_from(["train_sha256", "val_sha256"]), _JSON, max_size=2)),
       st.fixed_dictionaries({"train_sha256": st.none() | st.text(max_size=12),
                              "val_sha256": st.none() | st.text(max_size=12)}))
def test_a_checkpoints_data_record_passes_or_refuses_the_resume_in_one_line(recorded, now):
    outcome(same_data, recorded, now)
