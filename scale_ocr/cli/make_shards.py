"""``scale-ocr make-shards FOLDER... OUT``: docTR folders -> one shard set (:mod:`scale_ocr.data.shards`).

Every sample is checked as training checks a folder (the key stays inside ``images/``, the image decodes
within the task's size limits, the label is well formed); bad samples follow ``--on-bad-sample`` and are counted,
in the summary line and in the index. Samples are shuffled once, deterministically from ``--seed``, so each
shard mixes every folder; training shuffles again every epoch (shard order, then samples within a shard).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from scale_ocr.config import BAD_SAMPLE_POLICIES, SEED_MAX
from scale_ocr.data.files import ScanReport, read_labels
from scale_ocr.data.shards import IMAGE_EXTS, ShardWriter
from scale_ocr.disk import disk_fault, read_user_bytes
from scale_ocr.errors import UserError, on_interrupt, report_user_errors, say, shown, stop_on_sigterm

DEFAULT_PER_SHARD = {"recognition": 1000, "detection": 64}  # a few MB of crops, or of pages, a shard


class _AnyChars:
    """A vocabulary that knows every character: the set's characters are recorded, training checks them."""

    @staticmethod
    def unknown_chars(word: str) -> str:
        return ""


def _task_of(folder: Path) -> str:
    """recognition when the folder's labels map names to words, detection when to page labels."""
    labels = read_labels(folder, "recognition or detection", "words or page labels")
    first = next(iter(labels.values()), None)
    return "detection" if isinstance(first, dict) else "recognition"


def _words(folders: list[Path], on_bad: str, report: ScanReport) -> list[tuple[Path, str | dict]]:
    from scale_ocr.data.recognition import scan_folder

    out: list[tuple[Path, str | dict]] = []
    for f in folders:
        out += scan_folder(f, _AnyChars(), on_bad, report)
    return out


def _pages(folders: list[Path], on_bad: str, report: ScanReport) -> list[tuple[Path, str | dict]]:
    from scale_ocr.data.detection import scan_detection_folder

    out: list[tuple[Path, str | dict]] = []
    for f in folders:
        for page in scan_detection_folder(f, on_bad, report):  # decodes each page upright: its size is the scan's
            w, h = page.size
            out.append((page.path, {"polygons": page.polygons.tolist(), "words": page.words, "img_dimensions": [h, w]}))
    return out


def _image_bytes(path: Path) -> tuple[bytes, str]:
    """The file's bytes as they are, or, when webdataset would not know the type, the pixels every task decodes
    (scale_ocr.data.files.load_image: upright 8-bit RGB) as a lossless PNG."""
    ext = path.suffix.lower().lstrip(".")
    from scale_ocr.data.files import IMAGE_FILE_LIMIT, PAGE_LIMITS, reload_image

    if ext in IMAGE_EXTS:  # the folder's scan decoded it: a regular file, inside the folder
        return read_user_bytes(path, what="the image", limit=IMAGE_FILE_LIMIT, follow=True), ext
    import io


    buf = io.BytesIO()
    reload_image(path, PAGE_LIMITS).save(buf, format="PNG")  # the scan checked the tighter limit of its task
    return buf.getvalue(), "png"


def make_shards(folders: list[Path], out: Path, task: str | None, per_shard: int | None, seed: int,
                on_bad: str) -> tuple[int, int, ScanReport]:
    """Convert; returns (samples written, shards written, the scan's report)."""
    tasks = {_task_of(f) for f in folders} if task is None else {task}
    if len(tasks) > 1:
        raise UserError(f"{', '.join(map(str, folders))} mix recognition and detection folders; a set holds one task")
    task = tasks.pop()
    meta = {"seed": seed}
    writer = ShardWriter(out, task, per_shard or DEFAULT_PER_SHARD[task], meta)  # refuses a non-empty OUT first
    report = ScanReport()
    try:
        samples = (_words if task == "recognition" else _pages)(folders, on_bad, report)
        if not samples:
            raise UserError(f"no usable samples in {', '.join(map(str, folders))}; nothing written")
        writer.meta["skipped"] = dict(report.skipped)
        for i, j in enumerate(np.random.default_rng(seed).permutation(len(samples))):
            path, label = samples[int(j)]
            image, ext = _image_bytes(path)
            writer.add(f"{i:09d}", image, ext, label)
        writer.close()
    except BaseException as exc:  # a mistake, a full disk, Ctrl-C or SIGTERM: no partial set is left
        writer.discard()
        fault = disk_fault(exc, out, "the shard set", f"nothing is kept (the partial set in {shown(out)} was removed)")
        if fault is not None:
            raise fault from None
        raise
    return len(samples), len(writer.shards), report


@report_user_errors
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="scale-ocr make-shards",
        description="Write docTR recognition or detection folders as one shard set (tar shards + shards.json) "
                    "that --train-path/--val-path read.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="docTR folders, then the new set's folder (new or "
                        "empty): FOLDER... OUT")
    parser.add_argument("--samples-per-shard", type=int, default=None, metavar="N",
                        help="samples a shard (default: 1000 word crops, 64 pages)")
    parser.add_argument("--seed", type=int, default=0, help="the write-time shuffle's seed")
    parser.add_argument("--task", choices=("recognition", "detection"), default=None,
                        help="default: from the folders' labels (words, or page labels)")
    parser.add_argument("--on-bad-sample", choices=BAD_SAMPLE_POLICIES, default="error",
                        help="stop at the first bad sample, or skip it and report the count")
    args = parser.parse_args(argv)
    if len(args.paths) < 2:
        raise UserError("make-shards needs at least one docTR folder and the output folder: FOLDER... OUT")
    if not 0 <= args.seed <= SEED_MAX:
        raise UserError(f"--seed {args.seed}: use a whole number from 0 to {SEED_MAX}")
    *folders, out = (Path(p) for p in args.paths)
    on_interrupt(f"nothing is kept: the partial set in {shown(out)} was removed")
    with stop_on_sigterm():
        n, k, report = make_shards(folders, out, args.task, args.samples_per_shard, args.seed, args.on_bad_sample)
    skipped = f"; skipped {report.num_skipped} bad samples {json.dumps(report.skipped)}" if report.num_skipped else ""
    say(f"make-shards: wrote {n} samples in {k} shards to {shown(out)}{skipped}")
    return 0
