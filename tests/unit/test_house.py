"""The house keeps its shape: no import cycle, config and registries as leaves, few top-level modules, small
files and functions.

The import graph is read from the source (``ast``), function-local imports included, so a cycle hidden in a
function body counts as one (imports under ``if TYPE_CHECKING:`` never run and are left out). ``import a.b`` \
counts as an arrow to ``a.b``; ``from a import b`` to ``a.b`` when
``b`` is a module, else to ``a``. A package's own ``__init__`` is not counted as imported by its children (Python
runs it first, but it is the package's face, not a dependency of the child).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "scale_ocr"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_TOP_LEVEL_MODULES = 8  # besides __init__.py and the packages


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_names(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module name an import statement anywhere in ``path`` (functions included) refers to."""
    names: set[str] = set()
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for block in ast.walk(tree):  # annotations only: ``if TYPE_CHECKING:`` imports never run
        if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            block.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            submodules = {f"{base}.{alias.name}" for alias in node.names} & known
            names.update(submodules)
            if len(submodules) < len(node.names):  # some names come from the module ``base`` itself
                names.add(base)
    return names


def import_graph() -> dict[str, set[str]]:
    mods = modules()

    def owner(name: str) -> str | None:  # the longest known module that ``name`` starts with
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = {owner(n) for n in imported_names(name, path, set(mods)) if n.startswith("scale_ocr")}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in scale_ocr/ (function-local imports included):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("leaf, allowed", [
    ("scale_ocr.config", {"scale_ocr.errors", "scale_ocr.vocab"}),
    ("scale_ocr.errors", set()),
    ("scale_ocr.vocab", {"scale_ocr.errors", "scale_ocr.disk"}),  # --vocab-file, read the one way user files are
    ("scale_ocr.tasks.registry", {"scale_ocr.errors", "scale_ocr.models.factory"}),  # a model names its task
    ("scale_ocr.models.registry", {"scale_ocr.errors", "scale_ocr.config"}),  # DEFAULT_LR: a config default
    # the interface it registers (base) and the config its launch checks read; no engine
    ("scale_ocr.strategies.registry", {"scale_ocr.errors", "scale_ocr.config", "scale_ocr.distributed.process_group",
                                       "scale_ocr.strategies.base"}),
])
def test_leaves_import_nothing_above_them(leaf, allowed):
    """Config sits at the ground floor and the registries are leaves: they import no task, model or strategy."""
    extra = import_graph()[leaf] - allowed
    assert not extra, f"{leaf} imports {sorted(extra)}; it may import only {sorted(allowed) or 'nothing'} of scale_ocr"


# The wings, ground floor first: a wing imports only from floors below its own. config, errors and the other
# top-level leaves are the ground; the launch script and the command line sit on top.
FLOORS = (
    ("scale_ocr", "errors"),
    ("disk",),  # the one way in for user files and out for run files: every reader above it uses it
    ("vocab", "config", "precision"),
    ("distributed", "memory"),
    ("models",),
    ("optim", "boxes"),
    ("data", "tracking"),
    ("strategies", "tasks"),
    ("checkpoint",),
    ("planning",),
    ("run",),
    ("train",),
    ("cli",),
    ("__main__",),
)
ALLOWED_UP = {("scale_ocr.train", "scale_ocr.cli.args")}  # the launch script parses its own flags


def wing(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a wing to another wing on its own floor or above, as ``a -> b``."""
    floor = {w: i for i, names in enumerate(FLOORS) for w in names}
    return [f"{source} -> {target}" for source, targets in sorted(graph.items()) for target in sorted(targets)
            if wing(source) != wing(target) and floor[wing(target)] >= floor[wing(source)]
            and (source, target) not in ALLOWED_UP]


def test_every_wing_has_a_floor():
    missing = {wing(m) for m in modules()} - {w for names in FLOORS for w in names}
    assert not missing, f"give these a floor in FLOORS: {sorted(missing)}"


def test_no_import_runs_up_a_floor():
    """Wings import only from the floors below theirs (function-local imports included); the one exception is the
    launch script's use of the argument parser."""
    found = upward_imports(import_graph())
    assert not found, ("imports that run up a floor (move the module to the wing its callers are in):\n"
                       + "\n".join(found))


def test_the_floor_check_finds_an_upward_import():
    graph = {"scale_ocr.models.flops": {"scale_ocr.tasks.registry"}, "scale_ocr.train": {"scale_ocr.cli.args"},
             "scale_ocr.tasks.base": {"scale_ocr.models.registry"}}
    assert upward_imports(graph) == ["scale_ocr.models.flops -> scale_ocr.tasks.registry"]


def test_few_top_level_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_LEVEL_MODULES, \
        f"{len(top)} modules at the top of scale_ocr/: {top}; put new ones in a wing"


def python_files() -> list[Path]:
    return sorted(p for d in ("scale_ocr", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py"))


def test_files_and_functions_stay_small():
    too_long = []
    for path in python_files():
        source = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        if source.count("\n") > MAX_FILE_LINES:
            too_long.append(f"{rel}: {source.count(chr(10))} lines (at most {MAX_FILE_LINES})")
        if rel.parts[0] == "tests":
            continue  # test functions are checked for size as files only
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {lines} lines (at most {MAX_FUNCTION_LINES})")
    assert not too_long, "split these:\n" + "\n".join(too_long)


def test_no_test_hooks_in_the_package():
    """Tests inject their hooks; production code reads no SCALE_OCR_TEST_* variable and ships no test reader."""
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if "SCALE_OCR_TEST_" in p.read_text()]
    assert not offenders, f"test hooks read by production code: {offenders}"


def test_the_architecture_page_names_every_module():
    """docs/architecture.md's table of wings names each module of the package (a new one is added there too)."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if p.name != "__init__.py" and f"`{p.name}`" not in page)
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_the_linter_reads_every_file_with_line_length_on():
    """ruff reads every module of the package (a folder named like one of its default excludes, ``dist``, was never
    read), and line length (E501) is checked."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (`pip install -e .[dev]`)")
    out = subprocess.run([ruff, "check", "scale_ocr", "--show-files"], cwd=ROOT, capture_output=True, text=True).stdout
    shown = {Path(line.strip()).resolve() for line in out.splitlines() if line.strip().endswith(".py")}
    assert sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py") if p.resolve() not in shown) == []
    long_line = f"x = {'1' * 130}\n"
    checked = subprocess.run([ruff, "check", "--stdin-filename", "scale_ocr/long.py", "-"], cwd=ROOT, input=long_line,
                             capture_output=True, text=True).stdout
    assert "E501" in checked, checked
