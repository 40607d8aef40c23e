"""The end of a sweep: a Hydra Callback that assembles sweep.csv, sweep.md and sweep.json in the sweep dir
from the result.json each job wrote in its own dir (mist_ds/report/sweep.py), under any launcher: the
jobs may have run in this process (basic launcher), in worker processes (hydra-joblib-launcher) or
elsewhere (hydra-submitit-launcher); the callback runs once, in the process that launched them.

The sweep's status is the largest job status: 0 every job succeeded, 2 a job had bad input, 3 a job
found no plan; a job dir without result.json (a job that crashed or was stopped) counts as LOST.
`mist-ds` passes `status_file`, where the callback writes that status for the command's exit code.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from mist_ds.files import json_text, write_atomic, write_files_atomic
from mist_ds.report.sweep import RESULT_FILE, mark_best, render_csv, render_md

log = logging.getLogger("mist_ds.sweep")
LOST = 1
"""Status of a job that left no result.json (it crashed or was stopped)."""
HYDRA_SUBDIR = ".hydra"


def _natural(name: str) -> list:
    """Sort key: job 10 after job 9."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The jobs' dirs under `sweep_dir`: those holding a result.json or Hydra's .hydra/ (written before a job runs)."""
    found = {p.parent for p in sweep_dir.rglob(RESULT_FILE)} | {p.parent for p in sweep_dir.rglob(HYDRA_SUBDIR)}
    found.discard(sweep_dir)
    return sorted(found, key=lambda d: _natural(d.relative_to(sweep_dir).as_posix()))


def job_row(sweep_dir: Path, job_dir: Path) -> dict[str, Any]:
    """The job's result.json as a row named by its dir, or a LOST row."""
    name = job_dir.relative_to(sweep_dir).as_posix()
    path = job_dir / RESULT_FILE
    if not path.is_file():
        return {"job": name, "status": LOST,
                "reason": f"no {RESULT_FILE}: the job crashed or was stopped (see its log)"}
    return {"job": name, **json.loads(path.read_text())}


def summarize(sweep_dir: Path) -> tuple[int, list[Path]]:
    """(the sweep's status, the files written): sweep.csv, sweep.md, sweep.json in `sweep_dir`."""
    rows = mark_best([job_row(sweep_dir, d) for d in job_dirs(sweep_dir)])
    status = max((int(row["status"]) for row in rows), default=0)
    files = {"sweep.csv": render_csv(rows), "sweep.md": render_md(rows, f"Sweep: {len(rows)} jobs, status {status}"),
             "sweep.json": json_text({"status": status, "jobs": rows})}
    sweep_dir.mkdir(parents=True, exist_ok=True)
    return status, write_files_atomic(sweep_dir, files)


class SweepSummary(Callback):
    """Hydra calls on_multirun_end after every job of the sweep has returned."""

    def __init__(self, status_file: str | None = None) -> None:
        self.status_file = status_file

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        status, written = summarize(Path(config.hydra.sweep.dir))
        log.info("sweep status %d; wrote %s", status, ", ".join(map(str, written)))
        if self.status_file:
            write_atomic(self.status_file, f"{status}\n")
