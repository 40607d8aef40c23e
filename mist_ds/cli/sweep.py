"""The end of a sweep: Hydra Callbacks that give a multirun its status (SweepStatus, any command) and, for tune,
assemble sweep.csv, sweep.md and sweep.json in the sweep dir from the result.json each job wrote in its own dir
(SweepSummary; mist_ds/report/sweep.py), under any launcher: the jobs may run in this process (basic launcher),
in worker processes (hydra-joblib-launcher) or elsewhere (hydra-submitit-launcher); on_multirun_start and
on_multirun_end run once, in the process that launched them.

Which jobs are this sweep's: a journal, a folder `.mist_ds_jobs-*` that on_multirun_start makes in the sweep dir,
gets one record per job, written by the job itself: on_job_start (started; LOST until it ends) and on_job_end
(the status its task returned, or that it raised). Hydra runs these two hooks in the job's own process
(hydra/core/utils.py run_job) on the callback objects the launcher was handed (HydraContext, which joblib and
submitit pickle into their workers), so the journal's path, set at on_multirun_start, travels with the jobs. Only
the journal's jobs are counted: a sweep dir reused from an earlier sweep keeps that sweep's folders and result
files, and they are neither rows nor statuses.

The sweep's status is the largest job status: 0 every job succeeded, 2 a job had bad input, 3 a job found no plan;
LOST (1) a job that raised, never ended (crashed or was stopped) or left no readable result.json of its own; 2 jobs
that wrote into one dir (a hydra.sweep.subdir that is the same for every job). `mist-ds` passes `status_file`,
where the callback writes that status for the command's exit code: LOST from the sweep's start until the jobs are
counted, so a sweep whose status or summary cannot be made never exits 0.
"""
from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from mist_ds.files import json_text, write_atomic, write_files_atomic, write_json_atomic
from mist_ds.report.sweep import RESULT_FILE, mark_best, render_csv, render_md
from mist_ds.specs.errors import EXIT_BAD_INPUT, EXIT_OK

log = logging.getLogger("mist_ds.sweep")
LOST = 1
"""Status of a job that raised, never ended (it crashed or was stopped) or left no readable result.json."""
JOURNAL_PREFIX = ".mist_ds_jobs-"
NEVER_ENDED = "the job started and never ended: it crashed or was stopped (see its log)"


def job_record(num: int, directory: Path, overrides: Sequence[str], status: int, reason: str | None = None,
               wrote_result: bool = True) -> dict[str, Any]:
    """A job's record in the sweep's journal: its number, dir and overrides, the status it ended with (LOST until
    it ends) and why, and whether the result.json in its dir is its own (not one left by an earlier sweep)."""
    return {"num": num, "dir": str(directory), "overrides": list(overrides), "status": status, "reason": reason,
            "wrote_result": wrote_result}


def _signature(path: Path) -> list[int] | None:
    """What tells one write of `path` from another (an atomic write replaces the inode); None when absent."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return [stat.st_ino, stat.st_mtime_ns]


def started_record(config: DictConfig) -> dict[str, Any]:
    """The record of a job that has started (the job's config, in its own process): LOST until it ends, with
    the signature of the result.json its dir already holds, to tell the job's own from an earlier sweep's."""
    out = Path(config.hydra.runtime.output_dir)
    return {**job_record(int(config.hydra.job.num), out, config.hydra.overrides.task, LOST, NEVER_ENDED, False),
            "result_before": _signature(out / RESULT_FILE)}


def job_status(job_return: JobReturn) -> tuple[int, str | None]:
    """(exit status, reason) of a job from what its task returned (its status) or raised (LOST)."""
    if job_return.status == JobStatus.COMPLETED:
        value = job_return.return_value
        return (value if isinstance(value, int) else EXIT_OK), None
    error = job_return._return_value  # a failed job's exception, read as Hydra's LogJobReturnCallback reads it
    return LOST, f"the job raised {type(error).__name__}: {error} (see its log)"


def ended_record(started: dict[str, Any], job_return: JobReturn) -> dict[str, Any]:
    """The started record of a job that has ended: its status and whether it wrote its dir's result.json."""
    status, reason = job_status(job_return)
    after = _signature(Path(started["dir"]) / RESULT_FILE)
    return {**started, "status": status, "reason": reason,
            "wrote_result": after is not None and after != started.get("result_before")}


def _record_path(journal: Path, num: int) -> Path:
    return journal / f"{num}.json"


def read_journal(journal: Path) -> list[dict[str, Any]]:
    """The sweep's job records, by job number (written atomically: each whole, or not there)."""
    records = [json.loads(path.read_text()) for path in journal.glob("*.json")]
    return sorted(records, key=lambda record: record["num"])


def read_result(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the job's result, None), or (None, why `path` holds no result: missing, not JSON, no integer status)."""
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"no {path.name}"
    except (OSError, ValueError) as error:  # ValueError: JSONDecodeError, UnicodeDecodeError
        return None, f"{path.name} cannot be read ({type(error).__name__}: {error})"
    if not isinstance(result, dict) or not isinstance(result.get("status"), int):
        return None, f"{path.name} holds no job result (a JSON object with an integer status)"
    return result, None


def job_name(sweep_dir: Path, directory: Path) -> str:
    """A job's dir as its row names it: relative to the sweep dir (`.` for the sweep dir itself), else absolute."""
    sweep, job = sweep_dir.resolve(), directory.resolve()
    return job.relative_to(sweep).as_posix() if job.is_relative_to(sweep) else str(job)


def shared_dirs(records: Sequence[dict[str, Any]]) -> dict[Path, list[int]]:
    """The dirs that more than one job of the sweep wrote into, with those jobs' numbers."""
    jobs_of: dict[Path, list[int]] = {}
    for record in records:
        jobs_of.setdefault(Path(record["dir"]).resolve(), []).append(record["num"])
    return {directory: nums for directory, nums in jobs_of.items() if len(nums) > 1}


def sharing_reason(nums: Sequence[int], directory: Path, subdir: str) -> str:
    """Why the jobs `nums` have no row of their own: they wrote into one dir, each over the others' files."""
    return (f"hydra.sweep.subdir={subdir}: jobs {', '.join(map(str, nums))} all wrote into {directory}, each over "
            "the others' files; drop hydra.sweep.subdir (Hydra's default, ${hydra.job.num}, gives each job its own "
            "dir)")


def job_row(sweep_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """The job's row: its own result.json, its status never below the one the job ended with; or, for a job that
    raised, never ended or has no readable result.json of its own, a row saying so (at least LOST)."""
    row = {"job": job_name(sweep_dir, Path(record["dir"])), "overrides": " ".join(record["overrides"]) or None}
    if record["reason"] is not None:
        return {**row, "status": max(record["status"], LOST), "reason": record["reason"]}
    result, problem = read_result(Path(record["dir"]) / RESULT_FILE) if record["wrote_result"] else (
        None, f"no {RESULT_FILE} of its own")
    if result is None:
        return {**row, "status": max(record["status"], LOST),
                "reason": f"{problem}: the job crashed, was stopped or failed before writing it (see its log)"}
    return {"job": row["job"], **result, "status": max(record["status"], result["status"])}


def summary_rows(sweep_dir: Path, records: Sequence[dict[str, Any]], subdir: str) -> list[dict[str, Any]]:
    """A row per job (job_row); jobs that shared a dir (`subdir`, hydra.sweep.subdir as set) are rows saying so,
    with status EXIT_BAD_INPUT: the files in their dir are the last writer's, no one job's."""
    shared = shared_dirs(records)
    rows = []
    for record in records:
        directory = Path(record["dir"]).resolve()
        if directory not in shared:
            rows.append(job_row(sweep_dir, record))
            continue
        rows.append({"job": f"{job_name(sweep_dir, directory)} (job {record['num']})",
                     "status": max(record["status"], EXIT_BAD_INPUT), "overrides": " ".join(record["overrides"]),
                     "reason": sharing_reason(shared[directory], directory, subdir)})
    return mark_best(rows)


def summarize(sweep_dir: Path, records: Sequence[dict[str, Any]], subdir: str) -> tuple[int, list[Path]]:
    """(the sweep's status, the files written): sweep.csv, sweep.md, sweep.json in `sweep_dir`, a row for each of
    `records` (the sweep's jobs)."""
    rows = summary_rows(sweep_dir, records, subdir)
    status = max((int(row["status"]) for row in rows), default=EXIT_OK)
    files = {"sweep.csv": render_csv(rows), "sweep.md": render_md(rows, f"Sweep: {len(rows)} jobs, status {status}"),
             "sweep.json": json_text({"status": status, "jobs": rows})}
    sweep_dir.mkdir(parents=True, exist_ok=True)
    return status, write_files_atomic(sweep_dir, files)


def subdir_setting(config: DictConfig) -> str:
    """hydra.sweep.subdir as the user set it (unresolved: it names hydra.job.num, which only a job has)."""
    return str(OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir"))


def journal_note(status_file: str | Path) -> Path:
    """Where SweepStatus notes its journal's path beside `status_file`: a job that raises a non-ConfigError (a bug)
    ends Hydra's sweep before on_multirun_end, and the command removes the journal then (remove_left_journal)."""
    return Path(f"{status_file}.journal")


def remove_left_journal(status_file: str | Path) -> None:
    """Remove the journal a sweep noted beside `status_file` if on_multirun_end did not (the sweep ended by a raise)."""
    note = journal_note(status_file)
    if note.is_file():
        journal = Path(note.read_text())
        if journal.name.startswith(JOURNAL_PREFIX):
            shutil.rmtree(journal, ignore_errors=True)


class SweepStatus(Callback):
    """The multirun's status, from the records its jobs wrote in the sweep's journal (module docstring)."""

    def __init__(self, status_file: str | None = None) -> None:
        self.status_file = status_file
        self.journal: str | None = None
        """Set at on_multirun_start; None in a single run (Hydra calls the job hooks there too)."""

    def write_status(self, status: int) -> None:
        if self.status_file:
            write_atomic(self.status_file, f"{status}\n")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra turns a callback's exception into a warning: should counting fail, LOST stays the status.
        self.write_status(LOST)
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            self.journal = tempfile.mkdtemp(prefix=JOURNAL_PREFIX, dir=sweep_dir)  # this sweep's own, never reused
        except OSError:  # left to the launcher, whose own mkdir fails next: mist-ds reports that as bad input
            return
        if self.status_file:
            write_atomic(journal_note(self.status_file), self.journal)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.journal is not None:
            write_json_atomic(_record_path(Path(self.journal), int(config.hydra.job.num)), started_record(config))

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if self.journal is not None:
            path = _record_path(Path(self.journal), int(config.hydra.job.num))
            # no start record (its write failed): started now, so a result.json already there is not the job's own
            started = json.loads(path.read_text()) if path.is_file() else started_record(config)
            write_json_atomic(path, ended_record(started, job_return))

    def conclude(self, config: DictConfig, records: Sequence[dict[str, Any]]) -> int:
        """The sweep's status: the largest of its jobs' (LOST when none recorded: the journal was not written)."""
        return max((record["status"] for record in records), default=LOST)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.journal is None:
            log.error("sweep status %d: its jobs were not recorded (see the warnings above)", LOST)
            self.write_status(LOST)
            return
        status = self.conclude(config, read_journal(Path(self.journal)))
        self.write_status(status)
        shutil.rmtree(self.journal, ignore_errors=True)  # its content is in the status (and the summary)


class SweepSummary(SweepStatus):
    """SweepStatus, and the sweep's summary: sweep.csv, sweep.md, sweep.json with a row per job (summary_rows)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        super().on_multirun_start(config, **kwargs)
        subdir = subdir_setting(config)
        if "${" not in subdir:  # Hydra runs the jobs anyway (a callback cannot stop them): say so before they do
            log.error("hydra.sweep.subdir=%s is the same for every job: jobs would write into one dir, each over "
                      "the others' files, and fail the sweep; drop hydra.sweep.subdir", subdir)

    def conclude(self, config: DictConfig, records: Sequence[dict[str, Any]]) -> int:
        subdir = subdir_setting(config)
        for directory, nums in shared_dirs(records).items():
            log.error("%s", sharing_reason(nums, directory, subdir))
        status, written = summarize(Path(str(config.hydra.sweep.dir)), records, subdir)
        log.info("sweep status %d; wrote %s", status, ", ".join(map(str, written)))
        return max(status, super().conclude(config, records))
