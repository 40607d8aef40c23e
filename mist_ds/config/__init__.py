"""Hydra config: schemas in the ConfigStore, values in `conf/` (the package `mist_ds.conf`).

`register_configs()` stores the schemas (and mist_ds's logging choices for Hydra); nothing is
registered on import, so tests can reset GlobalHydra cleanly. `compose(overrides)` is the Python entry
point: the same override strings as the CLI, returning validated, frozen `Specs`; Hydra composes each set of group
choices once per process, and the values of a list are applied to a copy as Hydra applies them (`compose_config`).
Inside a running Hydra app (the `mist-ds` commands) the config comes from Hydra: `specs_from_config(cfg)`.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable, Iterator, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

from mist_ds.config.convert import to_specs
from mist_ds.config.errors import as_config_error
from mist_ds.config.schema import (ClusterConfig, MistDsConfig, ModelConfig, StrategyConfig, TrainConfig,
                                   TunerConfig)
from mist_ds.specs import ConfigError, Specs, check_executor
from mist_ds.specs.errors import require
from mist_ds.specs.machine import read_constants

CONFIG_MODULE = "mist_ds.conf"
PRIMARY_CONFIG = "config"
MODULE_OPTION = "model=module"
"""The model option of a module handed to Python (conf/model/module.yaml)."""
LOGGING_OPTION = "mist_ds"
"""The option of `hydra/job_logging` and `hydra/hydra_logging` that conf/config.yaml selects."""
PROVIDER = "mist_ds"
"""The provider of what register_configs stores in Hydra's ConfigStore."""


def _stderr_logging(line_format: str, logger: str) -> dict[str, Any]:
    """Hydra's default logging (hydra/conf/hydra/*_logging/default.yaml) with the console on stderr and
    no log file: stdout carries the command's result (`json=true` must stay parseable) and the
    commands that write nothing must not leave a log file behind. INFO from `logger` only; other
    libraries' INFO chatter (mip's banner) stays out, their warnings do not."""
    return {"version": 1, "formatters": {"simple": {"format": line_format}},
            "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "simple",
                                     "stream": "ext://sys.stderr"}},
            "root": {"level": "WARNING", "handlers": ["console"]}, "loggers": {logger: {"level": "INFO"}},
            "disable_existing_loggers": False}


def register_configs() -> None:
    """Store the schemas the YAML files extend (`base_model`, `base_cluster`, ...) and the logging
    options conf/config.yaml selects. Idempotent: what is stored already (by mist_ds, the provider) is kept, since
    storing converts each dataclass again (a fifth of a compose, which calls this twice: here and in the
    search-path plugin)."""
    store = ConfigStore.instance()
    entries = [(None, "mist_ds_schema", MistDsConfig)]
    entries += [(group, f"base_{group}", node) for group, node in (
        ("model", ModelConfig), ("cluster", ClusterConfig), ("train", TrainConfig), ("strategy", StrategyConfig),
        ("tuner", TunerConfig))]
    entries += [("hydra/job_logging", LOGGING_OPTION,
                 _stderr_logging("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s", "mist_ds")),
                ("hydra/hydra_logging", LOGGING_OPTION, _stderr_logging("[%(asctime)s][HYDRA] %(message)s", "hydra"))]
    for group, name, node in entries:
        if not _stored(store, group, name):
            store.store(group=group, name=name, node=node, provider=PROVIDER)


def _stored(store: ConfigStore, group: str | None, name: str) -> bool:
    """Whether mist_ds stored `name` in `group` already."""
    folder = store.repo
    for part in group.split("/") if group else ():
        folder = folder.get(part)
        if not isinstance(folder, dict):
            return False
    entry = folder.get(f"{name}.yaml")
    return entry is not None and entry.provider == PROVIDER


@contextlib.contextmanager
def _hydra_context() -> Iterator[None]:
    """Initialize Hydra on mist_ds's configs, restoring any GlobalHydra a host app had set up."""
    from hydra import initialize_config_module

    global_hydra = GlobalHydra.instance()
    saved = global_hydra.hydra if global_hydra.is_initialized() else None
    global_hydra.clear()
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            yield
    finally:
        global_hydra.clear()
        if saved is not None:
            global_hydra.initialize(saved)


def _translated(compose_fn: Callable[[], DictConfig], config_dirs: Sequence[str] = ()) -> DictConfig:
    """compose_fn(), with Hydra / OmegaConf errors translated (a bad file looked up in `config_dirs`):
    never a traceback for a typo."""
    try:
        return compose_fn()
    except Exception as error:
        raise as_config_error(error, config_dirs) from error


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed DictConfig for `overrides` (Hydra override grammar); ConfigError on bad input. The caller's own
    copy: Hydra composes each distinct set of group choices once per process (`_composed_once`) and the values are
    applied to a copy of it, as Hydra applies them (`_choices_and_values`), unless the list reads the user's files."""
    overrides = tuple(overrides)
    if reads_files_of_the_user(overrides):
        return _composed(overrides)
    split = _choices_and_values(overrides)
    if split is None:
        return copy.deepcopy(_composed_once(overrides))
    choices, values = split
    config = copy.deepcopy(_composed_once(choices))
    try:
        _apply_values(values, config)
    except Exception:  # noqa: BLE001 - Hydra composes the whole list, raising its own error for it
        return copy.deepcopy(_composed_once(overrides))
    return config


def reads_files_of_the_user(overrides: Sequence[str]) -> bool:
    """Whether composing `overrides` may read more than mist_ds's own config files: a `hydra.*` override
    (hydra.searchpath adds the user's directories, whose files may change, relative to the working directory)."""
    return any(line.lstrip("+~").startswith("hydra.") for line in overrides)


CONFIG_GROUPS = ("model", "cluster", "strategy", "train", "tuner")
"""The config groups of mist_ds/conf (its folders)."""


def _choices_and_values(overrides: tuple[str, ...]) -> tuple[tuple[str, ...], list] | None:
    """(the `group=option` lines, the parsed overrides of keys inside a group, each kept in order), for a list that
    has only those; None for any other list (or one Hydra cannot parse). Hydra 1.3 composes a list in two steps
    (hydra/_internal/config_loader_impl.py, _load_configuration_impl): the group choices select and merge the config
    files, then it applies each override of a key that is no group to the merged config in struct mode, in order
    (`_apply_overrides_to_config`); a key inside a group, `model.hidden_size`, is no group (no group's name has a
    dot). So the list's config is the choices' config with the values applied."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - composed whole: Hydra names the error
        return None
    choices, values = [], []
    for line, override in zip(overrides, parsed):
        key = override.key_or_group
        if override.package is not None or override.is_sweep_override():
            return None
        if key in CONFIG_GROUPS and override.type == OverrideType.CHANGE and isinstance(override.value(), str):
            choices.append(line)
        elif key.split(".", 1)[0] in CONFIG_GROUPS and "." in key:
            values.append(override)
        else:
            return None
    return tuple(choices), values


def _apply_values(values: list, config: DictConfig) -> None:
    """Hydra's own application of the overrides of keys inside groups (the second step of a compose), in order."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    ConfigLoaderImpl._apply_overrides_to_config(values, config)


def _composed(overrides: tuple[str, ...]) -> DictConfig:
    from hydra import compose as hydra_compose

    register_configs()

    def composed() -> DictConfig:
        with _hydra_context():
            return hydra_compose(config_name=PRIMARY_CONFIG, overrides=list(overrides))

    return _translated(composed)


COMPOSED_LISTS_KEPT = 128
"""Distinct override lists whose composed configs a process keeps: a compose is about 0.1 s of Hydra, a copy of its
result about 5 ms; each kept config about 175 kB (22 MB when all are kept)."""

_composed_once = functools.lru_cache(maxsize=COMPOSED_LISTS_KEPT)(_composed)
"""_composed, remembered per override list: a pure function of the list while the process runs, since it reads only
mist_ds's config files (package data) and the schemas register_configs stores (the same each time). A list Hydra
refuses raises each time (functools caches no exception). Never hand out what it returns: compose_config copies."""


def recompose_in_app(overrides: Sequence[str]) -> DictConfig:
    """Compose again inside a running Hydra app (a `mist-ds` command's job) with other overrides.

    Hydra's compose API on the app's own GlobalHydra: the same search path (a user's -cd / -cp
    directories) and the same primary config (-cn) as the job's config; ConfigError on bad input.
    """
    from hydra import compose as hydra_compose
    from hydra.core.hydra_config import HydraConfig

    hydra_config = HydraConfig.get()
    config_name = hydra_config.job.config_name
    file_prefix = "file://"
    config_dirs = [s.path[len(file_prefix):] for s in hydra_config.runtime.config_sources
                   if s.path.startswith(file_prefix)]
    return _translated(lambda: hydra_compose(config_name=config_name, overrides=list(overrides)), config_dirs)


def job_overrides(exclude_keys: Sequence[str]) -> list[str]:
    """The running Hydra job's own overrides (hydra.overrides.task: a sweep job's values) whose top-level
    key is not in `exclude_keys` (an app's keys that do not describe the planned job)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = list(HydraConfig.get().overrides.task)
    parsed = OverridesParser.create().parse_overrides(lines)
    return [line for line, o in zip(lines, parsed) if o.key_or_group.split(".")[0] not in exclude_keys]


TUNER_LIMIT_OF = {"tp": "tuner.tp=[{v}]", "pp": "tuner.pp=[{v}]", "sp": "tuner.sp=[{v}]",
                  "micro_batch_size": "tuner.micro_batch_sizes=[{v}]", "runtime": "tuner.runtime={v}"}
"""The tuner's field that limits its search to a strategy field's value, where it has one (`{v}` the value)."""


def _tuner_limit(field: str, value: str) -> str | None:
    """The tuner setting that searches a strategy field's value (TUNER_LIMIT_OF; a schedule the tuner searches is
    added to 1f1b, which tuner.schedules always holds), None where the tuner has none."""
    from mist_ds.specs.tuner import SEARCHED_SCHEDULES

    if field == "schedule":
        return None if value not in SEARCHED_SCHEDULES else (
            "tuner.schedules=[1f1b]" if value == "1f1b" else f"tuner.schedules=[1f1b,{value}]")
    limit = TUNER_LIMIT_OF.get(field)
    return None if limit is None else limit.format(v=value)


def refuse_strategy_overrides(overrides: Sequence[str], command: str = "tune") -> None:
    """ConfigError for a `strategy` override (strategy.<field>=v or strategy=<option>) given to the tuner, which
    chooses the strategy itself and would ignore it: the tuner's limit for that field where there is one (tuner.tp
    for strategy.tp), else `mist-ds predict` for pricing the strategy as given."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key != "strategy" and not key.startswith("strategy."):
            continue
        field = key.removeprefix("strategy.").split(".")[0]
        limit = _tuner_limit(field, value)
        fix = (f"limit the search with {limit} instead" if limit else "the tuner does not search this schedule"
               if field == "schedule" else "the tuner chooses it for each stage")
        raise ConfigError(key, int(value) if value.isdigit() else value,
                          f"{command} chooses the strategy and would ignore this: {fix}; or price this strategy as "
                          "given with mist-ds predict")


CLUSTER_CONSTANTS = ("file", "machine")
"""cluster.constants: the cluster file's figures, or those measured on this machine."""


def with_machine_constants(cfg: DictConfig) -> DictConfig:
    """`cfg` with the figures measured on this machine in the cluster's place where `cluster.constants=machine`
    (mist_ds/specs/machine.py; docs/design.md, Profiling); else `cfg` itself."""
    constants = OmegaConf.select(cfg, "cluster.constants", default="file")
    require(constants in CLUSTER_CONSTANTS, "cluster.constants", constants, f"one of {list(CLUSTER_CONSTANTS)}")
    if constants == "file":
        return cfg
    precision, gpus = cfg.train.precision, cfg.cluster.gpus_per_node
    measured = read_constants(cfg.cluster.gpu.name, gpus, precision)
    require(measured is not None, "cluster.constants", constants,
            f"nothing measured on this machine for {gpus} ranks in {precision} yet: any mist-ds command measures "
            f"it the first time, or run `mist-ds profile cluster={cfg.cluster.name} train.precision={precision} "
            "profile.quick=true ...`; cluster.constants=file prices with the file's figures")
    merged = cfg.copy()
    with open_dict(merged):  # the measured interference sets are keys the file's factors may lack
        merged.cluster.merge_with({key: value for key, value in measured.items() if key != "gpu"})
        merged.cluster.gpu.merge_with(measured.get("gpu", {}))
        merged.cluster.gpu.per_precision = {}  # measured for this precision: the file's per-precision ones are moot
    return merged


def specs_from_config(cfg: DictConfig, with_strategy: bool = True, module=None, loss=None) -> Specs:
    """Validate a composed config into frozen SI specs (ConfigError names the first bad field).

    with_strategy=False skips the `strategy` group (the tuner chooses the strategy itself). `module`, `loss`: your
    own nn.Module and loss function, from Python (model=module; docs/design.md, Your own model).
    """
    cfg = with_machine_constants(cfg)
    try:
        schema: MistDsConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except Exception as error:
        raise as_config_error(error) from error
    specs = to_specs(schema, with_strategy=with_strategy, module=module, loss=loss)
    if specs.strategy is not None:
        check_executor(specs.strategy, model=specs.model)
    return specs


def compose(overrides: Sequence[str] = (), with_strategy: bool = True, module=None, loss=None) -> Specs:
    """Compose mist_ds's config with `overrides` (e.g. ["model=llama2-7b", "cluster.nodes=2"]). Given `module` (your
    own nn.Module; `loss` its loss function, optional), the model is that module: `model=module` is selected."""
    refuse_command_keys(overrides)
    if module is not None:
        overrides = [MODULE_OPTION, *(o for o in overrides if o != MODULE_OPTION)]
    return specs_from_config(compose_config(overrides), with_strategy=with_strategy, module=module, loss=loss)


COMMAND_KEYS = {"plan": "in Python, price a plan with mist_ds.predict(mist_ds.plan.load_plan(P).overrides())",
                "json": "Python returns the result itself: drop json=", "cases": "in Python, give the cases as "
                "lists to mist_ds.predict_many"}
"""The command line's own top-level keys (mist-ds reads them, compose does not), and what to do in Python."""


def refuse_command_keys(overrides: Sequence[str]) -> None:
    """ConfigError for an override of a key only the `mist-ds` command line reads (plan=, json=, cases=): composed
    here it would be dropped without a word."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key in COMMAND_KEYS:
            raise ConfigError(key, value, f"the mist-ds command line's; {COMMAND_KEYS[key]}")


__all__ = ["ConfigError", "compose", "job_overrides", "compose_config", "recompose_in_app",
           "refuse_command_keys", "refuse_strategy_overrides", "register_configs", "specs_from_config"]
