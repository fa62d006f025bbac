"""``scale-ocr make-dataset``: PDFs built here with known words at known places, turned into docTR folders and read
back; the split, determinism, the summary's counts, every refusal, and one real born-digital PDF.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pypdfium2 as pdfium
import pytest
from conftest import _env, fixture_dir
from fpdf import FPDF
from PIL import Image

from scale_ocr.boxes.crop import PAD
from scale_ocr.cli.main import main
from scale_ocr.data import pdf_text
from scale_ocr.data.detection import DetectionFolder
from scale_ocr.data.page_pool import parallel_map
from scale_ocr.data.recognition import RecognitionFolder
from scale_ocr.disk import EXIT_DISK_FULL
from scale_ocr.errors import EXIT_FAULT, RunStopped
from scale_ocr.vocab import VOCABS, Vocab
from tests.helpers.pdfs import Layout, write_encrypted, write_page_of, write_pdf

DPI = 100
LONG = "ABCDEFGHIJKLMNOPRSTUVWXZ0123456789"  # 34 CTC frames: more than a 128-pixel-wide recognizer's 32
REAL_PDFS = Path(__file__).resolve().parents[2] / ".venv" / "real-pdfs"
A_PAGES = [Layout([(40, 60, 24, "Hello"), (200, 60, 24, "World"), (40, 140, 24, "naïve"), (200, 140, 18, "Label"),
                   (40, 220, 12, "Tide"), (200, 220, 12, "Hi.Doc.Io"),  # flat dots inside a word
                   (40, 260, 10, LONG)]),
           Layout([], image_only=True),
           Layout([(40, 80, 20, "Rotated"), (220, 80, 20, "Held"), (40, 200, 20, "Able")], rotate=90)]
B_PAGES = [Layout([(60, 90, 20, "Crossed"), (220, 200, 20, "Field")], crop_left_bottom=(30, 20)),
           Layout([(50, 100, 22, "Hold"), (200, 250, 16, "All"), (-200, 200, 20, "Gone"), (375, 160, 20, "Edit")],
                  invisible=[(200, 100, 20, "Ghost")]),
           Layout([], image_only=True, invisible=[(50, 60, 20, "Scanned"), (150, 60, 20, "Text")])]  # an OCR layer


def _run(*args: object) -> int:
    return main(["make-dataset", *map(str, args)])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Two documents (6 pages: one image-only, one an image under invisible text, one /Rotate 90, one with a CropBox,
    one with an invisible word, a word off the page and a word cut by its edge), made into a dataset."""
    with fixture_dir(tmp_path_factory, "pdfs") as root:
        (root / "in").mkdir()
        truth = {"a": write_pdf(root / "in" / "a.pdf", A_PAGES, DPI),
                 "b": write_pdf(root / "in" / "b.pdf", B_PAGES, DPI)}
        assert _run(root / "in", root / "out", "--dpi", DPI, "--val-count", 1, "--jobs", 1) == 0
        yield root, truth


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _labels(out: Path, task: str) -> dict[str, tuple[str, object]]:
    """Every label of a task, over both splits: file name -> (split, label)."""
    return {name: (split, label) for split in ("train", "val")
            for name, label in json.loads((out / task / split / "labels.json").read_text()).items()}


def _page_of(summary: dict, name: str) -> tuple[str, int]:
    """(document letter, 0-based page) of a page file name, through the summary's document hashes."""
    ids = {d["sha256"][:16]: Path(d["path"]).stem for d in summary["documents"]}
    doc_id, page = Path(name).stem.split("_")[:2]
    return ids[doc_id], int(page[1:]) - 1


def _ink_box(gray: np.ndarray, box, margin: int = 4) -> tuple[float, float, float, float]:
    """The bounding box of dark pixels around ``box`` (pixel edges, as boxes are continuous)."""
    x0, y0 = max(0, int(box[0]) - margin), max(0, int(box[1]) - margin)
    ys, xs = np.nonzero(gray[y0:int(box[3]) + margin, x0:int(box[2]) + margin] < 128)
    return x0 + xs.min(), y0 + ys.min(), x0 + xs.max() + 1, y0 + ys.max() + 1


def test_boxes_and_words_round_trip(built):
    """Every true word is labelled on its page where the layout put it (within a tenth of its size) and exactly on
    its ink (1.5 px); no ink lies outside the boxes (the out-of-vocabulary word keeps its box); every crop is
    its word's pixels, upright; both folders load as training reads them."""
    root, truth = built
    out, summary = root / "out", json.loads((root / "out" / "summary.json").read_text())
    pages = _labels(out, "detection")
    seen = set()
    for name, (split, label) in pages.items():
        doc, index = _page_of(summary, name)
        gray = np.asarray(Image.open(out / "detection" / split / "images" / name).convert("L"))
        assert label["img_dimensions"] == list(gray.shape)
        boxes = np.array(label["polygons"]).reshape(-1, 4, 2)
        boxes = np.concatenate([boxes.min(axis=1), boxes.max(axis=1)], axis=1)
        expected = [w for w in truth[doc] if w.page == index]
        assert sorted(label["words"]) == sorted(w.text for w in expected)
        for word in expected:
            got = boxes[label["words"].index(word.text)]
            tol = 0.1 * (word.box[3] - word.box[1]) / 0.718 + 1  # a tenth of the font size, in pixels
            assert np.abs(got - word.box).max() < tol, (word, got)
            inside = np.array([got[0] > 0, got[1] > 0, got[2] < gray.shape[1], got[3] < gray.shape[0]])  # not clipped
            assert np.abs(got - _ink_box(gray, got))[inside].max() <= 1.5, (word.text, got, _ink_box(gray, got))
            seen.add((doc, index, word.text))
        covered = np.zeros_like(gray, dtype=bool)
        for x0, y0, x1, y1 in boxes:
            covered[max(0, int(y0) - 2):int(y1) + 3, max(0, int(x0) - 2):int(x1) + 3] = True
        assert not ((gray < 128) & ~covered).any(), f"{name}: ink outside every box"
    assert seen == {(d, w.page, w.text) for d, words in truth.items() for w in words}
    crops = _labels(out, "recognition")
    assert sorted(w for _, w in crops.values()) == sorted(w.text for ws in truth.values() for w in ws
                                                          if w.text not in ("naïve", LONG) and not w.cut)
    for name, (split, word) in crops.items():
        crop = np.asarray(Image.open(out / "recognition" / split / "images" / name).convert("L"))
        page_name = "_".join(name.split("_")[:2]) + ".png"
        page_split, label = pages[page_name]
        assert page_split == split and word in label["words"]
        # The crop is the page's pixels under the word's box and page OCR's padding, turned upright: every word
        # here is wider than high.
        gray = np.asarray(Image.open(out / "detection" / split / "images" / page_name).convert("L"))
        (x0, y0), (x1, y1) = np.min(label["polygons"][label["words"].index(word)], axis=0), \
            np.max(label["polygons"][label["words"].index(word)], axis=0)
        region = gray[max(0, int(np.floor(y0 - PAD))):int(np.ceil(y1 + PAD)),
                      max(0, int(np.floor(x0 - PAD))):int(np.ceil(x1 + PAD))]
        turned = np.rot90(region, 1 if _page_of(summary, page_name) == ("a", 2) else 0)  # /Rotate 90: reads down
        assert turned.shape == crop.shape and (turned == crop).all() and crop.shape[1] > crop.shape[0], word
    for split in ("train", "val"):
        assert len(DetectionFolder((str(out / "detection" / split),))) == len(summary["splits"][split]["pages"])
        assert len(RecognitionFolder((str(out / "recognition" / split),), Vocab(VOCABS["latin"]))) == \
            summary["splits"][split]["recognition_words"]


def test_summary_counts(built):
    root, truth = built
    summary = json.loads((root / "out" / "summary.json").read_text())
    words = sum(len(w) for w in truth.values())  # on the pixels: "Edit", cut by the page's edge, among them
    assert summary["pages"] == {"in_documents": 6, "written": 4,
                                "skipped": {"no_text_layer": 1, "invisible_text_layer": 1}}
    assert summary["words"] == {"in_text_layer": words + 4, "detection": words, "recognition": words - 3,
                                "lines": words - 2,  # every word on a line of its own; the too long one too
                                "left_out": {"invisible": 3, "off_page": 1},
                                "left_out_of_recognition": {"out_of_vocab": 1, "cut_by_page_edge": 1, "too_long": 1}}
    train, val = summary["splits"]["train"], summary["splits"]["val"]
    assert len(val["documents"]) == 1 and len(train["documents"]) == 1  # --val-count 1, by document
    assert not set(train["pages"]) & set(val["pages"]) and len(train["pages"]) + len(val["pages"]) == 4
    assert train["recognition_words"] + val["recognition_words"] == words - 3
    assert train["lines"] + val["lines"] == words - 2
    lines = _labels(root / "out", "lines")  # each line in its page's split: no page leaks across the split
    pages = _labels(root / "out", "detection")
    for name, (split, text) in lines.items():
        page_split, label = pages["_".join(name.split("_")[:2]) + ".png"]
        assert split == page_split and text in label["words"]


def test_deterministic_and_page_split(built):
    """Another run with two processes writes the same bytes; a split by page puts no page on both sides."""
    root, _ = built
    assert _run(root / "in" / "b.pdf", root / "in" / "a.pdf", root / "again", "--dpi", DPI, "--val-count", 1,
                "--jobs", 2) == 0
    assert _tree(root / "again") == _tree(root / "out")  # argument order and process count change nothing
    assert _run(root / "in", root / "by_page", "--dpi", DPI, "--split-by", "page", "--val-fraction", 0.5,
                "--seed", 3, "--jobs", 1) == 0
    splits = json.loads((root / "by_page" / "summary.json").read_text())["splits"]
    # 2 of the 5 pages with a text layer drawn for val (the one under an invisible OCR layer is skipped after)
    assert splits["val"]["pages"] and splits["train"]["pages"]
    assert not set(splits["val"]["pages"]) & set(splits["train"]["pages"])
    assert sorted(splits["val"]["pages"] + splits["train"]["pages"]) == sorted(
        p for s in ("train", "val") for p in json.loads((root / "out" / "detection" / s / "labels.json").read_text()))


FAULTS = {
    "not_pdf": (lambda d: (d / "x.pdf").write_text("hello"), ["x.pdf"], "is not a PDF"),
    "damaged": (lambda d: (d / "x.pdf").write_bytes(b"%PDF-1.4\n1 0 obj garbage\n"), ["x.pdf"],
                "cannot be read as a PDF (Failed to load document (PDFium: Data format error));"),
    "encrypted": (lambda d: write_encrypted(d / "x.pdf"), ["x.pdf"], "is encrypted"),
    "no_text_layer": (lambda d: write_pdf(d / "x.pdf", [Layout([], image_only=True)], DPI), ["x.pdf"],
                      "has a text layer"),
    "out_not_empty": (lambda d: (d / "out").mkdir() or (d / "out" / "keep").write_text("x"), ["a.pdf"],
                      "already exists and is not an empty folder"),
    "dpi": (None, ["a.pdf", "--dpi", "1000"], "--dpi 1000 is outside 50..600"),
    "jobs": (None, ["a.pdf", "--jobs", "0"], "--jobs 0 is below 1"),
    "reco_width": (None, ["a.pdf", "--reco-width", "-1"], "--reco-width -1 is negative"),
    "val_count": (None, ["a.pdf", "--val-count", "-1"], "--val-count -1 is negative"),
    "too_large": (lambda d: write_page_of(d / "x.pdf", (3000, 3000)), ["x.pdf", "--dpi", "300"],
                  "pass --dpi 195 or lower"),
    "one_document": (None, ["a.pdf"], "leave train none"),
    "missing": (None, ["nothing.pdf"], "does not exist"),
    # M03: a zip of PDFs named .pdf: its first member starts within the first KB, and PDFium would read it
    "zip": (lambda d: _zip(d / "x.pdf", d / "a.pdf"), ["x.pdf", "a.pdf"], "is a zip archive holding a PDF"),
    # M07: no allowed --dpi fits, so the line must not advise one
    "huge_page": (lambda d: write_page_of(d / "x.pdf", (20000, 20000)), ["x.pdf"],
                  "too large even at the lowest --dpi 50: leave this document out"),
    "fifo": (lambda d: os.mkfifo(d / "x.pdf"), ["x.pdf"], "'x.pdf' is a named pipe (FIFO), not a PDF file"),
    # M17: decided at start, not after every page is rendered
    "out_link": (lambda d: (d / "target").mkdir() or (d / "out").symlink_to("target"), ["a.pdf"],
                 "is a symbolic link (to 'target')"),
}


def _zip(path: Path, member: Path) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as z:
        z.write(member, member.name)


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_faults_are_one_line(case, tmp_path, capsys, monkeypatch):
    """docs/faults.md rows 100-107: one line, exit 2, nothing written."""
    make, args, words = FAULTS[case]
    write_pdf(tmp_path / "a.pdf", A_PAGES[:1], DPI)
    if make:
        make(tmp_path)
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # paths as typed: relative
    assert _run(*args, "out", *([] if "--dpi" in args else ["--dpi", DPI])) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err
    assert case in ("out_not_empty", "out_link") or not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))


def test_pages_keep_their_colours(tmp_path):
    """PDFium renders BGR unless asked: a red square must stay red (a swap would go unnoticed on black text)."""
    pdf = FPDF(unit="pt", format=(200, 100))
    pdf.add_page()
    pdf.set_fill_color(255, 0, 0)
    pdf.rect(10, 10, 50, 50, style="F")
    pdf.output(str(tmp_path / "red.pdf"))
    document = pdfium.PdfDocument(tmp_path / "red.pdf")
    page = pdf_text.read_page(document, 0, 72)
    assert page.image.mode == "RGB" and tuple(np.asarray(page.image)[30, 30]) == (255, 0, 0) and page.words == []
    document.close()


def _real_pdf(tmp_path: Path) -> Path:
    """The first pages of the first real PDF `make install` fetched."""
    found = sorted(REAL_PDFS.rglob("*.pdf")) if REAL_PDFS.is_dir() else []
    if not found:
        pytest.skip(f"no real PDFs under {REAL_PDFS}: `make real-pdfs` (as root with apt-get) fetches them")
    src = pdfium.PdfDocument(found[0])
    doc = pdfium.PdfDocument.new()
    doc.import_pages(src, [0, 1, 2])
    doc.save(str(tmp_path / "real.pdf"))
    doc.close()
    src.close()
    return tmp_path / "real.pdf"


def test_real_pdf(tmp_path):
    """A real document's words: each crop's word is the text layer's, every box lies on its page, and the words
    with boxes are the text layer's words (PDFium's own text of the page, split at white space)."""
    pdf = _real_pdf(tmp_path)
    assert _run(pdf, tmp_path / "out", "--dpi", 72, "--val-fraction", 0, "--jobs", 1, "--reco-width", 0) == 0
    labels = json.loads((tmp_path / "out" / "detection" / "train" / "labels.json").read_text())
    doc = pdfium.PdfDocument(pdf)
    assert len(labels) == 3
    for i, (_, label) in enumerate(sorted(labels.items())):
        h, w = label["img_dimensions"]
        boxes = np.array(label["polygons"])
        assert (boxes >= 0).all() and (boxes[..., 0] <= w).all() and (boxes[..., 1] <= h).all()
        layer = doc[i].get_textpage().get_text_range().replace("\ufffe", "-\n").split()  # a line-end hyphen ends
        assert label["words"] == layer and len(layer) > 50  # its word
    doc.close()
    crops = json.loads((tmp_path / "out" / "recognition" / "train" / "labels.json").read_text())
    for name, word in crops.items():
        page = labels["_".join(name.split("_")[:2]) + ".png"]
        assert word in page["words"]
    # Its lines read back as its words: per page, the lines in order, split at their single spaces, are the word
    # crops in order (a word recognition leaves out ends a line, so none is in a line either), several a line.
    lines = json.loads((tmp_path / "out" / "lines" / "train" / "labels.json").read_text())
    for page in labels:
        stem = page[:-len(".png")] + "_"
        words = [crops[n] for n in sorted(crops) if n.startswith(stem)]
        read = [w for n in sorted(lines) if n.startswith(stem) for w in lines[n].split(" ")]
        assert read == words and len(words) > 3 * sum(n.startswith(stem) for n in lines), page


def test_a_page_in_two_files_is_read_once(tmp_path, capsys):
    """M03's class: the same page in two different files (a copy inside another PDF, a re-saved file) is read once,
    so it cannot land on both sides of the split; the copy is counted as repeated_page."""
    (tmp_path / "in").mkdir()
    write_pdf(tmp_path / "in" / "a.pdf", A_PAGES[:1], DPI)
    write_pdf(tmp_path / "in" / "b.pdf", [Layout([(40, 60, 24, "Other")]), A_PAGES[0]], DPI)  # other bytes
    write_pdf(tmp_path / "in" / "c.pdf", [Layout([(40, 60, 24, "Third")])], DPI)
    assert _run(tmp_path / "in", tmp_path / "out", "--dpi", DPI, "--split-by", "page", "--val-fraction", 0.5,
                "--jobs", 1) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["pages"]["skipped"] == {"repeated_page": 1} and summary["pages"]["written"] == 3
    words = [" ".join(label["words"]) for split in ("train", "val")
             for label in json.loads((tmp_path / "out" / "detection" / split / "labels.json").read_text()).values()]
    assert sorted(words) == sorted(["Other", "Third", " ".join(w[3] for w in A_PAGES[0].words)])


@contextlib.contextmanager
def _file_size_limit(limit: int):
    """RLIMIT_FSIZE in this process: a larger write fails with EFBIG, a real disk fault (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_full_disk_is_one_line(tmp_path, capsys):
    """M19: a write that fails for lack of space (here the file size limit) ends in one line, exit 74, and the
    staging folder is removed."""
    write_pdf(tmp_path / "a.pdf", A_PAGES[:1], DPI)
    with _file_size_limit(2000):  # a page's PNG is larger
        code = _run(tmp_path / "a.pdf", tmp_path / "out", "--dpi", DPI, "--val-fraction", 0, "--jobs", 1)
    err = capsys.readouterr().err.strip()
    assert code == EXIT_DISK_FULL and len(err.splitlines()) == 1, err
    assert f"could not write the dataset {tmp_path / 'out'} (EFBIG" in err and "nothing was written" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pdf"]


def test_names_are_escaped_and_stale_staging_removed(tmp_path, capsys):
    """M13: a repeated document's name cannot write to the terminal raw. M21: the staging folder a killed run left
    (on this host, its pid gone) is removed by the next run, in one line."""
    (tmp_path / "in").mkdir()
    write_pdf(tmp_path / "in" / "a.pdf", A_PAGES[:1], DPI)
    evil = "b\x1b[2J\nscale-ocr: wrote FAKE\x07.pdf"
    (tmp_path / "in" / evil).write_bytes((tmp_path / "in" / "a.pdf").read_bytes())
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".out.partial-{socket.gethostname()}-{dead.pid}"
    (stale / "detection").mkdir(parents=True)
    assert _run(tmp_path / "in", tmp_path / "out", "--dpi", DPI, "--val-fraction", 0, "--jobs", 1) == 0
    captured = capsys.readouterr()
    assert not stale.exists() and f"removed {stale.name!r} beside" in captured.err
    assert "\x1b" not in captured.out + captured.err and "\x07" not in captured.out
    assert not any(line.startswith("scale-ocr: wrote FAKE") for line in captured.out.splitlines())
    assert "repeated documents, read once: '" + str(tmp_path / "in" / "b\\x1b[2J\\nscale-ocr: wrote FAKE\\x07.pdf'") \
        in captured.out


def _session_processes(sid: int) -> list[int]:
    def session(pid: str) -> int | None:
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[4])
        except (OSError, IndexError, ValueError):
            return None
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and session(p) == sid]


@pytest.mark.parametrize(("sig", "group", "code", "line"), [
    (signal.SIGINT, True, 130, "scale-ocr: interrupted (Ctrl-C); nothing was written"),
    (signal.SIGTERM, False, 143, "scale-ocr: stopped: SIGTERM received; nothing was written")])
def test_stopped_while_rendering(sig, group, code, line, tmp_path):
    """M20, M21: Ctrl-C (to the process group, as a terminal sends it) or SIGTERM (to the command alone) while two
    workers render: one line and its code, no worker traceback, no worker or staging folder left behind. At 600 dpi
    the 40 pages take seconds to render after the first is written: the signal lands while they do, even on a loaded
    host (at 300 dpi the first write came within a second of the last, and a late signal found the dataset done)."""
    write_pdf(tmp_path / "big.pdf", [Layout([(20, 20 + 14 * k, 10, f"line{k} of page{p}") for k in range(18)])
                                     for p in range(40)], DPI)
    write_pdf(tmp_path / "b.pdf", A_PAGES[:1], DPI)
    proc = subprocess.Popen([sys.executable, "-m", "scale_ocr.cli.main", "make-dataset", str(tmp_path / "big.pdf"),
                             str(tmp_path / "b.pdf"), str(tmp_path / "out"), "--dpi", "600", "--jobs", "2"],
                            env=_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    # While the workers render: once a page is written (the staging folders exist from the start, before the pool).
    while not list(tmp_path.glob(".out.partial-*/detection/*/images/*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "make-dataset ended before it was stopped: give it more pages"
    (os.killpg if group else os.kill)(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code and err.strip().startswith(line) and len(err.strip().splitlines()) == 1, err
    time.sleep(0.5)  # the resource tracker sees its pipe close
    assert not _session_processes(proc.pid)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.pdf", "big.pdf"]


def test_an_interrupt_after_the_dataset_is_whole_says_so_and_keeps_it(tmp_path, monkeypatch, capsys):
    """A Ctrl-C that lands once OUT is renamed into place (while the summary prints, or the workers exit) keeps OUT
    and says it was written, not "nothing was written"."""
    from scale_ocr.data import make_dataset as module

    def publish_then_interrupted(stage, out):
        real_publish(stage, out)
        raise KeyboardInterrupt

    real_publish = module.publish
    monkeypatch.setattr(module, "publish", publish_then_interrupted)
    write_pdf(tmp_path / "a.pdf", A_PAGES[:1], DPI)
    assert _run(tmp_path / "a.pdf", tmp_path / "out", "--dpi", DPI, "--val-fraction", 0, "--jobs", 1) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("scale-ocr: interrupted (Ctrl-C); ") and "was already written whole" in err, err
    assert (tmp_path / "out" / "summary.json").is_file()


def test_a_worker_that_dies_is_one_line():
    """A page-reading worker killed (the kernel's OOM killer, kill -9) ends the command in one line, exit 1."""
    with pytest.raises(RunStopped, match="a worker process reading pages died") as info:
        list(parallel_map(os._exit, [1, 1], 2))  # each worker exits at once, as one killed does
    assert info.value.exit_code == EXIT_FAULT


def test_stopping_the_workers_leaves_no_process_and_no_thread_behind():
    """Closed while its workers are busy, parallel_map ends them at once and leaves no helper thread: the
    interpreter waits for its threads at exit, and concurrent.futures' result thread, stopped mid-message, made a
    SIGTERM'd make-dataset hang after its line (2 of 30 stops)."""
    import multiprocessing
    import threading

    before = set(threading.enumerate())
    pages = parallel_map(time.sleep, [0, 30, 30, 30], 2)
    started = time.monotonic()
    assert next(pages) is None
    pages.close()
    assert time.monotonic() - started < 20  # spawning two workers, not the 30 s pages
    assert not multiprocessing.active_children() and set(threading.enumerate()) == before


def test_an_error_in_a_worker_is_raised_in_the_parent():
    """fn's exception in a worker reaches the caller as itself, as a call in the parent would raise it."""
    with pytest.raises(ValueError, match="invalid literal"):
        list(parallel_map(int, ["1", "x", "3"], 2))
