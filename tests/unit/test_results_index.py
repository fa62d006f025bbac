"""benchmarks/results/README.md is the index of the reports: every folder is in it, every link resolves, each
benchmark has its section, and each folder's recorded ``--out`` is its own name (folders are never renamed)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
INDEX = RESULTS / "README.md"
SECTIONS = ("scaling", "overhead", "ddp_vs_dp", "convergence", "max_model", "large_model", "loader", "engine_knobs",
            "compute", "real_documents", "time_check", "scale_accuracy", "noise_scale", "critical_batch",
            "batch_ramp", "plan_check", "cross_documents", "line_pages", "pixel_batches")
RENAMED = {"overhead-vm-20261202-4610dcf": "overhead-vm-20261202"}  # renamed after the run; recorded --out
NO_RECORDED_OUT = {"quick-vm-20261130", "max-model-vm-20261201-b4", "max-model-vm-20261201-b8",
                   "large-model-vm-20261201", "compute-vm-20261202"}  # runs that predate command.txt


def folders() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_dir())


def recorded_command(folder: Path) -> str | None:
    """The command that made ``folder``: its command.txt, or the ``command`` of its results.json."""
    if (folder / "command.txt").is_file():
        return (folder / "command.txt").read_text().strip()
    if (folder / "results.json").is_file():
        return json.loads((folder / "results.json").read_text()).get("command")
    return None


def recorded_out(command: str) -> str | None:
    words = shlex.split(command)
    return Path(words[words.index("--out") + 1]).name if "--out" in words else None


def test_every_folder_is_in_the_index_and_every_link_resolves():
    text = INDEX.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)\)", text)
    linked = {link.split("/")[0] for link in links}
    assert not set(folders()) - linked, f"folders missing from the index: {sorted(set(folders()) - linked)}"
    broken = [link for link in links if not (INDEX.parent / link).exists()]
    assert not broken, f"links in the index that lead nowhere: {broken}"


def test_the_index_has_one_section_per_benchmark():
    headings = re.findall(r"^## (.+)$", INDEX.read_text(encoding="utf-8"), flags=re.M)
    assert tuple(headings) == SECTIONS


@pytest.mark.parametrize("name", folders())
def test_a_folders_recorded_out_is_its_name(name):
    command = recorded_command(RESULTS / name)
    if name in NO_RECORDED_OUT:
        assert command is None, f"{name} records its command now: check its --out and drop it from the exceptions"
        return
    assert command is not None, f"{name} records no command (command.txt)"
    assert recorded_out(command) == RENAMED.get(name, name), f"{name} was made with {command!r}"


def test_the_known_exceptions_are_said_in_the_index():
    text = INDEX.read_text(encoding="utf-8")
    for name in [*RENAMED, *NO_RECORDED_OUT]:
        assert f"`{name}`" in text, f"the index does not explain the exception {name}"


def test_a_benchmarks_command_txt_runs_again_as_typed(tmp_path, monkeypatch):
    """command.txt is the command quoted as a shell reads it: an argument with a space or an empty one survives."""
    from benchmarks.harness import write_command

    argv = ["--out", "results/a b", "--det-batches", "", "--strategies", "ddp,zero3"]
    monkeypatch.setattr("sys.argv", ["benchmarks/scaling.py", *argv])
    write_command(tmp_path, "scaling")
    assert shlex.split((tmp_path / "command.txt").read_text()) == ["python", "-m", "benchmarks.scaling", *argv]
