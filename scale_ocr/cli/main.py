"""``scale-ocr``: the console entry point.

``scale-ocr train [ARCH] [flags]`` takes exactly the flags of ``scale_ocr/train.py``;
``scale-ocr models`` and ``scale-ocr strategies`` list what the registries hold; ``predict --det --reco`` and
``evaluate-pages`` run page OCR (:mod:`scale_ocr.cli.page_ocr`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from scale_ocr.distributed.process_env import prepare_process
from scale_ocr.errors import on_interrupt, report_user_errors, say

USAGE = """usage: scale-ocr COMMAND [ARGS]

commands:
  train        train a model (see `scale-ocr train --help`)
  ray-train    --num-workers N [--max-failures K] -- TRAIN_FLAGS: the same training under Ray Train on a Ray
               cluster; a failed worker makes Ray restart the group, which resumes from the last checkpoint
  verify       [ARCH] --strategies ddp,fsdp,...: same maths under every strategy, or a non-zero exit
  export       CKPT OUT.safetensors: consolidated fp32 model with its name, vocabulary and input size
               (--format doctr: OUT.pt, a state dict docTR's own class loads strictly)
  predict      MODEL IMAGE...: one model's predictions (words of word crops, or boxes of pages)
               --det DET --reco RECO PAGE... [--overlay OUT.png | --overlay-dir DIR]: page OCR, one JSON line
               per page with its words in reading order
  evaluate     MODEL DIR... [--json]: a model's validation metrics on labelled folders or a shard set
               (a recognizer's exact match and CER, a detector's box recall and precision)
  evaluate-pages  --det DET --reco RECO DIR... [--json]: detection and end-to-end word recall/precision on
               docTR detection folders whose labels carry words
  make-dataset  PDF... OUT [--dpi 150] [--split-by document|page] [--val-fraction F]: born-digital PDFs into
               docTR recognition (word crops) and detection (pages, with words) folders, from the text layer
  summary      RUN_DIR [--plot OUT.png]: one screen on a finished run (strategy, world size, global batch,
               time, accuracy, its files, its W&B offline run) and a PNG of its loss and accuracy curves
  estimate-memory  (--model ARCH | --params N) --world-size N: per-rank memory of every strategy; --time adds
               its step time (--device, --link, --mfu), --scaling its predicted curve from 1 to 1,024 devices
  plan         RUN_DIR --target T [--devices 1,2,4 --device h100]: per strategy and device count, whether it fits,
               the batch and rate to train at, and the steps and time to the target (anchored on the run)
  make-shards  FOLDER... OUT [--samples-per-shard N --seed S]: docTR folders as one shard set (tar shards and
               shards.json) that --train-path/--val-path stream from, resumable exactly at any world size
  make-cache   PATH [-n N --input-size HxW --fonts ...]: synthetic words rendered once into a new image cache
               for --data-cache (validation-transformed, held in memory: data loading never limits a benchmark)
  bench        scaling benchmark (same as `python -m benchmarks.scaling`)
  max-model    largest model each strategy trains under a per-rank budget (`python -m benchmarks.max_model`)
  models       list registered models (--params: with their parameter counts)
  strategies   list distributed strategies
"""


def _models(argv: list[str]) -> int:
    import argparse

    import torch

    from scale_ocr.config import ModelConfig
    from scale_ocr.tasks import create_task

    parser = argparse.ArgumentParser(prog="scale-ocr models", description="List the registered models.")
    parser.add_argument("pattern", nargs="?", default="*", help="shell-style filter, e.g. 'vitstr_*'")
    parser.add_argument("--params", action="store_true", help="also each model's task, parameter count at its "
                        "default input size and vocabulary (built on the meta device: no memory, no time), training "
                        "FLOPs per sample (forward + backward, counted by torch's FLOP counter at the default input "
                        "size; docTR's models run once on the CPU to be counted, a detector at 1024x1024 about 40 s on "
                        "2 cores, "
                        "then cached) and the "
                        "learning rate --lr defaults to, with the global batch it is stated at (--lr-scaling "
                        "linear or sqrt carries it to a run's)")
    args = parser.parse_args(argv)
    import fnmatch
    import importlib.util

    from scale_ocr.models import doctr_zoo, list_models
    from scale_ocr.models.factory import recommended_lr, reference_batch
    from scale_ocr.run.flops import flops_per_sample

    docs = [n for n in doctr_zoo.names() if fnmatch.fnmatch(n, args.pattern)]
    have_doctr = importlib.util.find_spec("doctr") is not None
    for name in list_models(args.pattern) + docs:
        if not args.params or (name in docs and not have_doctr):
            say(name + ("" if have_doctr or name not in docs else f"  (needs {doctr_zoo.INSTALL_HINT})"))
            continue
        task = create_task(ModelConfig(arch=name))
        try:
            with torch.device("meta"):  # counted without allocating
                model = task.build_model()
        except RuntimeError:  # a constructor that reads a tensor's value (docTR's VIPTR): built for real
            model = task.build_model()
        params = sum(p.numel() for p in model.parameters())
        flops = flops_per_sample(task.create_model, task.dummy_inputs).total
        say(f"{name:<30} {task.name:<18} {params / 1e6:>9.2f}M {flops / 1e9:>10.3f} GFLOP/sample  "
            f"lr {recommended_lr(name):g} at global batch {reference_batch(name)}")
    return 0


def _export(argv: list[str]) -> int:
    import argparse

    from scale_ocr.checkpoint.export import FORMATS, export

    parser = argparse.ArgumentParser(prog="scale-ocr export", description="Write a checkpoint's model as one file.")
    parser.add_argument("src", metavar="CHECKPOINT", help="checkpoint folder, run directory, export or best_model.pt")
    parser.add_argument("out", metavar="OUT", help="OUT.safetensors, or with --format doctr OUT.pt (and OUT.json)")
    parser.add_argument("--format", choices=FORMATS, default="safetensors",
                        help="safetensors: scale-ocr's, with the model's identity (default); doctr: a plain state "
                        "dict for docTR's own class of the architecture (strict), and OUT.json with its build "
                        "arguments")
    args = parser.parse_args(argv)
    on_interrupt("the export is written whole or not at all: OUT is as it was and the checkpoint is untouched")
    out = export(args.src, args.out, args.format)
    if args.format == "doctr":
        from scale_ocr.disk import read_user_json

        info = read_user_json(out.with_suffix(".json"), what="the export's sidecar")
        say(f"scale-ocr: wrote {out} and {out.with_suffix('.json')}: load it with "
            f"doctr.models.{info['doctr_arch']}(pretrained=False"
            f"{', vocab=<the vocab in the .json>' if 'vocab' in info else ''})"
            ".load_state_dict(torch.load(OUT, weights_only=True))")
    else:
        say(f"scale-ocr: wrote {out}")
    return 0


PAGE_OCR_FLAGS = ("--det", "--reco", "--overlay", "--overlay-dir", "-h", "--help")


def _predict(argv: list[str]) -> int:
    from scale_ocr.checkpoint.export import load_any
    from scale_ocr.cli.page_ocr import predict, prediction_line

    if any(a.split("=", 1)[0] in PAGE_OCR_FLAGS for a in argv):
        return _predict_pages(argv)
    if len(argv) < 2:
        say("usage: scale-ocr predict CHECKPOINT_OR_EXPORT IMAGE...\n"
            "       scale-ocr predict --det DET --reco RECO PAGE... (see --help)", err=True)
        return 2
    loaded = load_any(argv[0])
    for result in predict(loaded, argv[1:]):
        say(prediction_line(result))
    return 0


def _page_models(args):
    """Both models, refused before any page is read when either is of the wrong kind."""
    from scale_ocr.checkpoint.export import load_any
    from scale_ocr.cli.page_ocr import check_models

    detector, recognizer = load_any(args.det), load_any(args.reco)
    check_models(detector, recognizer)
    return detector, recognizer


def _overlay_paths(args) -> list[Path] | None:
    """Where each page's overlay goes; refuses, before any work, a file that exists or two pages on one name."""
    from scale_ocr.errors import UserError

    if args.overlay and len(args.pages) > 1:
        raise UserError(f"--overlay writes one page's image but {len(args.pages)} pages were given; pass "
                        "--overlay-dir DIR to write one PNG per page")
    if args.overlay:
        paths = [Path(args.overlay)]
    elif args.overlay_dir:
        paths = [Path(args.overlay_dir) / f"{Path(p).stem}.png" for p in args.pages]
        seen: dict[Path, str] = {}
        for page, path in zip(args.pages, paths, strict=True):
            if path in seen:
                raise UserError(f"{seen[path]} and {page} would both be drawn to {path}; run them in separate "
                                "commands or rename one")
            seen[path] = page
    else:
        return None
    for path in paths:
        if path.exists():
            raise UserError(f"{path} already exists; remove it or choose another --overlay / --overlay-dir")
        if path.parent.exists() and not path.parent.is_dir():
            raise UserError(f"{path.parent} is not a folder; choose another --overlay / --overlay-dir")
    return paths


def _write_overlay(path: Path, image) -> None:
    from scale_ocr.errors import UserError

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "xb") as f:  # exclusive: never over a file that appeared since the check
            image.save(f, format="PNG")
    except FileExistsError:
        raise UserError(f"{path} already exists; remove it or choose another --overlay / --overlay-dir") from None
    except OSError as exc:
        raise UserError(f"{path} cannot be written ({exc.strerror}); choose another --overlay / --overlay-dir") \
            from None


def _det_size(text: str) -> tuple[int, int] | str:
    """``auto``, ``HxW``, or one number for a square."""
    from scale_ocr.cli.args import parse_input_size

    if text.strip().lower() == "auto":
        return "auto"
    return (int(text), int(text)) if text.strip().isdigit() else parse_input_size(text)


def _page_side(args) -> int | None:
    """``--max-page-side``, refused in one line when it is no multiple of 32 or there is no whole page to cap."""
    from scale_ocr.config import check_max_page_side
    from scale_ocr.errors import UserError

    check_max_page_side(args.max_page_side)
    if args.max_page_side is not None and isinstance(args.det_size, tuple):
        h, w = args.det_size
        raise UserError(f"--max-page-side caps the pages --det-size auto reads whole; --det-size {h}x{w} fits every "
                        "page into that size instead: drop one of them")
    return args.max_page_side


def _add_model_pair(parser) -> None:
    """The detector and recognizer that page OCR composes, and how many pages go through the detector at once."""
    parser.add_argument("--det", required=True, metavar="DET_MODEL", help="detection checkpoint, run dir or export")
    parser.add_argument("--reco", required=True, metavar="RECO_MODEL", help="recognition checkpoint, run dir or export")
    parser.add_argument("--batch-size", "--batch_size", type=int, default=4, help="pages per detector batch")
    parser.add_argument("--det-size", type=_det_size, default=None, metavar="auto|HxW",
                        help="auto: each page whole at the scale the detector trained at, padded to a multiple of 32; "
                             "HxW: fit pages into this size (multiples of 32); default: as the detector trained "
                             "(auto after --page-scale native or a factor, its input size after fit)")
    parser.add_argument("--max-page-side", type=int, default=None, metavar="PX",
                        help="with auto, the longest side a page is read at, larger pages are scaled down to it "
                             "(a multiple of 32; default: the detector's --max-page-side)")
    parser.add_argument("--read", choices=("words", "lines"), default="words",
                        help="words: read each detected word's crop; lines: group the words into lines and read "
                             "each line's crop at its own width (a recognizer trained with --max-width), each word "
                             "read going to the box where it was read (default: words)")


def _predict_pages(argv: list[str]) -> int:
    import argparse
    import json

    from scale_ocr.cli.page_ocr import overlay, read_pages
    from scale_ocr.data.files import open_rgb
    from scale_ocr.errors import UserError

    parser = argparse.ArgumentParser(
        prog="scale-ocr predict", description="Page OCR: prints one JSON object per page, {\"page\": path, "
        "\"words\": [{\"polygon\", \"text\", \"confidence\", \"box_score\", \"line\"}, ...]} in reading order. "
        "(`scale-ocr predict MODEL IMAGE...` prints one model's own predictions.)")
    _add_model_pair(parser)
    parser.add_argument("pages", nargs="+", metavar="PAGE", help="page images")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--overlay", metavar="OUT.png", help="draw the words on the (single) page into this PNG")
    out.add_argument("--overlay-dir", metavar="DIR", help="draw each page's words into DIR/<page name>.png")
    args = parser.parse_args(argv)
    max_side = _page_side(args)
    missing = next((p for p in args.pages if not Path(p).is_file()), None)
    if missing:
        raise UserError(f"{missing} is not a file; pass page images")
    overlays = _overlay_paths(args)
    detector, recognizer = _page_models(args)
    for start in range(0, len(args.pages), args.batch_size):  # a batch at a time, so a big folder streams
        names = args.pages[start:start + args.batch_size]
        pages = [open_rgb(n) for n in names]
        found = read_pages(detector, recognizer, pages, args.batch_size, det_size=args.det_size, max_side=max_side,
                           read=args.read)
        for i, (name, page, words) in enumerate(zip(names, pages, found, strict=True)):
            say(json.dumps({"page": name, "words": words}))
            if overlays:
                _write_overlay(overlays[start + i], overlay(page, words))
    return 0


def _evaluate_pages(argv: list[str]) -> int:
    import argparse
    import json

    from scale_ocr.cli.page_ocr import evaluate_pages

    parser = argparse.ArgumentParser(
        prog="scale-ocr evaluate-pages", description="Detection recall / precision / mean IoU and end-to-end word "
        "recall / precision (a true word counts when a box matches it at IoU 0.5 and its text is equal) on "
        "docTR detection folders whose labels.json lists each page's \"words\".")
    _add_model_pair(parser)
    parser.add_argument("folders", nargs="+", metavar="DIR", help="docTR detection folders (images/, labels.json)")
    parser.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    args = parser.parse_args(argv)
    max_side = _page_side(args)
    detector, recognizer = _page_models(args)
    m = evaluate_pages(detector, recognizer, args.folders, args.batch_size, args.det_size, max_side, args.read)
    if args.json:
        say(json.dumps(m))
        return 0
    rows = [("pages", f"{m['pages']}"), ("true words", f"{m['gt_words']}"), ("words read", f"{m['pred_words']}"),
            ("unread boxes", f"{m['unread_boxes']}"),
            ("detection recall", f"{m['recall']:.2%}"), ("detection precision", f"{m['precision']:.2%}"),
            ("detection mean IoU", f"{m['mean_iou']:.4f}"),
            ("word recall", f"{m['word_recall']:.2%}  (ignoring case {m['ci_word_recall']:.2%})"),
            ("word precision", f"{m['word_precision']:.2%}  (ignoring case {m['ci_word_precision']:.2%})"),
            ("line CER", f"{m['line_cer']:.4f}  ({m['gt_lines']} true lines, read by {m['read']})"),
            ("seconds per page", f"{m['seconds_per_page']:.3f}")]
    for name, value in rows:
        say(f"{name:<20} {value}")
    return 0


def _benchmarks(module: str, command: str):
    """``python -m benchmarks.MODULE``'s main, from the checkout this package lives in."""
    import importlib
    from pathlib import Path

    from scale_ocr.errors import UserError

    root = Path(__file__).resolve().parents[2]  # the checkout: scale_ocr/cli/main.py -> ../..
    if not (root / "benchmarks" / f"{module}.py").is_file():
        raise UserError(f"scale-ocr {command} needs the source checkout (its benchmarks/ folder); clone the "
                        "repository and install it with `pip install -e .`")
    sys.path.insert(0, str(root))  # ours, ahead of the `benchmarks` package fairscale installs
    return importlib.import_module(f"benchmarks.{module}").main


def _benchmark(module: str, command: str) -> Callable[[list[str]], int]:
    return lambda argv: _benchmarks(module, command)(argv)


def _strategies(argv: list[str]) -> int:
    from scale_ocr.strategies import list_strategies

    for name, desc in list_strategies().items():
        say(f"{name:<15} {desc}")
    return 0


def _lazy(module: str) -> Callable[[list[str]], int]:
    """``module``'s ``main``, imported when its command runs (importing every command would load every engine). An
    entry point that reports user errors itself runs unwrapped: :func:`main` reports them once."""
    def run(argv: list[str]) -> int:
        import importlib

        command = importlib.import_module(module).main
        return getattr(command, "__wrapped__", command)(argv)

    return run


COMMANDS = {"train": _lazy("scale_ocr.train"), "ray-train": _lazy("scale_ocr.cli.ray_train"),
            "verify": _lazy("scale_ocr.cli.verify"), "export": _export, "predict": _predict,
            "evaluate": _lazy("scale_ocr.cli.evaluate"), "evaluate-pages": _evaluate_pages,
            "make-shards": _lazy("scale_ocr.cli.make_shards"), "make-cache": _lazy("scale_ocr.cli.make_cache"),
            "make-dataset": _lazy("scale_ocr.cli.make_dataset"),
            "estimate-memory": _lazy("scale_ocr.cli.estimate_memory"), "plan": _lazy("scale_ocr.cli.plan"),
            "bench": _benchmark("scaling", "bench"), "max-model": _benchmark("max_model", "max-model"),
            "models": _models, "strategies": _strategies, "summary": _lazy("scale_ocr.cli.summary")}


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        say(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    prepare_process()  # inherited by every job a command launches; evaluation and page OCR read many input shapes
    if command not in COMMANDS:
        say(f"scale-ocr: error: unknown command {command!r}\n{USAGE}", end="", err=True)
        return 2
    return COMMANDS[command](rest)


if __name__ == "__main__":
    sys.exit(main())
