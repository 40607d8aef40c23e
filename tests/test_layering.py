"""The one-way data flow (docs/design.md, Architecture): no package imports a layer it may not, at
module level or inside a function; and a training job that reads a plan loads none of the planner."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "mist_ds"
EVERYTHING = {"specs", "files", "config", "models", "symbolic", "hardware", "cost", "tuner", "plan", "emit",
              "runtime", "report", "cli", "conf", "testing", "profiling"}
ALLOWED: dict[str, set[str]] = {
    "specs": set(),
    "files": set(),
    "conf": set(),
    "config": {"specs"},
    "models": {"specs"},
    "symbolic": {"specs", "models", "files"},
    "hardware": {"specs"},
    "cost": {"specs", "symbolic", "hardware"},
    "tuner": {"specs", "symbolic", "hardware", "cost"},
    "plan": {"specs", "files"},
    "emit": {"specs", "plan"},
    "runtime": {"specs", "plan", "emit", "models", "files"},
    "report": EVERYTHING - {"cli", "testing"},
    "testing": EVERYTHING - {"cli", "report"},  # verification tools: run engines, count what they hold
    "profiling": EVERYTHING - {"cli", "report"},  # mist-ds profile: measures this machine at the tuner's shapes
    "cli": EVERYTHING,
    "__init__": EVERYTHING,  # the lazy facade (mist_ds.compose, predict, tune)
}
"""Package -> the mist_ds packages it may import (itself always)."""
PLANNER = ("sympy", "numba", "mip", "mist_ds.cost", "mist_ds.tuner", "mist_ds.symbolic")
"""What a reader of plans must not load."""
READERS = ("mist_ds.plan", "mist_ds.emit", "mist_ds.runtime")


def _imports(source: str, file_module: str) -> Iterator[tuple[str, list[str]]]:
    """(the module an import statement of `source` names, the names it takes from it: [] for `import M`), function
    bodies too; relative imports resolved against `file_module`, the file's dotted path (mist_ds.x.__init__ for a
    package)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(file_module.split(".")[:-node.level] + ([base] if base else []))
            yield base, [alias.name for alias in node.names]


def imported_layers(source: str, module: str) -> set[str]:
    """mist_ds packages `source` imports anywhere (function bodies too; relative imports resolved
    against `module`, the dotted name of the file)."""
    found = set()
    for base, names in _imports(source, module):
        modules = [f"{base}.{name}" for name in names] if base == "mist_ds" else [base]
        found |= {name.split(".")[1] for name in modules if name.startswith("mist_ds.")}
    return found


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        yield path, ".".join(parts), parts[1]  # mist_ds/<layer>/... or mist_ds/<layer>.py


def test_every_package_has_a_rule():
    layers = {layer for _, _, layer in _modules()}
    assert layers <= set(ALLOWED), f"packages without a layering rule: {sorted(layers - set(ALLOWED))}"


@pytest.mark.parametrize("path, module, layer", list(_modules()), ids=[m for _, m, _ in _modules()])
def test_no_module_imports_a_layer_it_may_not(path, module, layer):
    wrong = imported_layers(path.read_text(), module) - ALLOWED[layer] - {layer}
    assert not wrong, f"{module} ({layer}) imports {sorted(wrong)}; allowed: {sorted(ALLOWED[layer])}"


def test_the_import_scanner_sees_function_level_and_relative_imports():
    source = "def f():\n    from mist_ds.cost import predict\n    from ..tuner import search\n"
    assert imported_layers(source, "mist_ds.plan.reader") == {"cost", "tuner"}
    assert imported_layers("import mist_ds.symbolic.cache\nfrom mist_ds import files", "mist_ds.x") == {"symbolic",
                                                                                                        "files"}


def test_reading_a_plan_loads_none_of_the_planner():
    present = [m for m in READERS
               if (PACKAGE / m.split(".")[1]).exists() or (PACKAGE / f"{m.split('.')[1]}.py").exists()]
    code = ("import importlib, json, sys\n"
            f"for name in {present!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(sys.modules)))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    loaded = json.loads(run.stdout)
    assert set(present) <= set(loaded)
    leaked = sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in PLANNER))
    assert not leaked, f"importing {present} loads {leaked}"


def test_the_training_script_loads_no_planner_and_no_test_tools():
    """launch/train.py plans, when it must, in a subprocess: it imports none of the planner's layers."""
    script = REPO / "launch" / "train.py"
    wrong = imported_layers(script.read_text(), "launch.train") & {"cost", "tuner", "symbolic", "testing", "report"}
    assert not wrong, f"launch/train.py imports {sorted(wrong)}"


def test_importing_the_package_loads_neither_torch_nor_deepspeed():
    run = subprocess.run([sys.executable, "-c", "import json, sys, mist_ds; print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    loaded = set(json.loads(run.stdout))
    heavy = loaded & {"torch", "deepspeed", "sympy", "hydra"}
    assert not heavy, sorted(heavy)


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file of every module under `package` (a package by its __init__.py)."""
    files = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_modules(source: str, module: str, is_package: bool, known: Collection[str]) -> set[str]:
    """The modules of `known` that `source` (the file of `module`) imports anywhere, function bodies too, relative
    imports resolved: `from P import x` imports the file P.x where that is a module, else P (a package: its
    __init__). Only the named file counts, not the packages Python runs on the way to it."""
    found = set()
    for base, names in _imports(source, f"{module}.__init__" if is_package else module):
        found |= {f"{base}.{name}" if f"{base}.{name}" in known else base for name in names} if names else {base}
    return found & set(known) - {module}


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the same package tree it imports (imported_modules)."""
    files = module_files(package)
    return {name: imported_modules(path.read_text(), name, path.name == "__init__.py", files)
            for name, path in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (first module repeated at the end) per strongly connected group of modules that import each
    other, directly or through others; [] when the graph has none."""
    cycles, settled = [], set()
    for start in sorted(graph):
        if start in settled:
            continue
        reach = _reachable(graph, start)
        group = {m for m in reach if start in _reachable(graph, m)}
        settled |= group | {start}
        if group:
            cycles.append(_path_back(graph, start))
    return cycles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Modules reached from `start` by one import or more (start itself only through a cycle)."""
    seen, todo = set(), list(graph.get(start, ()))
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph.get(module, ()))
    return seen


def _path_back(graph: dict[str, set[str]], start: str) -> list[str]:
    """The shortest import path from `start` back to itself (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for module in frontier:
            for target in sorted(graph.get(module, ())):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if module != start else [start, start]
                if target not in came_from:
                    came_from[target] = module
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def test_the_import_graph_has_no_cycle():
    """No two files of mist_ds import each other, directly or through others, at module level or inside a function
    (a lazy import only hides a circle: the first caller finds a half-initialized module)."""
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_cycle_finder_finds_a_circle_through_a_function_level_and_a_relative_import(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .a import f\n")
    (package / "sub" / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (package / "b.py").write_text("from .sub import f\n")
    (package / "c.py").write_text("import pkg.b\n")
    assert import_cycles(import_graph(package)) == [["pkg.b", "pkg.sub", "pkg.sub.a", "pkg.b"]]
