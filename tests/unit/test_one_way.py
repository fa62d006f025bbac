"""One way in for user files, one way out to the terminal (issue 55; docs/faults.md "Entry points").

Every file a command reads from a user's path goes through :mod:`scale_ocr.disk`'s readers (non-blocking open,
a regular file by ``fstat``, a size cap before reading, no link inside a run or dataset folder), and every line
the package prints goes through :func:`scale_ocr.errors.say` (control characters escaped). Both are read from the
source: a new ``open(...)``, ``read_text()``, ``torch.load(path)`` or ``print(...)`` anywhere else fails here until
it goes the one way, or is listed below with the reason it reads no user's file.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "scale_ocr"

_OPENERS = {"open", "read_text", "read_bytes", "safe_open", "load_file", "PdfDocument", "FileSystemReader"}
_LOADERS = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("pickle", "load"), ("json", "load")}

# (module, function): why that read is not of a user's file, or how it is checked first.
READS_ELSEWHERE = {
    ("scale_ocr/disk.py", "open_user_file"): "the one way in",
    ("scale_ocr/disk.py", "open_own"): "the run's own files, written in place: O_NOFOLLOW and fstat",
    ("scale_ocr/disk.py", "atomic_file"): "a temp file it creates O_EXCL | O_NOFOLLOW",
    ("scale_ocr/checkpoint/safe_dcp.py", "load_tensors"): "torch.load of the handle open_user_file gave",
    ("scale_ocr/cli/main.py", "_write_overlay"): "predict's overlay, created exclusively (x): never over a file",
    ("scale_ocr/errors.py", "say"): "os.devnull, when the reader of the output went away",
    ("scale_ocr/checkpoint/safe_dcp.py", "load_bytes"): "bytes DCP read from files the manifest checked first",
    ("scale_ocr/checkpoint/export.py", "_export_identity"): "safetensors maps the path holds_safetensors opened first",
    ("scale_ocr/checkpoint/export.py", "load_export"): "safetensors maps the path holds_safetensors opened first",
    ("scale_ocr/checkpoint/export.py", "open_weights"): "safetensors maps the path holds_safetensors opened first",
    ("scale_ocr/checkpoint/weights_io.py", "read_state_dict"): "safetensors maps the path holds_safetensors opened",
    ("scale_ocr/data/cache.py", "__init__"): "torch.load of the handle open_user_file gave",
    ("scale_ocr/data/pdf_text.py", "load"): "PDFium reads the handle open_user_file gave",
    ("scale_ocr/data/dataset_out.py", "_write"): "a crop or page it writes, created exclusively (x) in its own staging",
    ("scale_ocr/data/shards.py", "_open"): "the shard it writes, created exclusively (x) in its own new folder",
    ("scale_ocr/data/shards.py", "_finish_shard"): "the shard it has just written, to hash it",
    ("scale_ocr/data/shards.py", "parse_shard"): "a shard's bytes, already read through open_user_file",
    ("scale_ocr/data/files.py", "load_image"): "images: the decode path, guarded by test_images.py",
    ("scale_ocr/data/files.py", "orientation_of"): "images: the decode path, guarded by test_images.py",
    ("scale_ocr/distributed/cores.py", "_v1_quota"): "the kernel's /sys/fs/cgroup, not a user's file",
    ("scale_ocr/distributed/cores.py", "_v2_quota"): "the kernel's /sys/fs/cgroup, not a user's file",
    ("scale_ocr/distributed/cores.py", "cgroup_quota"): "the kernel's /proc/self/cgroup",
    ("scale_ocr/distributed/process_group.py", "_torchrun_default_threads"): "the kernel's /proc/PPID/environ",
    ("scale_ocr/distributed/round_store.py", "warn_if_joins_would_hang"): "the kernel's /proc/PPID/cmdline",
    ("scale_ocr/memory/meter.py", "resident_bytes"): "the kernel's /proc/self/statm",
    ("scale_ocr/run/mfu.py", "_cpu_model"): "the kernel's /proc/cpuinfo",
    ("scale_ocr/run/mfu.py", "_code_version"): "scale_ocr's own installed source files (the FLOP-count cache's key)",
    ("scale_ocr/planning/host_probe.py", "_spawn"): "its own child's output, in a temp folder it made",
    ("scale_ocr/planning/host_probe.py", "engine_cost"): "its own child's metrics, in a temp folder it made",
    ("scale_ocr/cli/verify.py", "_launch"): "its own children's logs, created exclusively (x) in a temp folder it made",
    ("scale_ocr/cli/verify.py", "_train"): "its own child run's metrics, in a temp folder it made",
}


def _calls(path: Path):
    """(function, call name) of every file-reading call in ``path``, with the function that holds it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Call):
                f = child.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
                if name in _OPENERS or (base, name) in _LOADERS:
                    found.append((inner, f"{base + '.' if base else ''}{name}"))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_user_files_are_opened_one_way():
    """No module reads a file but through scale_ocr.disk's readers, save the reads listed with their reason."""
    seen: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for where, call in _calls(path):
            seen.setdefault((rel, where), []).append(call)
    stray = {k: v for k, v in seen.items() if k not in READS_ELSEWHERE}
    assert not stray, ("read through scale_ocr.disk.open_user_file/read_user_* (or list with its reason):\n"
                       + "\n".join(f"{m}:{f}: {c}" for (m, f), c in sorted(stray.items())))
    stale = set(READS_ELSEWHERE) - set(seen)
    assert not stale, f"listed but reading nothing now (remove them): {sorted(stale)}"


def test_the_read_guard_finds_a_stray_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import json\nfrom pathlib import Path\n\n\ndef f(p):\n    return json.loads(Path(p).read_text())\n")
    assert _calls(bad) == [("f", "read_text")]


def _prints(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "print":
            found.append(f"{node.lineno}: print")
        elif (isinstance(f, ast.Attribute) and f.attr in ("write", "writelines") and isinstance(f.value, ast.Attribute)
              and isinstance(f.value.value, ast.Name) and f.value.value.id == "sys"):
            found.append(f"{node.lineno}: sys.{f.value.attr}.{f.attr}")
    return found


def test_the_terminal_is_written_one_way():
    """Only scale_ocr.errors.say writes to stdout or stderr: every line escaped, whatever a file or flag held."""
    stray = [f"{p.relative_to(ROOT)}:{line}" for p in sorted(PACKAGE.rglob("*.py")) for line in _prints(p)
             if p != PACKAGE / "errors.py"]  # say's own write: a stream it picks, not sys.stdout.write
    assert not stray, "print through scale_ocr.errors.say:\n" + "\n".join(stray)


def test_the_print_guard_finds_a_stray_print(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\n\nprint('x')\nsys.stderr.write('y')\n")
    assert _prints(bad) == ["3: print", "4: sys.stderr.write"]


def _decorated_by_reporter(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, ast.FunctionDef) and n.name == name
               and any(ast.unparse(d).endswith("report_user_errors") for d in n.decorator_list) for n in tree.body)


def test_every_entry_point_runs_under_the_reporter():
    """Each ``python -m``/script entry and the console script end through report_user_errors: one line and a
    documented exit code, never a traceback."""
    unreported = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if not (isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)):
                continue
            text = ast.unparse(node)
            called = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            if "report_user_errors(" in text or any(_decorated_by_reporter(tree, n) for n in called):
                continue
            if "exit(" not in text and "SystemExit" not in text:  # not an entry (train.py's gc around its imports)
                continue
            unreported.append(path.relative_to(ROOT).as_posix())
    main = ast.parse((PACKAGE / "cli" / "main.py").read_text(encoding="utf-8"))
    assert _decorated_by_reporter(main, "main"), "the console script scale-ocr must run under report_user_errors"
    assert not unreported, f"entry points not under report_user_errors: {unreported}"


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """``scale-ocr summary RUN | head -3``: the closed pipe ends the command with 141 (128 + SIGPIPE), as Unix tools
    end, not with a line blaming a lost rank. A command under the reporter writes far more than a pipe holds."""
    import subprocess
    import sys

    script = ("from scale_ocr.errors import report_user_errors, say\n"
              "main = report_user_errors(lambda: [say('x' * 100) for _ in range(100_000)] and 0)\n"
              "raise SystemExit(main())\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and not err, err
