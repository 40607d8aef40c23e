"""`mist-ds tune -m`: one plan, its pictures and cmd.txt per job dir, and the sweep's summary (sweep.csv,
sweep.md, sweep.json) assembled from the jobs' result.json by the end-of-sweep callback, the same under
the basic launcher and hydra-joblib-launcher (jobs in other processes), whose exit code is the largest
job status all the same."""
from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

from mist_ds.report.sweep import CHEAPEST, FASTEST, mark_best, usd_per_million_tokens
from tests.test_cli import PLAN_FILES, mist_ds

PRICE = 2.5
"""USD per GPU-hour set by the test (the zoo leaves prices unset)."""
GRID = ["model=tiny", "cluster=cpu", "cluster.inter_node_gbps=1", f"cluster.price_per_gpu_hour={PRICE}",
        "model.num_layers=2,4", "cluster.nodes=1,2", "tuner.compare_baselines=false", "tuner.quiet=true"]
"""A 2 x 2 sweep of small jobs that all find a plan (inter_node_gbps: the cpu cluster is one node)."""
JOBLIB = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]


def _rows(sweep: Path) -> list[dict[str, str]]:
    with open(sweep / "sweep.csv", newline="") as rows:
        return list(csv.DictReader(rows))


def _plans(sweep: Path) -> dict[str, dict]:
    return {job.name: json.loads((job / "plan.json").read_text()) for job in sweep.iterdir()
            if (job / "plan.json").is_file()}


@pytest.fixture(scope="module")
def basic_sweep(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("basic")
    run = mist_ds("tune", "-m", *GRID, "hydra.sweep.dir=sweep", cwd=cwd)
    assert run.returncode == 0, run.stderr
    return cwd / "sweep"


def test_a_2x2_sweep_gives_a_plan_per_job_and_a_summary_row_each(basic_sweep):
    plans = _plans(basic_sweep)
    assert sorted(plans) == ["0", "1", "2", "3"]
    rows = _rows(basic_sweep)
    assert [row["job"] for row in rows] == ["0", "1", "2", "3"] and {row["status"] for row in rows} == {"0"}
    for row in rows:
        job = basic_sweep / row["job"]
        assert PLAN_FILES <= {p.name for p in job.iterdir()}
        prediction = plans[row["job"]]["prediction"]
        assert float(row["iteration_time_s"]) == prediction["iteration_time_s"]
        assert float(row["tokens_per_s"]) == prediction["tokens_per_s"]
        assert float(row["peak_memory_gib"]) * 2**30 == pytest.approx(max(prediction["peak_memory_bytes"]), rel=1e-15)
        nodes = 2 if "cluster.nodes=2" in row["overrides"] else 1
        assert int(row["gpus"]) == 2 * nodes  # the cpu cluster: 2 ranks per node
        hours_per_million = 1e6 / prediction["tokens_per_s"] / 3600
        assert float(row["usd_per_million_tokens"]) == pytest.approx(PRICE * 2 * nodes * hours_per_million, rel=1e-12)
    assert sum(FASTEST in row["best"] for row in rows) == 1  # one model name (tiny): one fastest row
    assert sum(CHEAPEST in row["best"] for row in rows) == 1
    assert "| job | status | best |" in (basic_sweep / "sweep.md").read_text()


def test_each_plan_dir_has_the_command_that_trains_it(basic_sweep):
    """cmd.txt runs from any directory (issue 25, defect 6): the script by its absolute path, DeepSpeed's CPU
    environment for a plan of CPU ranks, and for 2 nodes a --hostfile placeholder a comment explains."""
    for job in ("0", "3"):
        plan_dir = (basic_sweep / job).resolve()
        overrides = json.loads((plan_dir / "plan.json").read_text())["user_overrides"]
        nodes = 2 if "cluster.nodes=2" in overrides else 1
        text = (plan_dir / "cmd.txt").read_text()
        command = shlex.split(text, comments=True)
        hosts = ["--hostfile", "hostfile"] if nodes == 2 else []
        assert command[:3 + len(hosts)] == ["DS_ACCELERATOR=cpu", "OMP_NUM_THREADS=1", "deepspeed", *hosts]
        script = Path(command[8 + len(hosts)])
        assert script.is_absolute() and script == Path(__file__).resolve().parents[1] / "launch" / "train.py"
        launcher, plan = command[3 + len(hosts):8 + len(hosts)], command[9 + len(hosts):]
        assert launcher == ["--num_nodes", str(nodes), "--num_gpus", "2", "--no_local_rank"]
        assert plan == [f"mist.plan={plan_dir / 'plan.json'}", f"hydra.run.dir={plan_dir / 'train'}"]
        assert ("# 2 nodes: replace `hostfile` by DeepSpeed's hostfile" in text) == (nodes == 2), text


def test_the_same_sweep_under_joblib_gives_the_same_plans(basic_sweep, tmp_path):
    run = mist_ds("tune", "-m", *JOBLIB, *GRID, "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    joblib_plans, basic_plans = _plans(tmp_path / "sweep"), _plans(basic_sweep)
    assert sorted(joblib_plans) == sorted(basic_plans)
    for job, plan in joblib_plans.items():
        assert plan["strategy"] == basic_plans[job]["strategy"]
        assert plan["prediction"] == basic_plans[job]["prediction"]
    assert len(_rows(tmp_path / "sweep")) == 4


@pytest.mark.slow  # the fast lane checks the status file with test_a_job_that_left_no_result_is_a_lost_row
def test_under_joblib_a_job_that_fits_nothing_is_a_row_and_sets_the_exit_code(tmp_path):
    """The jobs run in joblib's workers, which leave no status in the launching process: the exit code
    comes from the jobs' result files, as the summary does."""
    run = mist_ds("tune", "-m", *JOBLIB, "model=gpt3-1.3b,tiny", "cluster=cpu", "tuner.compare_baselines=false",
                  "tuner.quiet=true", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert run.returncode == 3, run.stderr
    rows = _rows(tmp_path / "sweep")
    assert [(row["job"], row["status"]) for row in rows] == [("0", "3"), ("1", "0")]
    assert "no plan fits" in rows[0]["reason"]


def test_a_job_that_left_no_result_is_a_lost_row(tmp_path):
    from omegaconf import OmegaConf

    from mist_ds.cli.sweep import LOST, SweepSummary

    (tmp_path / "sweep" / "0" / ".hydra").mkdir(parents=True)  # Hydra made the job dir; the job never finished
    (tmp_path / "sweep" / "1").mkdir()
    (tmp_path / "sweep" / "1" / "result.json").write_text(json.dumps({"status": 3, "reason": "no plan fits"}))
    status_file = tmp_path / "status"
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}})
    SweepSummary(str(status_file)).on_multirun_end(config)
    rows = _rows(tmp_path / "sweep")
    assert [(row["job"], row["status"]) for row in rows] == [("0", str(LOST)), ("1", "3")]
    assert int(status_file.read_text()) == 3


def test_best_marks_the_fastest_and_the_cheapest_row_per_model():
    rows = [{"model": "a", "status": 0, "tokens_per_s": 100.0, "usd_per_million_tokens": 2.0},
            {"model": "a", "status": 0, "tokens_per_s": 300.0, "usd_per_million_tokens": 3.0},
            {"model": "a", "status": 3, "tokens_per_s": None},
            {"model": "b", "status": 0, "tokens_per_s": 50.0, "usd_per_million_tokens": None}]
    assert [row["best"] for row in mark_best(rows)] == [CHEAPEST, FASTEST, "", FASTEST]
    assert usd_per_million_tokens(None, 8, 1e4) is None
    assert usd_per_million_tokens(3.6, 10, 1e6 / 3600) == pytest.approx(10.0 * 3.6, rel=1e-12)


@pytest.mark.slow
def test_submitit_local_mode_summarizes_the_sweep_and_sets_the_exit_code(tmp_path):
    """hydra-submitit-launcher's local mode (what its SLURM mode runs, on this machine): jobs in
    submitit's own processes, results read back from the job dirs."""
    run = mist_ds("tune", "-m", "hydra/launcher=submitit_local", "model=gpt3-1.3b,tiny", "cluster=cpu",
                  "tuner.compare_baselines=false", "tuner.quiet=true", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert run.returncode == 3, run.stderr
    rows = _rows(tmp_path / "sweep")
    assert [(row["job"], row["status"]) for row in rows] == [("0", "3"), ("1", "0")]
    assert PLAN_FILES <= {p.name for p in (tmp_path / "sweep" / "1").iterdir()}
