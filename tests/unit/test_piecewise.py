"""Whole-model files written a tensor at a time (scale_ocr/checkpoint/piecewise.py, model_files.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scale_ocr.checkpoint.piecewise import SafetensorsFile, TensorSpec, TorchFile, TorchFileReader
from scale_ocr.disk import atomic_file

HELPER = Path(__file__).resolve().parents[1] / "helpers" / "capped_save.py"
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["torch", "safetensors"])
def test_a_file_written_a_tensor_at_a_time_reads_back_as_a_whole_save(tmp_path, kind):
    torch.manual_seed(0)
    tensors = {"conv.weight": torch.randn(4, 3, 3, 3), "head.weight": torch.randn(4, 6),  # same size, kept apart
               "head.bias": torch.randn(24), "half": torch.randn(5, 7).bfloat16(), "scalar": torch.tensor(2.5),
               "empty": torch.zeros(0, 3), "bn.num_batches_tracked": torch.tensor(7), "mask": torch.rand(9) > 0.5}
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    path = tmp_path / ("model.pt" if kind == "torch" else "model.safetensors")
    with atomic_file(path, what="the model", kept="") as f:
        writer = TorchFile(f, specs) if kind == "torch" else SafetensorsFile(f, specs, {"arch": "x"})
        for t in tensors.values():
            writer.put(t)
        writer.close()
    if kind == "torch":
        read = torch.load(path, weights_only=True)
        reader = TorchFileReader(path, torch.load(path, weights_only=True, map_location="meta"))
        assert all(torch.equal(reader.read(k), v) for k, v in tensors.items())
    else:
        from safetensors import safe_open
        from safetensors.torch import load_file

        read = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            assert handle.metadata() == {"arch": "x"}
    assert list(read) == list(tensors) if kind == "torch" else set(read) == set(tensors)
    for k, v in tensors.items():
        assert read[k].dtype == v.dtype and torch.equal(read[k], v), k
    with pytest.raises(ValueError, match="head.weight"):  # a tensor unlike its spec is refused, not written
        with atomic_file(tmp_path / "bad.pt", what="the model", kept="") as f:
            writer = TorchFile(f, specs)
            writer.put(tensors["conv.weight"])
            writer.put(torch.zeros(6, 4))
    assert not (tmp_path / "bad.pt").exists() and not list(tmp_path.glob(".bad.pt.tmp*"))


def test_a_whole_model_file_needs_its_largest_piece_not_the_model(tmp_path):
    """Under a data-segment cap that 12 pieces of 32 MiB do not fit in, last_model.pt's writer writes all 12, holding
    one at a time (what a rank of a sharded engine does after training, beside the state it keeps)."""
    out = tmp_path / "last_model.pt"
    done = subprocess.run([sys.executable, str(HELPER), str(out), "12", "32", "160"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert not facts["whole_fitted"]  # the model held whole does not fit the cap ...
    assert facts["high"] - facts["start"] < 2 * facts["piece"]  # ... but writing it needs one piece at a time
    assert facts["read_high"] - facts["start"] < 2 * facts["piece"]  # and so does reading it back, as export does
    written = torch.load(out, weights_only=True, mmap=True)
    assert list(written) == [f"blocks.{i}.weight" for i in range(12)]
    assert all(bool((written[f"blocks.{i}.weight"] == i).all()) for i in range(12))


def test_a_torch_file_of_views_reads_back_a_tensor_at_a_time(tmp_path):
    """torch.save keeps a view with its whole storage (a slice, a transpose): each is read from where it lies."""
    base = torch.arange(48.0).reshape(6, 8)
    state = {"rows": base[2:4], "columns": base[:, 1:3], "transposed": base.t(),
             "alone": torch.ones(3, dtype=torch.int64)}
    torch.save(state, tmp_path / "views.pt")
    reader = TorchFileReader(tmp_path / "views.pt", torch.load(tmp_path / "views.pt", weights_only=True,
                                                                map_location="meta"))
    assert all(torch.equal(reader.read(k), v) for k, v in state.items())

