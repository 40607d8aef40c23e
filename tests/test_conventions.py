"""Conventions enforced by code (docs/design.md, Architecture and Symbols and units): frozen specs, units in numeric
field names, typed configs, the test lanes, line length."""
from __future__ import annotations

import dataclasses
import inspect
import re
import typing

import mist_ds.config.schema as schema
import mist_ds.specs as specs_pkg
from mist_ds.config.versions import SUPPORTED_HYDRA
from mist_ds.runtime.versions import SUPPORTED_DEEPSPEED
from mist_ds.specs import cluster, model, strategy, train, tuner
from mist_ds.specs.versions import requirement
from tests.conftest import REPO

UNIT_SUFFIXES = ("_bytes", "_s", "_flops", "_flops_per_s", "_bytes_per_s", "_params_per_s",
                 "_gib", "_gbps", "_tflops", "_gparams_per_s", "_per_gpu_hour", "_efficiency", "_us", "_gflop")
# Dimensionless numbers: counts of things, degrees, ratios, probabilities, factors.
COUNTS = {
    "hidden_size", "ffn_hidden_size", "vocab_size", "seq_len", "tp", "pp", "dp", "sp", "micro_batch_size", "grad_accum",
    "global_batch_size", "nodes", "gpus_per_node", "layers", "ckpt_layers", "zero_stage", "workers", "max_tp",
    "layer_slack", "weights_offload_ratios", "grads_offload_ratios", "optimizer_offload_ratios",
    "activations_offload_ratios", "cores", "other_runnable_threads", "measured_other_runnable_threads",
    "dropout", "fallback", "grad_clip", "gemm_curve_exponent", "virtual_stages", "weights_offload", "grads_offload",
    "optimizer_offload",
    "activations_offload", "weights", "grads", "optimizer", "activations", "offload", "layers_per_stage",
    "micro_batch_sizes",
    "top_n",  # runner-up plans kept (the issue names the field tuner.top_n)
    "rerank_top_n",  # points re-ranked by the event simulation (like top_n, a count of plans)
    "verify_top_n",  # plans run briefly before the plan is chosen (the issue names the field tuner.verify_top_n)
    "verify_num_steps", "verify_num_warmup_steps",  # counts of the tuner.verify_* group (its prefix comes first)
}
POLYMORPHIC_ANY = {("StrategyConfig", "ckpt_layers"), ("StrategyConfig", "zero_stage"),
                   ("OffloadConfig", "weights"), ("OffloadConfig", "grads"), ("OffloadConfig", "optimizer"),
                   ("OffloadConfig", "activations"), ("ClusterConfig", "other_runnable_threads")}


def _dataclasses(module) -> list[type]:
    return [c for _, c in inspect.getmembers(module, inspect.isclass)
            if dataclasses.is_dataclass(c) and c.__module__ == module.__name__]


SPEC_CLASSES = [c for m in (cluster, model, strategy, train, tuner) for c in _dataclasses(m)] + [specs_pkg.Specs]
SCHEMA_CLASSES = _dataclasses(schema)


def _is_numeric(annotation) -> bool:
    text = str(annotation)
    return any(word in text for word in ("int", "float")) and "dict" not in text.lower() and "tuple" not in text


def test_spec_classes_are_frozen():
    assert SPEC_CLASSES
    for cls in SPEC_CLASSES:
        assert cls.__dataclass_params__.frozen, cls


def test_numeric_fields_carry_a_unit_or_are_counts():
    for cls in SPEC_CLASSES + SCHEMA_CLASSES:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not _is_numeric(hints[field.name]):
                continue
            name = field.name
            assert name.startswith("num_") or name in COUNTS or name.endswith(UNIT_SUFFIXES), \
                f"{cls.__name__}.{name}: numeric field without a unit suffix"


def test_only_polymorphic_strategy_fields_are_any():
    for cls in SCHEMA_CLASSES:
        for name, hint in typing.get_type_hints(cls).items():
            if hint is typing.Any:
                assert (cls.__name__, name) in POLYMORPHIC_ANY, f"{cls.__name__}.{name} is Any"


def test_no_required_field_defaults_to_none():
    for cls in SPEC_CLASSES + SCHEMA_CLASSES:
        for field in dataclasses.fields(cls):
            required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            assert not (required and field.default is None), f"{cls.__name__}.{field.name}"
            if field.default is None:
                assert "None" in str(typing.get_type_hints(cls)[field.name]) or "Optional" in str(
                    typing.get_type_hints(cls)[field.name]), f"{cls.__name__}.{field.name}: None default, not Optional"


def test_config_doc_field_table_is_the_schema_docs():
    """docs/config.md's table is `python -m mist_ds.config.fields`, word for word (regenerate it on change)."""
    from mist_ds.config.fields import markdown_table
    from tests.conftest import REPO

    assert markdown_table() in (REPO / "docs" / "config.md").read_text()


def test_every_module_that_starts_ranks_is_in_the_engine_lane():
    """A test module that starts DeepSpeed ranks (mist_ds.observe.ranks, a port from free_port, a `mist-ds profile`
    or `measure` run) is in conftest's LAUNCHING_MODULES: the engine lane, one process, never two launches at once,
    and never in the planner lane."""
    from pathlib import Path

    from tests.conftest import LAUNCHING_MODULES

    starts_ranks = ("mist_ds.observe.ranks import", "free_port()", 'mist_ds("profile", "cluster=cpu"',
                    '"mist_ds.cli.main", "measure"')
    here = Path(__file__)
    launching = {path.stem for path in here.parent.glob("test_*.py")
                 if path != here and any(s in path.read_text() for s in starts_ranks)}
    assert launching <= LAUNCHING_MODULES, sorted(launching - LAUNCHING_MODULES)


def test_pyproject_pins_the_ranges_checked_at_start_up():
    """One range per package, written once in code and pinned the same in pyproject.toml (mist_ds/specs/versions.py)."""
    # read as text: tomllib is Python 3.11+, and mist_ds supports 3.10
    block = (REPO / "pyproject.toml").read_text().split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    pinned = {line.split(">")[0].split("<")[0].split("=")[0]: line for line in re.findall(r'"([^"]+)"', block)}
    for package, supported in (("deepspeed", SUPPORTED_DEEPSPEED), ("hydra-core", SUPPORTED_HYDRA)):
        assert pinned[package] == requirement(package, supported), (package, pinned[package])


MAX_LINE_CHARACTERS = 120
PYTHON_FOLDERS = ("mist_ds", "tests", "benchmarks", "launch", "hydra_plugins", "examples")


def _tracked_python_files() -> list[str]:
    """The repository's tracked .py files (git ls-files); without git, every .py file under PYTHON_FOLDERS."""
    import subprocess

    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--", "*.py"], cwd=REPO, capture_output=True, check=True)
        return sorted(name for name in listed.stdout.decode().split("\0") if name)
    except (OSError, subprocess.CalledProcessError):
        return sorted(str(path.relative_to(REPO)) for folder in PYTHON_FOLDERS
                      for path in (REPO / folder).rglob("*.py") if "__pycache__" not in path.parts)


def test_lines_are_at_most_120_characters():
    """Every line of every tracked .py file is at most MAX_LINE_CHARACTERS characters long."""
    files = _tracked_python_files()
    assert files
    long_lines = [f"{name}:{number} ({len(line)})"
                  for name in files if (REPO / name).is_file()
                  for number, line in enumerate((REPO / name).read_text(encoding="utf-8").splitlines(), start=1)
                  if len(line) > MAX_LINE_CHARACTERS]
    assert not long_lines, f"{len(long_lines)} lines over {MAX_LINE_CHARACTERS} characters:\n" + "\n".join(long_lines)
