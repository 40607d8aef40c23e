"""mist-deepspeed for a user's script that calls `mist_ds.initialize` (docs/design.md, Your own script): one
DeepSpeed launch per phase (mist_ds/script/settings.py), the settings handed over in the environment.

1. plan: the script's ranks start, rank 0 plans the model the script hands mist_ds.initialize and writes
   <run dir>/plan/ (and plan/candidates/ with tuner.verify_top_n or tuner.write_top_n); every rank exits.
2. verify (tuner.verify_top_n=N): each candidate trains a few steps in a fresh launch (DeepSpeed's process groups
   are global to a process); a failure (exit code, out of memory, a hang past tuner.verify_timeout_s) is recorded
   for that candidate and the next one runs; the measured fastest becomes plan/plan.json; plan/verify.csv and
   plan/verify.md give predicted and measured time and memory per candidate.
3. cmd.txt (the run dir's and plan/'s): the command that trains the plan, settings file and CPU environment
   included; `run` then launches it, `tune` stops.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mist_ds.files import write_atomic
from mist_ds.report.command import command_file
from mist_ds.script.settings import (CANDIDATES_DIR, PLAN_DIR, SETTINGS_ENV, VERIFY_FILE, ScriptSettings)
from mist_ds.specs.cluster import GIB
from mist_ds.specs.strategy import layout_text, strategy_from_dict

LAUNCHER = [sys.executable, "-m", "mist_ds.cli.deepspeed_launcher"]
HUNG = -signal.SIGKILL
"""launch_phase's exit code for a launch stopped at its timeout."""
STOP_GRACE_S = 10.0
OOM_KILLED = (137, 247)
"""Exit codes of a rank the system's out-of-memory killer ended (128 + SIGKILL; DeepSpeed's launcher's 247)."""
"""DeepSpeed's launcher as mist-deepspeed runs it (exporting MIST_DS_* to other nodes)."""


def mentions_mist_ds(script: str) -> bool:
    """Whether the script's own source names mist_ds (it must call mist_ds.initialize to be planned in-script): a
    script that never does would run to its end in the plan phase."""
    try:
        return "mist_ds" in Path(script).read_text(errors="replace")
    except OSError:
        return False


def settings_file(settings: ScriptSettings, name: str) -> Path:
    path = Path(settings.run_dir) / f"settings.{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, settings.to_json())
    return path


PATH_FLAGS = ("--hostfile",)
"""DeepSpeed launcher flags whose value is a file: made absolute, as the script is (cmd.txt runs from anywhere)."""
CONFIG_FLAG = "--deepspeed_config"
"""The config path argument of deepspeed.add_config_arguments (`--deepspeed` is its on/off switch): made absolute
in a script's arguments too."""


def launch_command(launcher_args: Sequence[str], script: str, user_args: Sequence[str]) -> list[str]:
    """The launcher command line, the script, the hostfile and the script's DeepSpeed config by their absolute paths
    (cmd.txt runs from any directory)."""
    path = Path(script)
    return [*absolute_flag_paths(launcher_args, PATH_FLAGS), str(path.resolve()) if path.is_file() else script,
            *absolute_flag_paths(user_args, (CONFIG_FLAG,))]


def absolute_flag_paths(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """`args` with the file each of `flags` names ("--flag F" or "--flag=F") by its absolute path, where it is one."""
    out = list(args)
    for i, arg in enumerate(out):
        name, equals, value = arg.partition("=")
        if name in flags and equals and Path(value).is_file():
            out[i] = f"{name}={Path(value).resolve()}"
        elif arg in flags and i + 1 < len(out) and Path(out[i + 1]).is_file():
            out[i + 1] = str(Path(out[i + 1]).resolve())
    return out


def launch_phase(command: Sequence[str], settings_path: Path, timeout_s: float | None = None,
                 log_path: Path | None = None) -> tuple[int, str]:
    """(exit code, what its output says of a failure) of one launch with the settings; with `timeout_s`, past it the
    whole process group is killed and the code is -9. With `log_path` the output goes there, else to this
    terminal."""
    env = {**os.environ, SETTINGS_ENV: str(settings_path)}
    out = open(log_path, "w") if log_path else None  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([*LAUNCHER, *command], env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True)
    code = None
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = HUNG
    finally:  # a hang, an interrupt, or ranks the launcher left behind: the whole session goes
        stop_session(proc.pid)
        proc.wait()
        if out:
            out.close()
    return code, failure_line(log_path.read_text(errors="replace")) if log_path and log_path.exists() else ""


def stop_session(pgid: int) -> None:
    """End a launch's process group: SIGTERM first (DeepSpeed's launcher then stops its remote ranks too, its
    handler running pdsh's kill command), SIGKILL for what is left after STOP_GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def failure_line(log: str) -> str:
    """The line of a launch's output that says why it failed: the last exception a rank printed (`...Error: ...`),
    else the last line (DeepSpeed's launcher ends with its kill handler's line, which names no cause)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if ("Error: " in line or "Error(" in line) and not line.startswith("File ")]
    return errors[-1] if errors else (lines[-1] if lines else "")


@dataclass(frozen=True)
class Candidate:
    """One verified plan: what was predicted and what was measured (seconds per step, bytes)."""

    index: int
    layout: str
    predicted_s: float
    predicted_peak_bytes: float
    measured_s: float | None
    measured_peak_bytes: int | None
    peak_measured_as: str
    status: str
    """ok, or why it produced no time (exit code and last line, out of memory, hang)."""


def _status(code: int, reason: str, timeout_s: float, needed_steps: int) -> str:
    """A candidate's status without a measurement: a hang, out of memory (torch's and Python's errors say so, or
    the system killed a rank), a script whose loop ended first, or failed; the line that says why."""
    if code == HUNG:
        return f"hang: stopped after {timeout_s:g} s"
    if code == 0:
        return (f"no measurement: the script ended before {needed_steps} optimizer steps (warm-up and timed); "
                "give its loop more steps or lower tuner.verify_num_steps")
    oom = "out of memory" in reason.lower() or "MemoryError" in reason or code in OOM_KILLED
    return f"{'out of memory' if oom else 'failed'} (exit {code}): {reason[:200]}"


def verify(command: Sequence[str], base: ScriptSettings) -> list[Candidate]:
    """Run each candidate plan under plan/candidates for a few steps (module docstring, step 2)."""
    plan_dir = Path(base.run_dir) / PLAN_DIR
    knobs = json.loads((plan_dir / CANDIDATES_DIR / VERIFY_FILE).read_text())
    verify_dir = Path(base.run_dir) / "verify"
    verify_dir.mkdir(parents=True, exist_ok=True)
    found = []
    for index in range(knobs["top_n"]):
        plan_json = plan_dir / CANDIDATES_DIR / str(index) / "plan.json"
        if not plan_json.is_file():
            break
        plan = json.loads(plan_json.read_text())
        layout = layout_text(strategy_from_dict(plan["strategy"], str(plan_json)))
        report = verify_dir / f"{index}.json"
        report.unlink(missing_ok=True)
        settings = ScriptSettings("verify", base.run_dir, base.overrides, plan=str(plan_json),
                                  num_warmup_steps=knobs["num_warmup_steps"], num_steps=knobs["num_steps"],
                                  report=str(report))
        print(f"mist-deepspeed: verifying candidate {index}: {layout}", file=sys.stderr)
        code, reason = launch_phase(command, settings_file(settings, f"verify{index}"), knobs["timeout_s"],
                                    verify_dir / f"{index}.log")
        # a report is a finished measurement, whatever the script did after it (its own teardown may fail)
        measured = json.loads(report.read_text()) if report.is_file() else None
        needed = knobs["num_warmup_steps"] + knobs["num_steps"]
        found.append(Candidate(index, layout, plan["prediction"]["iteration_time_s"],
                               max(plan["prediction"]["peak_memory_bytes"]),
                               measured["seconds_per_step"] if measured else None,
                               measured["peak_bytes"] if measured else None,
                               measured["peak_measured_as"] if measured else "",
                               ("ok" if code == 0 else f"ok (then exit {code})") if measured else
                               _status(code, reason, knobs["timeout_s"], needed)))
    return found


def verify_table(candidates: Sequence[Candidate], chosen: int | None) -> tuple[str, str]:
    """(verify.csv, verify.md) of the candidates."""
    rows = [{"candidate": c.index, "layout": c.layout, "predicted_s": c.predicted_s, "measured_s": c.measured_s,
             "measured_over_predicted": None if c.measured_s is None else c.measured_s / c.predicted_s,
             "predicted_peak_gib": c.predicted_peak_bytes / GIB,
             "measured_peak_gib": c.measured_peak_bytes / GIB if c.measured_peak_bytes else None,
             "peak_measured_as": c.peak_measured_as, "status": c.status, "chosen": c.index == chosen}
            for c in candidates]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]) if rows else ["candidate"])
    writer.writeheader()
    writer.writerows(rows)
    md = ["# Verified candidates", "",
          "Each candidate trained in the user's script, in a fresh launch; seconds per optimizer step after the "
          "untimed warm-up steps.", "",
          "| candidate | layout | predicted s | measured s | measured / predicted | predicted peak GiB | "
          "measured peak GiB | status |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = " (chosen)" if r["chosen"] else ""
        ratio = f"{r['measured_over_predicted']:.3g}" if r["measured_over_predicted"] is not None else "-"
        measured = f"{r['measured_s']:.4g}" if r["measured_s"] is not None else "-"
        peak = f"{r['measured_peak_gib']:.3f}" if r["measured_peak_gib"] else "-"
        md.append(f"| {r['candidate']}{mark} | {r['layout']} | {r['predicted_s']:.4g} | {measured} | {ratio} | "
                  f"{r['predicted_peak_gib']:.3f} | {peak} | {r['status']} |")
    ok = [c for c in candidates if c.measured_s is not None]
    if ok:
        ratio = sum(c.measured_s / c.predicted_s for c in ok) / len(ok)
        md += ["", f"Measured / predicted, mean over {len(ok)} candidates: {ratio:.3g}. A cluster config's compute "
                   "and link rates scaled by its inverse would have predicted these steps (docs/design.md, Verifying "
                   "the best plans); `mist-ds profile` measures them instead."]
    if rows and ok:
        md.append(f"Peak memory measured as: {ok[0].peak_measured_as}.")
    return text.getvalue(), "\n".join(md) + "\n"


def choose(candidates: Sequence[Candidate], plan_dir: Path) -> Candidate | None:
    """The measured fastest; its plan files become plan/'s, plan.json recording the choice and why."""
    ok = [c for c in candidates if c.measured_s is not None]
    chosen = min(ok, key=lambda c: c.measured_s) if ok else None
    csv_text, md_text = verify_table(candidates, chosen.index if chosen else None)
    write_atomic(plan_dir / "verify.csv", csv_text)
    write_atomic(plan_dir / "verify.md", md_text)
    if chosen is None:
        return None
    source = plan_dir / CANDIDATES_DIR / str(chosen.index)
    for path in source.iterdir():
        if path.is_file():
            shutil.copyfile(path, plan_dir / (path.name + ".tmp"))
            os.replace(plan_dir / (path.name + ".tmp"), plan_dir / path.name)
    plan = json.loads((plan_dir / "plan.json").read_text())
    others = ", ".join(f"candidate {c.index} {c.measured_s:.4g} s" if c.measured_s is not None else
                       f"candidate {c.index} {c.status.split(':')[0]}" for c in candidates if c is not chosen)
    plan["verify"] = {"chosen": chosen.index, "measured_s": chosen.measured_s,
                      "why": f"measured fastest: {chosen.measured_s:.4g} s per step ({others or 'no other'}); "
                             "plan/verify.md has each candidate",
                      "candidates": [c.__dict__ for c in candidates]}
    write_atomic(plan_dir / "plan.json", json.dumps(plan, indent=1) + "\n")
    return chosen


def write_command(command: Sequence[str], run_settings: Path, run_dir: Path, cpu_ranks: bool) -> str:
    """cmd.txt (the run dir's, and plan/'s when this launch planned): the launch that trains the plan (the
    launcher's own hostfile argument, if any, in it)."""
    line = [f"{SETTINGS_ENV}={run_settings}", "mist-deepspeed", *command]
    text = command_file(line, cpu_ranks)
    write_atomic(run_dir / "cmd.txt", text)
    if (run_dir / PLAN_DIR / "plan.json").is_file():
        write_atomic(run_dir / PLAN_DIR / "cmd.txt", text)
    return shlex.join(line)


class ScriptLaunchError(ValueError):
    """A launch of the user's script that cannot go on (exit 2: the script, not mist_ds, must change)."""


def script_of(command: Sequence[str]) -> str:
    """The user's script in a launch command, as DeepSpeed's launcher parses it (its user_script): the command ends
    with the script's own arguments (--deepspeed_config F, ...), so its last word names no script."""
    from deepspeed.launcher import runner

    try:
        return runner.parse_args(list(command)).user_script
    except SystemExit:  # not a command DeepSpeed parses (mist-deepspeed parsed it before: never in a launch)
        return "the script"


def run_user_script(mode: str, plan: Path | None, command: Sequence[str], overrides: Sequence[str], run_dir: Path,
                    cpu_ranks: bool) -> int:
    """The phases for a script that calls mist_ds.initialize (module docstring); the exit code: the plan phase's
    when it fails, 1 when every verified candidate failed, else 0 (`tune`) or the training launch's (`run`)."""
    base = ScriptSettings("plan", str(run_dir), tuple(overrides))
    plan_dir = run_dir / PLAN_DIR
    if plan is None:
        for stale in ("plan.json", "verify.md", "verify.csv"):  # a run dir used before: nothing of that run's
            (plan_dir / stale).unlink(missing_ok=True)
        shutil.rmtree(plan_dir / CANDIDATES_DIR, ignore_errors=True)
        plan_settings = settings_file(base, "plan")
        code, _ = launch_phase(command, plan_settings)
        if code != 0:  # refused or failed: the run dir keeps nothing of the plan phase (its plan folder is gone too)
            plan_settings.unlink(missing_ok=True)
            return code
        plan = plan_dir / "plan.json"
        if not plan.is_file():
            raise ScriptLaunchError(f"{script_of(command)} ended without calling mist_ds.initialize, so nothing was "
                                    "planned: call it in place of deepspeed.initialize, or name the model with "
                                    "--mist model=...")
        knobs = plan_dir / CANDIDATES_DIR / VERIFY_FILE
        if knobs.is_file() and json.loads(knobs.read_text())["top_n"] > 0:
            chosen = choose(verify(command, base), plan_dir)
            if chosen is None:
                print(f"mist-deepspeed: every verified candidate failed: {plan_dir / 'verify.md'}", file=sys.stderr)
                return 1
            print(f"mist-deepspeed: verified: candidate {chosen.index} measured fastest ({chosen.measured_s:.4g} s "
                  f"per step): {plan_dir / 'verify.md'}", file=sys.stderr)
    for candidate in sorted((plan_dir / CANDIDATES_DIR).glob("*/plan.json")):  # tuner.write_top_n, verify
        index = candidate.parent.name
        own = settings_file(ScriptSettings("run", str(run_dir), tuple(overrides), plan=str(candidate)),
                            f"run.candidate{index}")
        write_atomic(candidate.parent / "cmd.txt", command_file([f"{SETTINGS_ENV}={own}", "mist-deepspeed", *command],
                                                                cpu_ranks))
    run_settings = settings_file(ScriptSettings("run", str(run_dir), tuple(overrides), plan=str(plan)), "run")
    line = write_command(command, run_settings, run_dir, cpu_ranks)
    print(f"mist-deepspeed: {line}", file=sys.stderr)
    if mode == "tune":
        return 0
    return launch_phase(command, run_settings)[0]
