"""Plan: a tuned strategy with its predictions, as `plan.json` (a public interface).

A plain data module: it imports only the specs, so a training job can read a plan without loading the
cost model, the tuner, sympy, numba or mip (tests/test_layering.py). A plan.json from elsewhere is
input: `plan_from_dict` validates it as data and names the bad key.

    mist-ds predict plan=outputs/.../plan.json       # the same numbers as the plan's
    mist_ds.plan.load_plan(path).overrides()          # model / cluster / train + strategy.* overrides
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from mist_ds.specs import ConfigError, ModelSpec, StrategySpec
from mist_ds.specs.strategy import strategy_from_dict, strategy_overrides

PLAN_VERSION = 2
"""Version 2: `strategy` is StrategySpec.to_dict() (version 1 held override strings)."""
PLAN_FIELD = "plan"
"""The config key (and error field) naming a plan file."""


@dataclass(frozen=True)
class Plan:
    """What `tune` decided and predicted. Seconds, bytes."""

    user_overrides: list[str]
    """The Hydra overrides the plan was tuned for (model, cluster, train, tuner)."""
    strategy: StrategySpec
    prediction: dict[str, Any]
    """`mist-ds predict --json` of the strategy."""
    search: dict[str, Any]
    baselines: list[dict[str, Any]] = field(default_factory=list)
    runner_ups: list[dict[str, Any]] = field(default_factory=list)
    """The best plans of the next-best global points, fastest first (tuner/runner_ups.py): rank,
    iteration_time_s, objective_s, slower_by, differs (strategy key -> [plan's, runner-up's]), strategy."""
    model_source: dict[str, Any] = field(default_factory=dict)
    """Which model the plan is for (model_source_of): a plan is refused for another (check_model_source)."""
    version: int = PLAN_VERSION

    def overrides(self, extra: Sequence[str] = ()) -> list[str]:
        """User overrides, then the strategy, then `extra` (later ones win)."""
        return [*self.user_overrides, *strategy_overrides(self.strategy), *extra]

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "user_overrides": list(self.user_overrides),
                "strategy": self.strategy.to_dict(), "prediction": self.prediction, "search": self.search,
                "baselines": self.baselines, "runner_ups": self.runner_ups, "model_source": self.model_source}

    @property
    def iteration_time_s(self) -> float:
        return float(self.prediction["iteration_time_s"])


def _required(data: dict, key: str, kind: type, source: str):
    if key not in data:
        raise ConfigError(PLAN_FIELD, source, f"the plan file lacks `{key}`; re-run `mist-ds tune`")
    value = data[key]
    if not isinstance(value, kind):
        raise ConfigError(f"{PLAN_FIELD}.{key}", type(value).__name__,
                          f"must be a {kind.__name__} in a plan file ({source}); re-run `mist-ds tune`")
    return value


def _check_runner_ups(runner_ups: Any) -> None:
    """Each runner-up a dict with its time and a valid strategy (ConfigError naming the entry)."""
    if not isinstance(runner_ups, list):
        raise ConfigError(f"{PLAN_FIELD}.runner_ups", type(runner_ups).__name__, "must be a list")
    for i, entry in enumerate(runner_ups):
        where = f"{PLAN_FIELD}.runner_ups[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("strategy"), dict):
            raise ConfigError(where, type(entry).__name__, "must be an object with a `strategy`; re-run `mist-ds tune`")
        time_s = entry.get("iteration_time_s")
        if isinstance(time_s, bool) or not isinstance(time_s, (int, float)) or not time_s > 0:
            raise ConfigError(f"{where}.iteration_time_s", time_s, "must be a positive number of seconds")
        strategy_from_dict(entry["strategy"], f"{where}.strategy")


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    """A Plan from parsed plan.json data, every key checked (ConfigError naming it)."""
    if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(PLAN_FIELD, source, f"not a mist_ds plan of version {PLAN_VERSION} (found {found!r}); "
                                              "re-run `mist-ds tune`")
    overrides = _required(data, "user_overrides", list, source)
    if not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"{PLAN_FIELD}.user_overrides", overrides, "must be a list of Hydra override strings")
    baselines = data.get("baselines", [])
    if not isinstance(baselines, list):
        raise ConfigError(f"{PLAN_FIELD}.baselines", type(baselines).__name__, "must be a list")
    runner_ups = data.get("runner_ups", [])
    _check_runner_ups(runner_ups)
    model_source = data.get("model_source", {})
    if not isinstance(model_source, dict):
        raise ConfigError(f"{PLAN_FIELD}.model_source", type(model_source).__name__, "must be an object")
    return Plan(user_overrides=list(overrides),
                strategy=strategy_from_dict(_required(data, "strategy", dict, source), f"{PLAN_FIELD}.strategy"),
                prediction=dict(_required(data, "prediction", dict, source)),
                search=dict(_required(data, "search", dict, source)), baselines=list(baselines),
                runner_ups=list(runner_ups), model_source=dict(model_source))


def model_source_of(model: ModelSpec) -> dict[str, Any]:
    """What identifies a model: the zoo's name and family, a Hugging Face model's path, architecture and the hash of
    its config as read and overridden (and what model.frozen freezes), or a user's module's class, the function that
    built it and its hash (requires_grad is part of its structure)."""
    if model.module is not None:
        return {"kind": "module", "class": model.module.class_name, "target": model.module.target,
                "module_sha256": model.module.module_sha256}
    if model.hf is None:
        return {"kind": "zoo", "name": model.name, "family": model.family, "shape_sha256": _shape_sha256(model)}
    frozen = {"frozen": list(model.hf.frozen)} if model.hf.frozen else {}
    return {"kind": "hf", "name_or_path": model.hf.name_or_path, "architecture": model.hf.architecture,
            "config_sha256": model.hf.config_sha256, **frozen}


SHAPE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_size", "seq_len",
                "tie_embeddings", "flash_attention", "dropout")
"""A zoo or YAML model's fields that price it (its name and family are recorded beside them)."""
RECORDED_LATER = ("shape_sha256",)
"""model_source keys newer than some plan files: a plan without one is not refused for lacking it."""


def _shape_sha256(model: ModelSpec) -> str:
    """The hash of a zoo or YAML model's priced fields: a model file edited since a plan was tuned is told apart."""
    import hashlib

    fields = {name: getattr(model, name) for name in SHAPE_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def check_model_source(plan: Plan, model: ModelSpec, source: str) -> None:
    """A plan composed again must describe the model it was tuned for: a Hugging Face config or a YAML model file
    changed on disk since (or another model) is refused, naming both (a plan without a record, from before it
    existed, is taken as is)."""
    planned = plan.model_source
    now = {k: v for k, v in model_source_of(model).items() if k in planned or k not in RECORDED_LATER}
    if not planned or planned == now:
        return
    same_hf = planned.get("kind") == now["kind"] == "hf" and planned.get("name_or_path") == now["name_or_path"]
    if same_hf and planned.get("frozen", []) != now.get("frozen", []):
        fix = (f"the plan was tuned with model.frozen={planned.get('frozen', [])} and this job freezes "
               f"{now.get('frozen', [])}: give the plan's model.frozen, or re-run `mist-ds tune` for this one")
    elif same_hf:
        fix = (f"the config at {now['name_or_path']} changed since the plan was tuned (sha256 "
               f"{planned.get('config_sha256', '?')[:12]} then, {now['config_sha256'][:12]} now): "
               "re-run `mist-ds tune`")
    elif planned.get("kind") == now["kind"] == "module" and planned.get("class") == now["class"]:
        fix = (f"{now['class']} changed since the plan was tuned (its structure, attributes, code or loss; "
               f"model.kwargs change them: sha256 "
               f"{planned.get('module_sha256', '?')[:12]} then, {now['module_sha256'][:12]} now): "
               "re-run `mist-ds tune`")
    elif planned.get("kind") == now["kind"] == "zoo" and planned.get("name") == now["name"]:
        fix = (f"model {now['name']}'s config changed since the plan was tuned (its priced fields: sha256 "
               f"{planned.get('shape_sha256', '?')[:12]} then, {now['shape_sha256'][:12]} now; a YAML file of "
               "your -cd DIR edited?): re-run `mist-ds tune`")
    else:
        fix = f"it is a plan for {planned}, and the model here is {now}: tune a plan for this model"
    raise ConfigError(PLAN_FIELD, source, fix, rule="plan.model-source")


def model_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides among `overrides` that choose or change the model (`model=...`, `model.*=...`)."""
    return [o for o in overrides if o.lstrip("+~").partition("=")[0].split(".")[0] == "model"]


@contextlib.contextmanager
def naming_the_plans_model(plan: Plan, source: str, extra: Sequence[str]) -> Iterator[None]:
    """Run the block that composes `plan` with `extra` (a job's own overrides after the plan's); a ConfigError
    it raises while `extra` changes the plan's model (e.g. layers that no longer add up) also says which
    model the plan is for and how to run it."""
    try:
        yield
    except ConfigError as error:
        theirs, ours = model_overrides(plan.user_overrides), model_overrides(extra)
        if not ours or set(ours) <= set(theirs):
            raise
        planned = " ".join(theirs) or "the default model"
        raise ConfigError(error.field, error.value, f"{error.fix}; {source} is a plan for {planned}, run here with "
                                                    f"{' '.join(ours)}: drop it, or tune a plan for that model",
                          error.rule) from error


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError(PLAN_FIELD, str(path),
                          "no such file; give the plan.json that `mist-ds tune` wrote") from error
    except IsADirectoryError as error:
        raise ConfigError(PLAN_FIELD, str(path), "is a folder; give the plan.json inside it") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(PLAN_FIELD, str(path),
                          f"not valid JSON ({error}); give a plan.json from `mist-ds tune`") from error
    return plan_from_dict(data, str(path))


__all__ = ["PLAN_VERSION", "Plan", "check_model_source", "load_plan", "model_overrides", "model_source_of",
           "naming_the_plans_model", "plan_from_dict"]
