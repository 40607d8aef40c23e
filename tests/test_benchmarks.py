"""The benchmarks say whether they are current: every results file starts with results_header's fields and is in
benchmarks/results/index.md, the scripts run as `python -m benchmarks.<name>` without editing sys.path, and
(slow) the deterministic benchmarks rerun to the tables their committed files hold."""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks.common import DATA_KINDS, HEADER_FIELDS, RunStart, results_header
from benchmarks.index import (HEADLINES, README, header_fields, headline, read_entry, results_files,
                              with_readme_table)
from tests.conftest import REPO

BENCHMARKS = REPO / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py")
DETERMINISTIC = {"vtrain": ((), "vtrain.md"), "megatron_sc21": ((), "megatron_sc21.md"), "mist_l4": ((), "mist_l4.md"),
                 "nccl_rails": ((), "nccl_rails.md"), "model_states": ((), "model_states.md"),
                 "calibrate": (("--sc21-weight", "1"), "calibration_a100.md")}
"""Benchmarks whose tables hold no timing: their arguments and results files (model_states starts 2-4 DeepSpeed
ranks; its per-launch seconds sit in headings, outside the tables). On this 2-core shared machine a run takes 3 s
(nccl_rails), 17 s (vtrain), about 2 minutes (model_states; megatron_sc21 and mist_l4, the symbolic analysis of
their shapes) and 5 minutes (calibrate's least squares)."""


def table_rows(text: str) -> list[str]:
    """The Markdown table rows of a results file: its numbers, without the header's commit, machine and load."""
    return [line for line in text.splitlines() if line.startswith("|")]


@pytest.mark.parametrize("path", results_files(), ids=lambda p: p.name)
def test_every_results_file_starts_with_the_header(path):
    entry = read_entry(path)
    assert set(entry.fields) == set(HEADER_FIELDS)
    assert all(kind in DATA_KINDS for kind in entry.data_kind.split(" and ")), entry.data_kind
    assert re.search(r"-m benchmarks\.\w+", entry.fields["Command"]), entry.fields["Command"]
    assert re.search(r"\b[0-9a-f]{7,40}\b", entry.fields["Commit"]), entry.fields["Commit"]
    assert headline(path)  # raises where a quoted number is no longer in the file


def test_every_results_file_is_in_the_index():
    index = (BENCHMARKS / "results" / "index.md").read_text()
    listed = set(re.findall(r"^\| \[([\w.]+\.md)\]", index, re.MULTILINE))
    assert listed == {p.name for p in results_files()}
    assert set(HEADLINES) == listed


def test_the_readme_quotes_the_results_files_as_the_index_does():
    readme = README.read_text()
    assert readme == with_readme_table(readme), "rerun `python -m benchmarks.index --readme`"


def test_the_header_reads_back_and_refuses_an_unknown_data_kind():
    header = results_header("T", "python -m benchmarks.x", "fitted and held out: why", machine="m", load="l",
                            commit="abc1234 (clean)")
    assert header_fields(header + "\n| a |") == {"Command": "`python -m benchmarks.x`", "Commit": "abc1234 (clean)",
                                                 "Machine": "m", "Load": "l", "Data": "fitted and held out: why"}
    started = RunStart("abc1234 (clean)", "1.0")
    begun = header_fields(results_header("T", "c", "none: why", machine="m", started=started))
    assert begun["Commit"] == "abc1234 (clean)" and begun["Load"].startswith("load average at start 1.0, at the end")
    with pytest.raises(ValueError):
        results_header("T", "c", "measured: a kind that is none of DATA_KINDS")


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_no_benchmark_edits_sys_path_or_imports_a_sibling_bare(path):
    source = path.read_text()
    assert "sys.path" not in source
    siblings = {p.stem for p in SCRIPTS}
    bare = [node.module for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in siblings]
    assert not bare, f"import these as benchmarks.<name>: {bare}"


@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.stem != "common"], ids=lambda p: p.name)
def test_every_script_documents_its_launch_as_a_module(path):
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert f"python -m benchmarks.{path.stem}" in docstring


def test_the_benchmarks_package_is_not_shipped():
    # read as text: tomllib is Python 3.11+, and the project supports 3.10
    find = (REPO / "pyproject.toml").read_text().split("[tool.setuptools.packages.find]", 1)[1].split("\n[", 1)[0]
    include = re.findall(r'"([^"]+)"', re.search(r"^include = \[(.*)\]$", find, re.MULTILINE).group(1))
    assert include, "pyproject names the packages it ships"
    assert (BENCHMARKS / "__init__.py").is_file()
    assert not any(re.fullmatch(pattern.replace("*", ".*"), "benchmarks") for pattern in include), include


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(DETERMINISTIC))
def test_a_deterministic_benchmark_reruns_to_its_committed_tables(script):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    arguments, results_file = DETERMINISTIC[script]
    run = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", *arguments], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    committed = (BENCHMARKS / "results" / results_file).read_text()
    assert table_rows(run.stdout) == table_rows(committed), (
        f"benchmarks/results/{results_file} is stale: rerun `python -m benchmarks.{script}` and commit it")


@pytest.mark.parametrize("name, memory_mib, cluster", [
    ("NVIDIA H100 80GB HBM3", 81559, "h100-80g"), ("NVIDIA H200", 143771, "h200-141g"),
    ("NVIDIA A100-SXM4-80GB", 81920, "a100-80g"), ("NVIDIA A100-SXM4-40GB", 40960, "a100-40g"),
    ("NVIDIA L4", 23034, "l4-24g")])
def test_the_gpu_check_starts_from_the_zoo_cluster_of_the_gpu(name, memory_mib, cluster):
    from benchmarks.gpu_check import cluster_for_gpu

    assert cluster_for_gpu(name, memory_mib) == cluster


def test_the_gpu_check_names_an_unknown_gpu_and_the_fix():
    from benchmarks.gpu_check import cluster_for_gpu

    with pytest.raises(SystemExit, match="Tesla V100.*--cluster"):
        cluster_for_gpu("Tesla V100-SXM2-32GB", 32768)


def test_the_gpu_check_steps_are_commands_mist_ds_accepts(tmp_path):
    """Each step's arguments compose as mist-ds composes them (the profiled cluster's -cd aside): a typo in a key
    would otherwise surface only on a lent GPU machine."""
    from benchmarks.gpu_check import Settings, analyze_step, executor_steps, profile_step
    from mist_ds.config import compose_config

    s = Settings("h100-80g", "gpt3-1.3b", 8, 3, 20, True, tmp_path)
    tune, measure = executor_steps(s, (), "h100-80g", "mist")
    for step in (analyze_step(s), profile_step(s), tune):
        compose_config([a for a in step.argv[1:] if not a.startswith("hydra.")])
    assert measure.argv[:2] == ("measure", f"plan={tmp_path / 'tune-mist' / 'plan.json'}")


def test_the_gpu_check_stops_when_the_layers_cannot_be_traced(tmp_path, monkeypatch):
    """A failed analyze (a torch that fixes the traced sizes) prices nothing right: no profile, tune or measure spends
    the lent machine's time after it."""
    import benchmarks.gpu_check as check

    ran = []

    def failing(step, logs, deadline=None):
        ran.append(step.name)
        return check.Outcome(step, 1, 1.0, "FixedSizeError")

    monkeypatch.setattr(check, "run_step", failing)
    outcomes = check.run_flow(check.Settings("h100-80g", "gpt3-1.3b", 8, 3, 20, True, tmp_path))
    assert ran == ["analyze"] and [o.ok for o in outcomes] == [False]


def test_the_gpu_check_skips_a_step_the_deadline_leaves_no_time_for(tmp_path):
    import time

    from benchmarks.gpu_check import LEAST_STEP_S, Step, run_step

    outcome = run_step(Step("tune-mist", ("tune", "model=tiny"), 120.0), tmp_path,
                       deadline=time.monotonic() + LEAST_STEP_S / 2)
    assert outcome.skipped and not outcome.ok and outcome.status == "skipped: no time left"
    assert not (tmp_path / "tune-mist.log").exists()


def test_the_gpu_check_interrupts_a_step_at_its_limit_so_it_can_stop_its_ranks(tmp_path):
    """A step past its limit gets SIGINT first (mist-ds then kills its ranks' session), even where the check itself
    was started with SIGINT ignored (a background job's)."""
    import signal
    import time

    from benchmarks.gpu_check import run_command

    marker = tmp_path / "interrupted"
    step = ("import pathlib, time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n"
            f"    pathlib.Path({str(marker)!r}).write_text('yes')\n")
    start = time.monotonic()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        code = run_command([sys.executable, "-c", step], tmp_path / "step.log", timeout_s=2.0)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code is None and marker.read_text() == "yes" and time.monotonic() - start < 30
    assert run_command([sys.executable, "-c", "print('done')"], tmp_path / "ok.log", 30.0) == 0
    assert (tmp_path / "ok.log").read_text() == "done\n"
    assert subprocess.run(["pgrep", "-f", str(marker)], capture_output=True).returncode == 1  # nothing left


def test_the_gpu_check_packs_the_steps_folder_into_one_archive(tmp_path, monkeypatch):
    import tarfile

    import benchmarks.gpu_check
    from benchmarks.gpu_check import PACKED_FILE_MAX_BYTES, pack

    steps = tmp_path / "steps"
    (steps / "logs").mkdir(parents=True)
    (steps / "logs" / "profile.log").write_text("profiled")
    (steps / "huge.db").write_bytes(b"0" * (PACKED_FILE_MAX_BYTES + 1))
    pack(steps, tmp_path / "gpu_check.tgz")
    with tarfile.open(tmp_path / "gpu_check.tgz") as tar:
        assert tar.getnames() == ["steps/logs/profile.log"]
        assert tar.extractfile("steps/logs/profile.log").read() == b"profiled"
    (steps / "logs" / "tune.log").write_text("tuned")
    monkeypatch.setattr(benchmarks.gpu_check, "PACKED_MAX_BYTES", len("profiled") + 1)  # one small file's room
    pack(steps, tmp_path / "gpu_check.tgz")
    with tarfile.open(tmp_path / "gpu_check.tgz") as tar:
        assert tar.getnames() == ["steps/logs/profile.log"]


def test_the_gpu_check_reports_a_measure_file_it_cannot_read_and_goes_on(tmp_path):
    from benchmarks.gpu_check import measured_rows

    (tmp_path / "measure-deepspeed").mkdir()
    (tmp_path / "measure-deepspeed" / "measure.json").write_text(json.dumps({"measured_iteration_time_s": None}))
    [row] = measured_rows(tmp_path)
    assert row[0] == "deepspeed" and "measure.json unreadable here (TypeError" in row[1] and len(row) == 9


def test_the_gpu_check_names_its_commit_without_git(tmp_path, monkeypatch):
    from benchmarks.gpu_check import commit_here

    monkeypatch.delenv("MIST_DS_COMMIT", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on this PATH
    assert commit_here().startswith("unknown (no git history here")
    monkeypatch.setenv("MIST_DS_COMMIT", "abc1234 (clean)")
    assert commit_here() == "abc1234 (clean)"


def test_the_runs_spread_floor_is_the_least_mean_error_of_one_prediction_per_pair():
    """Two runs of 1 and 2 s: a prediction of 1 s errs 0% and 50% (mean 25%); any other errs more on average."""
    import numpy as np

    from benchmarks.nccl_rails import spread_floor

    table = {"nodes": np.array([2.0, 2.0, 4.0, 4.0]), "size_bytes": np.array([8.0, 8.0, 8.0, 8.0]),
             "time_s": np.array([1.0, 2.0, 3.0, 3.0])}
    assert list(spread_floor(table)) == [0.25, 0.25, 0.0, 0.0]
    for p in (0.8, 1.0, 1.5, 2.0):
        assert (abs(p / 1.0 - 1) + abs(p / 2.0 - 1)) / 2 >= 0.25
