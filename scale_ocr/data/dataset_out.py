"""Where ``scale-ocr make-dataset`` writes: a hidden staging folder beside OUT that becomes OUT by one rename once
everything is written, and the docTR folders written into it (:class:`FolderWriter`).

OUT is decided at start: a link, a file or a folder with anything in it is refused before any page is read. The
staging folder is named ``.OUT.partial-HOST-PID``; one left by a killed run on this host (its pid gone) is removed
by the next run into the same OUT, which says so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
from pathlib import Path

from scale_ocr.disk import disk_fault
from scale_ocr.errors import UserError, say, shown


class FolderWriter:
    """docTR folders under ``root``: ``recognition/{train,val}`` (word crops), ``lines/{train,val}`` (line crops,
    labelled with their words joined by spaces) and ``detection/{train,val}`` (whole pages, labels with each
    polygon's word: what ``scale-ocr evaluate-pages`` reads)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.labels: dict[tuple[str, str], dict] = {}  # a folder only for a split that gets samples

    def _write(self, task: str, split: str, name: str, data: bytes, label: object) -> None:
        if (task, split) not in self.labels:
            (self.root / task / split / "images").mkdir(parents=True)
            self.labels[task, split] = {}
        with open(self.root / task / split / "images" / name, "xb") as f:  # a name is never written twice
            f.write(data)
        self.labels[task, split][name] = label

    def add(self, samples) -> None:  # noqa: ANN001 - make_dataset.PageSamples (that module imports this one)
        """A page's samples: its detection image and label, and its word crops."""
        if samples.page_png is None:
            return
        self._write("detection", samples.split, samples.page_name, samples.page_png, samples.page_label)
        for name, png, word in samples.crops:
            self._write("recognition", samples.split, name, png, word)
        for name, png, text in samples.lines:
            self._write("lines", samples.split, name, png, text)

    def close(self) -> None:
        for (task, split), labels in self.labels.items():
            write_json(self.root / task / split / "labels.json", labels)


def write_json(path: Path, obj: object, indent: int | None = None) -> None:
    """Sorted UTF-8 JSON (compact unless ``indent``): the same content gives the same bytes."""
    text = json.dumps(obj, indent=indent, sort_keys=True, ensure_ascii=False,
                      separators=(",", ": ") if indent else (",", ":"))
    path.write_text(text + "\n", encoding="utf-8")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64] or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def remove_stale(out: Path) -> None:
    """Remove the staging folders of runs into ``out`` on this host whose process is gone (killed), saying so."""
    prefix = f".{out.name}.partial-{_host()}-"
    try:
        entries = [p for p in out.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return
    for path in entries:
        pid = path.name[len(prefix):]
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not pid.isdigit() or _alive(int(pid)) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        say(f"scale-ocr: removed {shown(path.name)} beside {shown(str(out))}, the partial folder of an earlier run "
            f"that was killed (pid {pid} is gone)", err=True)


def staging_dir(out: Path) -> Path:
    """A fresh folder beside ``out`` that becomes ``out`` by one rename once everything is written; refuses an
    ``out`` that is a link, a file or a folder with anything in it."""
    if out.is_symlink():
        raise UserError(f"{shown(str(out))} is a symbolic link (to {shown(os.readlink(out))}); make-dataset writes OUT "
                        "by renaming a finished folder onto it and never writes through a link: pass the folder "
                        "itself or a new path")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{shown(str(out))} already exists and is not an empty folder; make-dataset never writes over "
                        "files: choose a new OUT or remove it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
        stage = out.parent / f".{out.name}.partial-{_host()}-{os.getpid()}"
        if stage.exists():
            shutil.rmtree(stage)  # ours: a run of this pid that died before its rename
        stage.mkdir()
    except OSError as exc:
        fault = disk_fault(exc, out, "the dataset", "nothing was written")
        if fault is not None:
            raise fault from None
        raise UserError(f"cannot create {shown(str(out))} ({exc.strerror}); choose a folder you can write to") from None
    return stage


def publish(stage: Path, out: Path) -> None:
    """``stage`` becomes ``out`` in one rename, which replaces an empty folder and fails on anything else."""
    try:
        stage.rename(out)
    except OSError as exc:
        raise UserError(f"{shown(str(out))} was filled by something else during the run ({exc.strerror}); nothing "
                        "was written over it: choose a new OUT and run again") from None
