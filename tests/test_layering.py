"""The one-way data flow (docs/design.md, Architecture): no package imports a layer it may not, at
module level or inside a function; and a training job that reads a plan loads none of the planner."""
from __future__ import annotations

import ast
import json
import subprocess
import sys

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


def imported_layers(source: str, module: str) -> set[str]:
    """mist_ds packages `source` imports anywhere (function bodies too; relative imports resolved
    against `module`, the dotted name of the file)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[:-node.level]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" if base == "mist_ds" else base for a in node.names]
        else:
            continue
        found |= {name.split(".")[1] for name in names if name.startswith("mist_ds.")}
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
    assert imported_layers("import mist_ds.symbolic.cache\nfrom mist_ds import files", "mist_ds.x") == {"symbolic", "files"}


def test_reading_a_plan_loads_none_of_the_planner():
    present = [m for m in READERS if (PACKAGE / m.split(".")[1]).exists() or (PACKAGE / f"{m.split('.')[1]}.py").exists()]
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
    assert not loaded & {"torch", "deepspeed", "sympy", "hydra"}, sorted(loaded & {"torch", "deepspeed", "sympy", "hydra"})


COST_MODULE_MAX_LINES = 400
"""A cost module past this mixes concerns (issue 27: a runtime's data moves and end of iteration live in a module of
their own under cost/executors, memory in cost/stage_memory.py)."""


def test_no_cost_module_exceeds_the_line_limit():
    long = {str(path.relative_to(REPO)): n for path in sorted((PACKAGE / "cost").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > COST_MODULE_MAX_LINES}
    assert not long, f"over {COST_MODULE_MAX_LINES} lines: " + ", ".join(f"{p} ({n} lines)" for p, n in long.items())
