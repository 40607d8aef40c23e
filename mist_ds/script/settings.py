"""What `mist-deepspeed --autotune-mist` tells the ranks of a user's script: a small JSON file whose path is in
the environment (`MIST_DS_SETTINGS`), never in the script's argv (the script's arguments are the user's).

    MIST_DS_SETTINGS=<run dir>/settings.run.json mist-deepspeed --num_gpus 2 my_train.py --my-args

Phases (`ScriptSettings.phase`), each one launch of the script, each read by `mist_ds.initialize`:
- `plan`: rank 0 plans the model the script hands `mist_ds.initialize` (with `overrides`, the launcher's `--mist`
  settings and resources), writes the plan files into `plan_dir`, and every rank exits (code 0, 2 bad input,
  3 no plan fits);
- `verify`: the plan in `plan` trains `num_warmup_steps + steps` optimizer steps, rank 0 writes what it measured to
  `report`, and every rank exits;
- `run`: the plan in `plan` trains; `mist_ds.initialize` returns DeepSpeed's engine.

Only json and dataclasses here: the launcher imports this before any rank exists.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from mist_ds.specs.errors import ConfigError

SETTINGS_ENV = "MIST_DS_SETTINGS"
"""Environment variable holding the settings file's path; its prefix is what the launcher exports to other nodes."""
ENV_PREFIX = "MIST_DS"
PHASES = ("plan", "verify", "run")
PLAN_DIR = "plan"
"""The run dir's folder of plan files (plan.json, ds_config.json, summary.md, ...)."""
CANDIDATES_DIR = "candidates"
"""plan/candidates/<i>/: the plan files of the best plans of distinct layouts, best first (verify, write_top_n)."""
VERIFY_FILE = "verify_settings.json"
"""plan/candidates/verify_settings.json: tuner.verify as the plan phase composed it (the launcher reads it)."""


@dataclass(frozen=True)
class ScriptSettings:
    """One launch's settings (module docstring). Paths absolute."""

    phase: str
    run_dir: str
    overrides: tuple[str, ...] = ()
    """The planner's Hydra overrides: the launcher's --mist settings, then cluster.nodes / gpus_per_node."""
    plan: str | None = None
    """plan.json to train (phases verify and run)."""
    num_warmup_steps: int = 0
    num_steps: int = 0
    """verify: optimizer steps timed after num_warmup_steps untimed ones."""
    report: str | None = None
    """verify: the JSON file rank 0 writes (measured seconds per step, peak bytes)."""

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ConfigError(f"{SETTINGS_ENV}.phase", self.phase, f"use one of {', '.join(PHASES)}")
        if self.phase != "plan" and not self.plan:
            raise ConfigError(f"{SETTINGS_ENV}.plan", self.plan, f"phase {self.phase} trains a plan: give plan.json")

    @property
    def plan_dir(self) -> Path:
        return Path(self.run_dir) / PLAN_DIR

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"


def settings_from_json(text: str, source: str) -> ScriptSettings:
    """ScriptSettings from a settings file's text (ConfigError naming the file)."""
    try:
        data = json.loads(text)
        data["overrides"] = tuple(data.get("overrides", ()))
        return ScriptSettings(**data)
    except (ValueError, TypeError, AttributeError) as error:
        raise ConfigError(SETTINGS_ENV, source, f"not a settings file mist-deepspeed wrote ({error}); start the "
                                                "script with mist-deepspeed --autotune-mist {tune,run}") from None


def settings_from_environment(environ: Mapping[str, str] | None = None) -> ScriptSettings | None:
    """The settings this process was started with; None when it was not started by mist-deepspeed."""
    path = (os.environ if environ is None else environ).get(SETTINGS_ENV)
    if not path:
        return None
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(SETTINGS_ENV, path, f"cannot read it ({error.strerror}); across nodes the run dir must be "
                                              "on a file system every node sees") from None
    return settings_from_json(text, path)
