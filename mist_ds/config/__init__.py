"""Hydra config: schemas in the ConfigStore, values in `conf/` (the package `mist_ds.conf`).

`register_configs()` stores the schemas; nothing is registered on import, so tests can reset
GlobalHydra cleanly. `compose(overrides)` is the Python entry point: the same override strings as
the CLI, returning validated, frozen `Specs`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from mist_ds.config.convert import to_specs
from mist_ds.config.errors import as_config_error
from mist_ds.config.schema import (ClusterConfig, MistDsConfig, ModelConfig, StrategyConfig, TrainConfig,
                                   TunerConfig)
from mist_ds.specs import ConfigError, Specs, check_runtime

CONFIG_MODULE = "mist_ds.conf"
PRIMARY_CONFIG = "config"


def register_configs() -> None:
    """Store the schemas the YAML files extend (`base_model`, `base_cluster`, ...). Idempotent."""
    store = ConfigStore.instance()
    store.store(name="mist_ds_schema", node=MistDsConfig)
    for group, node in (("model", ModelConfig), ("cluster", ClusterConfig), ("train", TrainConfig),
                        ("strategy", StrategyConfig), ("tuner", TunerConfig)):
        store.store(group=group, name=f"base_{group}", node=node)


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


def compose_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed DictConfig for `overrides` (Hydra override grammar); ConfigError on bad input."""
    from hydra import compose as hydra_compose

    register_configs()
    try:
        with _hydra_context():
            return hydra_compose(config_name=PRIMARY_CONFIG, overrides=list(overrides))
    except Exception as error:  # Hydra / OmegaConf errors: translated, never a traceback for a typo
        raise as_config_error(error) from error


def specs_from_config(cfg: DictConfig, with_strategy: bool = True) -> Specs:
    """Validate a composed config into frozen SI specs (ConfigError names the first bad field).

    with_strategy=False skips the `strategy` group (the tuner chooses the strategy itself).
    """
    try:
        schema: MistDsConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except Exception as error:
        raise as_config_error(error) from error
    specs = to_specs(schema, with_strategy=with_strategy)
    if specs.strategy is not None:
        check_runtime(specs.strategy)
    return specs


def compose(overrides: Sequence[str] = (), with_strategy: bool = True) -> Specs:
    """Compose mist_ds's config with `overrides` (e.g. ["model=llama2-7b", "cluster.nodes=2"])."""
    return specs_from_config(compose_config(overrides), with_strategy=with_strategy)


__all__ = ["ConfigError", "compose", "compose_config", "register_configs", "specs_from_config"]
