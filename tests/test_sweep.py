"""`mist-ds tune -m`: one plan, its pictures and cmd.txt per job dir, and the sweep's summary (sweep.csv,
sweep.md, sweep.json) assembled from the jobs' result.json by the end-of-sweep callback, the same under
the basic launcher and hydra-joblib-launcher (jobs in other processes), whose exit code is the largest
job status all the same. Only this sweep's jobs count (each records itself in the sweep's journal): not
an earlier sweep's folders in a reused sweep dir, nor a result.json the job did not write; a job's
result that cannot be read, jobs sharing one dir or a summary that cannot be made never give status 0."""
from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from mist_ds.cli.sweep import JOURNAL_PREFIX, LOST, SweepStatus, SweepSummary
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


def _leave_an_earlier_sweeps_jobs(sweep: Path, jobs: list[str]) -> None:
    """Job dirs as a finished earlier sweep into `sweep` left them: Hydra's .hydra/ and a result.json."""
    for job in jobs:
        (sweep / job / ".hydra").mkdir(parents=True)
        (sweep / job / "result.json").write_text(json.dumps({"status": 3, "model": "earlier", "reason": "no plan"}))


def test_the_same_sweep_under_joblib_gives_the_same_plans(basic_sweep, tmp_path):
    """Also into a sweep dir reused from an earlier, bigger sweep: its jobs 4 and 5 are no rows of this one."""
    _leave_an_earlier_sweeps_jobs(tmp_path / "sweep", ["0", "4", "5"])
    run = mist_ds("tune", "-m", *JOBLIB, *GRID, "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    joblib_plans, basic_plans = _plans(tmp_path / "sweep"), _plans(basic_sweep)
    assert sorted(joblib_plans) == sorted(basic_plans)
    for job, plan in joblib_plans.items():
        assert plan["strategy"] == basic_plans[job]["strategy"]
        assert plan["prediction"] == basic_plans[job]["prediction"]
    rows = _rows(tmp_path / "sweep")
    assert [(row["job"], row["status"], row["model"]) for row in rows] == [(job, "0", "tiny") for job in "0123"]
    assert (tmp_path / "sweep" / "sweep.md").read_text().startswith("# Sweep: 4 jobs, status 0\n")
    assert not list((tmp_path / "sweep").glob(JOURNAL_PREFIX + "*"))  # the journal went into the summary


@pytest.mark.slow  # the fast lane checks the status file with test_rows_are_this_sweeps_jobs_as_each_ended
def test_under_joblib_a_job_that_fits_nothing_is_a_row_and_sets_the_exit_code(tmp_path):
    """The jobs run in joblib's workers, which leave no status in the launching process: the exit code
    comes from the jobs' result files, as the summary does."""
    run = mist_ds("tune", "-m", *JOBLIB, "model=gpt3-1.3b,tiny", "cluster=cpu", "tuner.compare_baselines=false",
                  "tuner.quiet=true", "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert run.returncode == 3, run.stderr
    rows = _rows(tmp_path / "sweep")
    assert [(row["job"], row["status"]) for row in rows] == [("0", "3"), ("1", "0")]
    assert "no plan fits" in rows[0]["reason"]


def _job_config(sweep: Path, num: int, subdir: str) -> DictConfig:
    """What Hydra hands a job's callbacks: the job's number, dir and overrides."""
    return OmegaConf.create({"hydra": {"job": {"num": num}, "runtime": {"output_dir": str(sweep / subdir)},
                                       "overrides": {"task": [f"model=m{num}"]}}})


def _sweep_config(sweep: Path, subdir: str = "${hydra.job.num}") -> DictConfig:
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep), "subdir": subdir}}})


def _ended(returned: int | Exception) -> JobReturn:
    if isinstance(returned, Exception):
        return JobReturn(status=JobStatus.FAILED, _return_value=returned)
    return JobReturn(status=JobStatus.COMPLETED, _return_value=returned)


def _run_sweep(callback: SweepStatus, sweep: Path, jobs: list[tuple], subdir: str = "${hydra.job.num}") -> None:
    """The callback's hooks as Hydra calls them around `jobs`: (subdir, what the job writes as result.json: a dict,
    raw text or None, what it returns or raises: None for a job that never ends)."""
    callback.on_multirun_start(_sweep_config(sweep, subdir))
    for num, (job_dir, result, returned) in enumerate(jobs):
        config = _job_config(sweep, num, job_dir)
        (sweep / job_dir).mkdir(parents=True, exist_ok=True)
        callback.on_job_start(config, task_function=print)  # Hydra hands the job's task function
        if result is not None:
            (sweep / job_dir / "result.json").write_text(result if isinstance(result, str) else json.dumps(result))
        if returned is not None:
            callback.on_job_end(config, _ended(returned))
    callback.on_multirun_end(_sweep_config(sweep, subdir))


def test_rows_are_this_sweeps_jobs_as_each_ended(tmp_path):
    """A job that never ended (killed) is a LOST row, one that raised too; one that wrote no result.json is a row
    with its exit status, not the earlier sweep's result.json its dir still holds; an earlier sweep's job is none."""
    sweep, status_file = tmp_path / "sweep", tmp_path / "status"
    _leave_an_earlier_sweeps_jobs(sweep, ["2", "9"])
    _run_sweep(SweepSummary(str(status_file)), sweep, [
        ("0", None, None), ("1", {"status": 3, "reason": "no plan fits"}, 3), ("2", None, 2),
        ("3", None, ValueError("a bug"))])
    rows = _rows(sweep)
    assert [(row["job"], row["status"]) for row in rows] == [("0", str(LOST)), ("1", "3"), ("2", "2"),
                                                             ("3", str(LOST))]
    assert "never ended" in rows[0]["reason"] and rows[1]["reason"] == "no plan fits"
    assert "no result.json of its own" in rows[2]["reason"] and not rows[2].get("model")
    assert "raised ValueError: a bug" in rows[3]["reason"]
    assert int(status_file.read_text()) == 3
    assert not list(sweep.glob(JOURNAL_PREFIX + "*"))


def test_a_result_that_is_no_json_is_a_row_saying_so_and_fails_the_sweep(tmp_path):
    sweep, status_file = tmp_path / "sweep", tmp_path / "status"
    _run_sweep(SweepSummary(str(status_file)), sweep, [("0", '{"status": 0', 0), ("1", {"status": 0}, 0)])
    rows = _rows(sweep)
    assert [(row["job"], row["status"]) for row in rows] == [("0", str(LOST)), ("1", "0")]
    assert "result.json cannot be read (JSONDecodeError" in rows[0]["reason"]
    assert int(status_file.read_text()) == LOST


def test_a_summary_that_cannot_be_made_leaves_a_failing_status(tmp_path, monkeypatch):
    """Hydra turns a callback's exception into a warning: the status file must say the sweep failed."""
    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr("mist_ds.cli.sweep.write_files_atomic", fail)
    status_file = tmp_path / "status"
    with pytest.raises(OSError, match="disk full"):
        _run_sweep(SweepSummary(str(status_file)), tmp_path / "sweep", [("0", {"status": 0}, 0)])
    assert int(status_file.read_text()) == LOST


def test_jobs_that_shared_one_dir_are_rows_naming_the_subdir_and_fail_the_sweep(tmp_path):
    """hydra.sweep.subdir=. puts every job in the sweep dir, each overwriting the others' plan files."""
    sweep, status_file = tmp_path / "sweep", tmp_path / "status"
    _run_sweep(SweepSummary(str(status_file)), sweep, [(".", {"status": 0}, 0), (".", {"status": 0}, 0)], subdir=".")
    rows = _rows(sweep)
    assert [(row["job"], row["status"]) for row in rows] == [(". (job 0)", "2"), (". (job 1)", "2")]
    assert all(row["reason"].startswith("hydra.sweep.subdir=.: jobs 0, 1 all wrote into") for row in rows)
    assert "drop hydra.sweep.subdir" in rows[0]["reason"]
    assert int(status_file.read_text()) == 2


def test_any_commands_sweep_gets_its_status_from_its_jobs_records(tmp_path):
    """predict, explain, show: no result.json, one dir for all jobs (they write nothing); the status is the jobs'."""
    sweep, status_file = tmp_path / "sweep", tmp_path / "status"
    _run_sweep(SweepStatus(str(status_file)), sweep, [(".", None, 0), (".", None, 2)], subdir=".")
    assert int(status_file.read_text()) == 2
    assert sorted(p.name for p in sweep.iterdir()) == []  # no summary, and the journal is gone


def test_a_predict_sweep_under_joblib_exits_with_its_jobs_largest_status(tmp_path):
    run = mist_ds("predict", "-m", *JOBLIB, "model=tiny", "cluster=cpu", "strategy.zero_stage=0,9",
                  "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert "strategy.zero_stage" in run.stderr
    assert run.returncode == 2, run.stderr


def test_best_marks_the_fastest_and_the_cheapest_row_per_model():
    rows = [{"model": "a", "status": 0, "tokens_per_s": 100.0, "usd_per_million_tokens": 2.0},
            {"model": "a", "status": 0, "tokens_per_s": 300.0, "usd_per_million_tokens": 3.0},
            {"model": "a", "status": 3, "tokens_per_s": None},
            {"model": "b", "status": 0, "tokens_per_s": 50.0, "usd_per_million_tokens": None}]
    assert [row["best"] for row in mark_best(rows)] == [CHEAPEST, FASTEST, "", FASTEST]
    assert usd_per_million_tokens(None, 8, 1e4) is None
    assert usd_per_million_tokens(3.6, 10, 1e6 / 3600) == pytest.approx(10.0 * 3.6, rel=1e-12)


@pytest.mark.slow  # the fast lane: test_jobs_that_shared_one_dir_are_rows_naming_the_subdir_and_fail_the_sweep
def test_under_joblib_jobs_sharing_one_dir_fail_the_sweep_naming_hydra_sweep_subdir(tmp_path):
    """A subdir that interpolates, yet the same for every job (the job's name): known only once the jobs ran."""
    run = mist_ds("tune", "-m", *JOBLIB, "model=tiny", "cluster=cpu", "train.global_batch_size=128,64",
                  "tuner.compare_baselines=false", "tuner.quiet=true", "hydra.sweep.dir=sweep",
                  "hydra.sweep.subdir=${hydra.job.name}", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "hydra.sweep.subdir=${hydra.job.name}: jobs 0, 1 all wrote into" in run.stderr
    rows = _rows(tmp_path / "sweep")
    assert [(row["job"], row["status"]) for row in rows] == [("tune (job 0)", "2"), ("tune (job 1)", "2")]


def test_a_sweep_whose_jobs_would_share_one_dir_is_refused_before_any_job_runs(tmp_path):
    run = mist_ds("tune", "-m", "model=tiny", "cluster=cpu", "train.global_batch_size=0,-1", "hydra.sweep.dir=sweep",
                  "hydra.sweep.subdir=.", cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "hydra.sweep.subdir='.': the same dir for every job" in run.stderr and "drop it" in run.stderr
    assert not (tmp_path / "sweep").exists()


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


def test_a_job_that_raises_a_bug_leaves_no_journal_in_the_sweep_dir(tmp_path, monkeypatch):
    """A non-ConfigError ends Hydra's sweep before on_multirun_end: the command still removes the sweep's journal
    (the traceback is the user's report of the bug)."""
    from mist_ds.cli import main

    def bug(cfg: DictConfig) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setitem(main.COMMANDS, "show", main.Command(bug, "raises"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="a bug"):
        main.run_command("show", ["-m", "model=tiny,gpt3-1.3b", f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert not list((tmp_path / "sweep").glob(JOURNAL_PREFIX + "*"))
