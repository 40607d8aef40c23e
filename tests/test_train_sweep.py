"""Training sweeps (`hydra/launcher=mist_deepspeed`, hydra_plugins/mist_ds_deepspeed_launcher): plans from a
`mist-ds tune` sweep, each trained by its own DeepSpeed launch of launch/train.py on 2 CPU ranks, and
each run's run.json in the training sweep's summary."""
from __future__ import annotations

import csv
import json
import sys

import pytest

from tests.test_cli import mist_ds
from tests.test_train import TRAIN, run

pytestmark = pytest.mark.slow
JOB_TIMEOUT_S = 300


def test_a_training_sweep_trains_each_plan_and_summarizes_the_runs(tmp_path):
    tuned = mist_ds("tune", "-m", "model=tiny", "cluster=cpu", "model.num_layers=2,3", "tuner.compare_baselines=false",
                    "tuner.quiet=true", "hydra.sweep.dir=plans", cwd=tmp_path)
    assert tuned.returncode == 0, tuned.stderr
    plans = ",".join(str(tmp_path / "plans" / job / "plan.json") for job in ("0", "1"))
    code, out = run([sys.executable, str(TRAIN), "-m", "hydra/launcher=mist_deepspeed", "hydra.launcher.num_gpus=2",
                     f"hydra.launcher.timeout_s={JOB_TIMEOUT_S}", f"mist.plan={plans}", "run.steps=3",
                     "hydra.sweep.dir=train"], tmp_path, timeout_s=2 * JOB_TIMEOUT_S + 60)
    assert code == 0, out[-6000:]
    with open(tmp_path / "train" / "sweep.csv", newline="") as rows:
        rows = list(csv.DictReader(rows))
    assert [(row["job"], row["status"], row["model"], row["ranks"], row["steps"]) for row in rows] == \
        [("0", "0", "tiny", "2", "3"), ("1", "0", "tiny", "2", "3")]
    for job, row in zip(("0", "1"), rows):
        record = json.loads((tmp_path / "train" / job / "run.json").read_text())
        plan = json.loads((tmp_path / "plans" / job / "plan.json").read_text())
        assert record["plan"] == plan  # each job trained its own plan, in its own pinned run dir
        assert float(row["loss_last"]) == record["steps"][-1]["loss"] < record["steps"][0]["loss"]
        assert float(row["predicted_iteration_time_s"]) == plan["prediction"]["iteration_time_s"]
        assert float(row["tokens_per_s"]) > 0


def test_a_failing_training_job_is_a_row_and_the_sweep_fails_after_every_job(tmp_path):
    """...and a job folder an earlier sweep left in the sweep dir is no row of this one."""
    (tmp_path / "train" / "7").mkdir(parents=True)
    (tmp_path / "train" / "7" / "result.json").write_text(json.dumps({"status": 3, "reason": "an earlier sweep's"}))
    code, out = run([sys.executable, str(TRAIN), "-m", "hydra/launcher=mist_deepspeed", "hydra.launcher.num_gpus=2",
                     f"hydra.launcher.timeout_s={JOB_TIMEOUT_S}", "model=tiny", "cluster=cpu", "run.steps=2",
                     "mist.plan=missing.json,null", "hydra.sweep.dir=train"], tmp_path,
                    timeout_s=2 * JOB_TIMEOUT_S + 60)
    assert code == 1, out[-6000:]
    with open(tmp_path / "train" / "sweep.csv", newline="") as rows:
        failed, trained = csv.DictReader(rows)
    assert failed["status"] not in ("", "0") and "exit" in failed["reason"] and failed["steps"] == ""
    assert (trained["status"], trained["steps"]) == ("0", "2")
