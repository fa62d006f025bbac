"""--compile: torch.compile of the module the loop calls, in place (names, checkpoints and losses unchanged)."""

import json

from conftest import TINY, read_jsonl

from scale_ocr.train import main

# Three steps, each logged: the first compiles, the next two run the compiled graphs (aot_eager interprets them
# op by op, a few times slower than eager, so each step more costs seconds).
# Two micro-batches a step, the noise scale read at each: its tensor hooks on the parameters work the same on the
# compiled module (AOTAutograd's gradients reach each parameter through autograd, hooks first).
STEPS = [*TINY, "--max-steps", "3", "--log-every", "1", "--grad-accum", "2", "--noise-every", "1"]


def _losses(run_dir):
    return [(r["train/loss"], r["noise/trace"]) for r in read_jsonl(run_dir) if "train/loss" in r]


def test_compiled_single_run_trains_like_the_eager_one(tmp_path):
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    assert main(["--strategy", "single", *STEPS, "--output-dir", str(eager)]) == 0
    # aot_eager runs dynamo's and AOTAutograd's graphs without generating code: the same wiring as inductor
    # (which benchmarks/results/compile-* measures), at a fraction of the compile time.
    assert main(["--strategy", "single", *STEPS, "--compile", "aot_eager", "--output-dir", str(compiled)]) == 0
    a, b = _losses(eager), _losses(compiled)
    assert len(a) == len(b) >= 3
    # The noise's trace is a difference of two gradient norms: float noise in it is ten times the loss's.
    for (loss, trace), (loss_c, trace_c) in zip(a, b, strict=True):
        assert abs(loss - loss_c) / abs(loss) < 1e-4 and abs(trace - trace_c) / abs(trace) < 1e-3, (a, b)
    assert json.loads((compiled / "config.json").read_text())["strategy"]["compile"] == "aot_eager"
    saved = json.loads((compiled / "metrics.json").read_text())
    assert saved["steps"] == 3


def test_inductor_on_cpu_without_a_compiler_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    code = main(["--strategy", "single", *TINY, "--compile", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "--compile on CPU generates C++, but no compiler was found" in err and "aot_eager" in err
