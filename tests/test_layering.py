"""The one-way data flow (docs/design.md, Architecture): no package imports a layer it may not, at
module level or inside a function; a training job that reads a plan loads none of the planner; the runtime
runs engines and never imports what observes them; each of its overlap features is installed in one place."""
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
              "runtime", "observe", "report", "cli", "conf", "testing", "profiling", "script"}
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
    "runtime": {"specs", "plan", "emit", "models", "files"},  # builds and runs engines: never `observe`
    "observe": {"specs", "emit", "runtime", "models"},  # census, step census, what ran, measure, CPU ranks
    "report": EVERYTHING - {"cli", "testing", "script"},
    "testing": EVERYTHING - {"cli", "report", "script"},  # compares observed engines with the cost model
    "profiling": EVERYTHING - {"cli", "report", "testing", "script"},  # mist-ds profile: this machine, tuner shapes
    "script": EVERYTHING - {"cli", "testing", "observe"},  # mist_ds.initialize in a user's script: plans, runs
    "cli": EVERYTHING - {"testing"},
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


def test_the_runtime_never_imports_what_observes_it():
    """mist_ds/runtime builds and runs engines; mist_ds/observe watches them from outside (the runtime's
    users import it). The ALLOWED row enforces it module by module; this says why, and that the row does."""
    assert "observe" not in ALLOWED["runtime"], "mist_ds.runtime may not import mist_ds.observe"
    assert "runtime" in ALLOWED["observe"]
    leaked = {module: sorted(wrong) for path, module, layer in _modules() if layer == "runtime"
              if (wrong := imported_layers(path.read_text(), module) & {"observe", "testing"})}
    assert not leaked, f"the runtime imports its observers: {leaked}"


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



RUNTIME_ENGINE = PACKAGE / "runtime" / "engine.py"
INSTALL_MECHANISMS = {
    "hook": "a call of register_*hook* (a forward pre-hook, a parameter's post-accumulate-grad hook, ...)",
    "__class__": "re-classing an object (the engine as MistPipelineEngine)",
    "update_lp_params": "replacing the optimizer's update_lp_params",
    "enable_backward_allreduce": "turning DeepSpeed's own boundary all-reduce off",
    "activation_offload": "handing a block its activation offload",
    "split_backward": "handing a layer the store that splits its backward into B and W",
}
"""How the runtime installs an overlap feature on a built engine: each may occur only inside an apply_* function."""
OVERLAP_FEATURES = {
    "apply_grad_reduce_in_last_backward": {"hook", "__class__", "enable_backward_allreduce"},
    "apply_weight_gather_in_first_forward": {"hook", "update_lp_params"},
    "apply_activation_offload": {"activation_offload"},
    "apply_split_backward": {"__class__", "split_backward"},
}
"""Each overlap feature of executor `mist` (docs/design.md, The `mist` schedule) -> its apply_* function in
runtime/engine.py and the install mechanisms it uses."""
PLAN_FEATURES = {"apply_sequence_parallel"}
"""Features the runtime applies before DeepSpeed builds the engine (groups, the layers they are built with), each by
its apply_* function in `initialize`, installing nothing on a built engine."""


def install_sites(source: str) -> list[tuple[str, str]]:
    """(mechanism, the innermost enclosing function's name, or "<module>") for each install mechanism in
    `source`: register_*hook* calls, and assignments to `__class__`, `update_lp_params`,
    `enable_backward_allreduce` or another object's `activation_offload` or `split_backward` (a layer setting its
    own to None in __init__ installs nothing)."""
    found = []

    def visit(node, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr.startswith("register_") and "hook" in node.func.attr:
            found.append(("hook", function))
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(element, ast.Attribute) and element.attr in INSTALL_MECHANISMS and not (
                        element.attr in ("activation_offload", "split_backward") and isinstance(element.value, ast.Name)
                        and element.value.id == "self"):
                    found.append((element.attr, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def apply_calls(source: str, caller: str = "initialize") -> list[str]:
    """Names of the apply_* functions `caller` calls, in order."""
    function = next(node for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.FunctionDef) and node.name == caller)
    return [node.func.id for node in ast.walk(function) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id.startswith("apply_")]


def test_the_install_scanner_finds_each_mechanism_and_where_it_is():
    source = ("def build(layer, engine, optimizer, gather):\n"
              "    layer.register_forward_pre_hook(gather.before)\n"
              "    engine.__class__ = object\n"
              "class Gather:\n"
              "    def install(self):\n"
              "        self.optimizer.update_lp_params = self.update\n"
              "        self.activation_offload = None\n"
              "def apply_offload(block, offload):\n"
              "    block.activation_offload, block.first = offload, True\n"
              "    block.grad.register_post_accumulate_grad_hook(print)\n")
    assert install_sites(source) == [("hook", "build"), ("__class__", "build"), ("update_lp_params", "install"),
                                     ("activation_offload", "apply_offload"), ("hook", "apply_offload")]
    assert apply_calls("def initialize():\n    e = apply_a(1)\n    return apply_b(e)\n") == ["apply_a", "apply_b"]


@pytest.mark.parametrize("path", sorted((PACKAGE / "runtime").glob("*.py")), ids=lambda p: p.name)
def test_the_runtime_installs_features_only_inside_apply_functions(path):
    """After `deepspeed.initialize` nothing changes the engine but an apply_* function: a hook, a re-classed
    engine or a replaced optimizer method anywhere else in the runtime would be an install nobody lists."""
    outside = [(mechanism, function) for mechanism, function in install_sites(path.read_text())
               if not function.startswith("apply_")]
    assert not outside, f"{path.name} installs outside apply_* functions: " + "; ".join(
        f"{INSTALL_MECHANISMS[m]} in {f}" for m, f in outside)


def test_initialize_applies_each_overlap_feature_by_exactly_one_apply_function():
    source = RUNTIME_ENGINE.read_text()
    called = apply_calls(source)
    assert sorted(called) == sorted({*OVERLAP_FEATURES, *PLAN_FEATURES}), \
        f"initialize calls {called}; the features' apply functions: {sorted({*OVERLAP_FEATURES, *PLAN_FEATURES})}"
    by_function: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "runtime").glob("*.py")):
        for mechanism, function in install_sites(path.read_text()):
            by_function.setdefault(function, set()).add(mechanism)
    assert set(by_function) <= set(OVERLAP_FEATURES), f"installs in {sorted(set(by_function) - set(OVERLAP_FEATURES))}"
    for function, mechanisms in OVERLAP_FEATURES.items():
        assert by_function.get(function) == mechanisms, f"{function} installs {by_function.get(function)}, " \
                                                        f"expected {sorted(mechanisms)}"


COST_MODULE_MAX_LINES = 400
"""A cost module past this mixes concerns (issue 27: a runtime's data moves and end of iteration live in a module of
their own under cost/executors, memory in cost/stage_memory.py)."""


def test_no_cost_module_exceeds_the_line_limit():
    long = {str(path.relative_to(REPO)): n for path in sorted((PACKAGE / "cost").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > COST_MODULE_MAX_LINES}
    assert not long, f"over {COST_MODULE_MAX_LINES} lines: " + ", ".join(f"{p} ({n} lines)" for p, n in long.items())
