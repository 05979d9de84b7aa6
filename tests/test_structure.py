"""Dependencies point one way: entry points -> training -> parallel -> models / data.

Read with `ast` (nothing is imported), so function-level imports count too.
"""
import ast
from pathlib import Path
from typing import Iterator, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "owt_tf"
LIBRARY = ("planner", "runtime", "parallel", "fit", "training", "models", "data", "config")
ENTRY_POINTS = ("train", "evaluate", "export", "bench", "plan", "study", "launch", "prepare")
# The experiment drivers behind `python -m owt_tf.bench` / `owt_tf.study`, and the flag
# parsing the entry points share, belong to the entry points' side too.
FORBIDDEN = {f"owt_tf.{name}" for name in ENTRY_POINTS} | {"owt_tf.experiments", "owt_tf.cli"}


def _forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = PACKAGE.parent) -> Iterator[Tuple[int, str]]:
    """(line, module) for every import in the file under `root`, at any depth, relative ones
    resolved; `from owt_tf import train` yields owt_tf.train."""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[:len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


def entry_point_imports(path: Path):
    """One line per offending import statement."""
    hits = {}
    for line, module in imported_modules(path):
        if _forbidden(module):
            hits.setdefault(line, f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    return list(hits.values())


@pytest.mark.parametrize("folder", LIBRARY)
def test_the_library_imports_no_entry_point(folder):
    files = sorted((PACKAGE / folder).rglob("*.py"))
    assert files
    found = [hit for path in files for hit in entry_point_imports(path)]
    assert not found, "\n".join(found)


def test_the_check_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "owt_tf" / "training"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    source = pkg / "bad.py"
    cases = {
        "import owt_tf.train": "owt_tf.train",
        "from owt_tf.export import export_saved_model": "owt_tf.export",
        "def f():\n    from owt_tf import plan": "owt_tf.plan",
        "from .. import study": "owt_tf.study",
        "from ..bench import main": "owt_tf.bench",
        "importlib.import_module('owt_tf.launch')": "owt_tf.launch",
        "from owt_tf.experiments.study import run_study": "owt_tf.experiments.study",
        "from owt_tf.cli import OneLineParser": "owt_tf.cli",
    }
    for code, module in cases.items():
        source.write_text(code + "\n")
        modules = {m for _, m in imported_modules(source, tmp_path)}
        assert module in modules and _forbidden(module), code
    source.write_text("from owt_tf.training.files.serving import export_saved_model\n"
                      "from owt_tf.parallel import plan\n")
    assert not any(_forbidden(m) for _, m in imported_modules(source, tmp_path))



def test_the_config_imports_nothing_from_training():
    found = [m for path in (PACKAGE / "config").rglob("*.py") for _, m in imported_modules(path)
             if m.startswith(("owt_tf.training", "owt_tf.parallel", "owt_tf.fit"))]
    assert not found, found


def _module_graph(root: Path = PACKAGE) -> dict:
    """owt_tf module -> the owt_tf modules it imports (at any depth, inside functions too)."""
    names = {_module_name(p, root.parent): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        deps = set()
        for _, module in imported_modules(path, root.parent):
            while module and module not in names:  # `from pkg import name` -> pkg
                module = module.rpartition(".")[0]
            if module and module not in (name, "owt_tf"):
                deps.add(module)
        graph[name] = deps
    return graph


def import_circle(graph: dict):
    """One import circle of `graph` as a list of modules (first repeated last), or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep, path + [dep])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_no_import_circle():
    """No module reaches itself through imports, function-level imports included (the
    package's __init__, which re-exports the public API, is not a dependency of anyone)."""
    circle = import_circle(_module_graph())
    assert circle is None, " -> ".join(circle)


def test_the_circle_check_finds_a_circle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "owt_tf"
    (pkg / "models").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "models" / "__init__.py"):
        init.write_text("")
    (pkg / "config.py").write_text("def f():\n    from owt_tf.models.registry import X\n")
    (pkg / "models" / "registry.py").write_text("from owt_tf.devices import Y\nX = 1\n")
    (pkg / "devices.py").write_text("from owt_tf.config import Z\nY = 2\n")
    assert import_circle(_module_graph(pkg)) == [
        "owt_tf.config", "owt_tf.models.registry", "owt_tf.devices", "owt_tf.config"]
    (pkg / "devices.py").write_text("Y = 2\n")
    assert import_circle(_module_graph(pkg)) is None


def test_the_planner_imports_no_tensorflow():
    """The planner is pure Python: `python -m owt_tf.plan` and the CLI's checks price and
    check a plan on a machine where TensorFlow has not loaded (or is not installed)."""
    import subprocess
    import sys

    code = ("import sys, owt_tf.planner.plan, owt_tf.planner.ledger, owt_tf.planner.traffic, "
            "owt_tf.planner.cost_model, owt_tf.planner.hardware, owt_tf.planner.auto, "
            "owt_tf.config\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras'))\n"
            "print(','.join(loaded))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", out.stdout


def test_modules_and_folders_stay_small():
    """No module over 450 lines, no folder of owt_tf/ (the package itself included) with more
    than 12 modules besides its __init__: a reader finds each job in one short file."""
    long = [f"{p.relative_to(PACKAGE.parent)}: {n} lines" for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450]
    folders = [PACKAGE] + [d for d in PACKAGE.rglob("*") if d.is_dir() and d.name != "__pycache__"]
    crowded = [f"{d.relative_to(PACKAGE.parent)}: {n} modules" for d in folders
               if (n := len([m for m in d.glob("*.py") if m.name != "__init__.py"])) > 12]
    assert not long and not crowded, long + crowded


def test_hybrid_strategy_stays_a_thin_front():
    """HybridStrategy: at most 12 public methods and properties, and no CLI step driver."""
    source = (PACKAGE / "parallel" / "strategy.py").read_text()
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "HybridStrategy")
    public = [f.name for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    assert len(public) <= 12, public
    assert not any(m.startswith("owt_tf.training") for _, m in imported_modules(PACKAGE / "parallel" / "strategy.py"))


def test_each_test_leaves_its_heap_out_of_later_collections(request):
    """conftest.py's autouse fixture (gc.freeze after each test) is active: without it a
    worker's late tests run slower (full collections walk every earlier test's leftovers).
    Nothing else notices it missing (a merge once lost it): every test still passes."""
    assert "_heap_of_earlier_tests_left_out_of_collections" in request.fixturenames
