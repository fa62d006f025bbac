"""``scale-ocr``: the console entry point.

``scale-ocr train [ARCH] [flags]`` takes exactly the flags of ``scale_ocr/train.py``;
``scale-ocr models`` and ``scale-ocr strategies`` list what the registries hold.
"""

from __future__ import annotations

import sys

from scale_ocr.errors import report_user_errors

USAGE = """usage: scale-ocr COMMAND [ARGS]

commands:
  train        train a model (see `scale-ocr train --help`)
  verify       [ARCH] --strategies ddp,fsdp,...: same maths under every strategy, or a non-zero exit
  export       CKPT OUT.safetensors: consolidated fp32 model with its name, vocabulary and input size
  predict      MODEL IMAGE...: recognise words with a checkpoint or an export
  estimate-memory  (--model ARCH | --params N) --world-size N: per-rank memory of every strategy
  bench        scaling benchmark (same as `python -m benchmarks.scaling`)
  models       list registered models
  strategies   list distributed strategies
"""


def _models(argv: list[str]) -> int:
    from scale_ocr.models import list_models

    for name in list_models(argv[0] if argv else "*"):
        print(name)
    return 0


def _export(argv: list[str]) -> int:
    from scale_ocr.export import export

    if len(argv) != 2:
        print("usage: scale-ocr export CHECKPOINT OUT.safetensors", file=sys.stderr)
        return 2
    print(f"scale-ocr: wrote {export(argv[0], argv[1])}")
    return 0


def _predict(argv: list[str]) -> int:
    from scale_ocr.export import load_any, predict

    if len(argv) < 2:
        print("usage: scale-ocr predict CHECKPOINT_OR_EXPORT IMAGE...", file=sys.stderr)
        return 2
    loaded = load_any(argv[0])
    for result in predict(loaded, argv[1:]):
        print(loaded.task.format_prediction(result))
    return 0


def _bench(argv: list[str]) -> int:
    """``python -m benchmarks.scaling`` from the checkout this package lives in."""
    from pathlib import Path

    from scale_ocr.errors import UserError

    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / "scaling.py").is_file():
        raise UserError("scale-ocr bench needs the source checkout (its benchmarks/ folder); clone the repository "
                        "and install it with `pip install -e .`")
    sys.path.insert(0, str(root))  # ours, ahead of the `benchmarks` package fairscale installs
    from benchmarks.scaling import main as bench_main

    return bench_main(argv)


def _strategies(argv: list[str]) -> int:
    from scale_ocr.strategies import list_strategies

    for name, desc in list_strategies().items():
        print(f"{name:<15} {desc}")
    return 0


def _train(argv: list[str]) -> int:
    from scale_ocr.train import main as train_main

    return train_main.__wrapped__(argv)  # this entry point already reports user errors


def _verify(argv: list[str]) -> int:
    from scale_ocr.verify import main as verify_main

    return verify_main(argv)


def _estimate_memory(argv: list[str]) -> int:
    from scale_ocr.memory.estimate import main as estimate_main

    return estimate_main(argv)


COMMANDS = {"train": _train, "verify": _verify, "export": _export, "predict": _predict,
            "estimate-memory": _estimate_memory, "bench": _bench, "models": _models, "strategies": _strategies}


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"scale-ocr: error: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
        return 2
    return COMMANDS[command](rest)


if __name__ == "__main__":
    sys.exit(main())
