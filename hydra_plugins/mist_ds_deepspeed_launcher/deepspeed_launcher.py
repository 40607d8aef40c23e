"""`hydra/launcher=mist_deepspeed`: a training sweep, each job one DeepSpeed launch of the swept script.

    python launch/train.py -m hydra/launcher=mist_deepspeed hydra.launcher.num_gpus=8 \
        mist.plan=sweep/0/plan.json,sweep/1/plan.json run.steps=50

Each job runs `deepspeed --num_nodes N --num_gpus G --no_local_rank [--master_port P] <script> <job's
overrides> hydra.run.dir=<job dir>` in its own session (its own process group: a job past
`timeout_s`, or the sweep interrupted, has every rank of it killed), one job after another, with its
output in <job dir>/launch.log. The job dir is Hydra's (hydra.sweep.dir / hydra.sweep.subdir), pinned
for all the job's ranks. After each job its run.json becomes the job's result.json (a row:
mist_ds/report/sweep.py train_result), and after the jobs the sweep's summary (sweep.csv, sweep.md,
sweep.json) is assembled from the job dirs as `mist-ds tune -m` does (mist_ds/cli/sweep.py). A job
that fails is a row with its exit status and the end of its log; the sweep still runs every job, then
fails (exit 1) naming the jobs that did.

Hydra instantiates launchers only from the `hydra_plugins` package, and finds their configs where its
plugin scan imports them: hence the ConfigStore entry below. (No `from __future__ import annotations`:
that scan runs the module outside sys.modules, where dataclasses cannot resolve string annotations.)
"""

import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)
LAUNCH_LOG = "launch.log"
TIMED_OUT = 124
"""A job's status when it ran past timeout_s (as coreutils' timeout)."""
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The sweeping process's own rank variables (launch/train.py runs as rank 0 of 1): not the job's."""


@dataclass
class MistDeepSpeedLauncherConf:
    _target_: str = "hydra_plugins.mist_ds_deepspeed_launcher.deepspeed_launcher.MistDeepSpeedLauncher"
    num_gpus: int = 1  # ranks per node of each job: deepspeed --num_gpus
    num_nodes: int = 1  # nodes of each job: deepspeed --num_nodes (more than 1: give hostfile)
    hostfile: Optional[str] = None  # DeepSpeed's hostfile; null = DeepSpeed's default
    script: Optional[str] = None  # the training script; null = the script being swept (sys.argv[0])
    launcher_args: List[str] = field(default_factory=list)  # more arguments for DeepSpeed's launcher
    env: Dict[str, str] = field(default_factory=dict)  # added to each job's environment, e.g. DS_ACCELERATOR: cpu
    timeout_s: Optional[float] = None  # a job running longer is killed with all its ranks; null = no limit


ConfigStore.instance().store(group="hydra/launcher", name="mist_deepspeed", node=MistDeepSpeedLauncherConf,
                             provider="mist_ds")


def deepspeed_command(settings: MistDeepSpeedLauncherConf, script: str, overrides: Sequence[str], job_dir: Path,
                      master_port: int | None) -> list[str]:
    """The job's DeepSpeed launch: --no_local_rank for a Hydra script, its run dir pinned for every rank."""
    executable = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
    command = [executable, "--num_nodes", str(settings.num_nodes), "--num_gpus", str(settings.num_gpus),
               "--no_local_rank"]
    if settings.hostfile:
        command += ["--hostfile", settings.hostfile]
    if master_port is not None:
        command += ["--master_port", str(master_port)]
    return [*command, *settings.launcher_args, script, *overrides, f"hydra.run.dir={job_dir}"]


class MistDeepSpeedLauncher(Launcher):
    def __init__(self, **settings) -> None:
        self.settings = MistDeepSpeedLauncherConf(**settings)
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from mist_ds.cli.sweep import job_record, subdir_setting, summarize

        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("Launching %d training jobs with DeepSpeed", len(job_overrides))
        returns = [self._run(list(overrides), initial_job_idx + i) for i, overrides in enumerate(job_overrides)]
        # this sweep's jobs, each row from the result.json it just wrote (a reused sweep dir's leftovers are no rows)
        records = [job_record(initial_job_idx + i, Path(job.working_dir), job.overrides, 0)
                   for i, job in enumerate(returns)]
        status, written = summarize(sweep_dir, records, subdir_setting(self.config))
        log.info("sweep status %d; wrote %s", status, ", ".join(map(str, written)))
        return returns

    def _run(self, overrides: list[str], job_idx: int) -> JobReturn:
        from mist_ds.files import write_json_atomic
        from mist_ds.observe.ranks import LaunchTimeout, run_in_session
        from mist_ds.report.sweep import RESULT_FILE, train_result
        from mist_ds.runtime import free_port

        assert self.config is not None and self.hydra_context is not None
        log.info("\t#%d : %s", job_idx, " ".join(filter_overrides(overrides)))
        job_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(job_config):
            job_config.hydra.job.id = job_config.hydra.job.num = job_idx
        HydraConfig.instance().set_config(job_config)  # hydra.sweep.subdir may name hydra.job.num
        job_dir = (Path(str(job_config.hydra.sweep.dir)) / str(job_config.hydra.sweep.subdir)).resolve()
        job_dir.mkdir(parents=True, exist_ok=True)
        script = str(Path(self.settings.script or sys.argv[0]).resolve())
        single_node = self.settings.num_nodes == 1 and not self.settings.hostfile
        command = deepspeed_command(self.settings, script, overrides, job_dir, free_port() if single_node else None)
        env = {k: v for k, v in os.environ.items() if k not in RANK_ENV} | dict(self.settings.env)
        try:
            status, output = run_in_session(command, os.getcwd(), env, self.settings.timeout_s,
                                            f"job {job_idx}")
        except LaunchTimeout as timeout:
            status, output = TIMED_OUT, str(timeout)
        (job_dir / LAUNCH_LOG).write_text(output)
        run_json = job_dir / "run.json"
        record = json.loads(run_json.read_text()) if status == 0 and run_json.is_file() else None
        reason = None if record is not None else _failure(status, output, job_dir)
        write_json_atomic(job_dir / RESULT_FILE, train_result(overrides, status, reason, record))
        job = JobReturn(overrides=overrides, cfg=job_config, hydra_cfg=job_config, working_dir=str(job_dir),
                        task_name=job_config.hydra.job.name)
        job.status = JobStatus.COMPLETED if reason is None else JobStatus.FAILED
        job.return_value = status if reason is None else RuntimeError(f"training job {job_idx}: {reason}")
        return job


def _failure(status: int, output: str, job_dir: Path) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "no output"
    if status == 0:
        return f"exit 0 but no run.json in {job_dir}"
    return f"exit {status}: {last} (log: {job_dir / LAUNCH_LOG})"
