"""The rules a target's capability row implies (docs/design.md, Targets): `check_target` refuses a strategy its target
cannot run, `check_target_tuning` a tuner setting that asks the search for such strategies, each with the rule's name;
`recompute_allowed` is their vectorized twin for the tuner's grids (called by executor_rules.allowed_stage_options,
so a refused strategy is never priced). The rows themselves are data in targets.py.
"""
from __future__ import annotations

import numpy as np

from mist_ds.specs.errors import ConfigError
from mist_ds.specs.executors import ExecutorCapabilities
from mist_ds.specs.model import ModelSpec
from mist_ds.specs.strategy import StrategySpec
from mist_ds.specs.targets import TargetCapabilities
from mist_ds.specs.tuner import TunerSpec


def recompute_allowed(target: TargetCapabilities, layers, recompute) -> np.ndarray:
    """True where a stage of `layers` blocks recomputing `recompute` of them is something the target runs (arrays
    broadcast). Every n-th block (recompute_every_nth): c = ceil(l / n) for some whole n, and then n = ceil(l / c)
    is one (l / n <= c gives n >= ceil(l / c), so ceil(l / ceil(l / c)) is both <= c and >= ceil(l / n) = c)."""
    layers, recompute = np.broadcast_arrays(np.asarray(layers, dtype=np.float64),
                                            np.asarray(recompute, dtype=np.float64))
    if not target.recompute_every_nth:
        return np.ones(recompute.shape, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        reached = np.ceil(layers / np.ceil(layers / recompute)) == recompute
    return (recompute == 0) | ((recompute <= layers) & reached)


def every_n_layers(layers: int, recompute: int) -> int:
    """transformers' `every_n_layers` that recomputes `recompute` of a stage's `layers` blocks (recompute_allowed
    holds); 0 recomputes nothing."""
    return 0 if recompute == 0 else -(-layers // recompute)


def every_nth_counts(layers: int) -> list[int]:
    """The recompute counts every n-th block reaches in a stage of `layers` blocks (n = 1 .. l), and 0 (none)."""
    return sorted({0} | {-(-layers // n) for n in range(1, layers + 1)})


def executor_allowed(target: TargetCapabilities, caps: ExecutorCapabilities) -> bool:
    """The target runs plans of this executor: a target building its own engine, only an executor whose plans run
    on that engine as priced; any other target, every executor (the emitter refuses those priced only)."""
    return caps.runs_on_stock_engine or not target.stock_engine


def _refuse(target: TargetCapabilities, rule: str, field: str, value, fix: str) -> ConfigError:
    name = f"{target.name}.{rule}"
    return ConfigError(field, value, f"{fix} [rule {name}]", rule=name)


def _check_model(target: TargetCapabilities, model: ModelSpec | None) -> None:
    if model is not None and target.model_families is not None and model.family not in target.model_families:
        raise _refuse(target, "model", "model.family", model.family,
                      f"tuner.target={target.name} trains models of family {', '.join(target.model_families)} "
                      "(model=hf model.name_or_path=DIR), or use the default tuner.target")


def _check_executor(target: TargetCapabilities, caps: ExecutorCapabilities, field: str) -> None:
    if not executor_allowed(target, caps):
        raise _refuse(target, "executor", field, caps.name,
                      f"tuner.target={target.name} builds its own DeepSpeed engine with deepspeed.initialize: plan "
                      "for an executor whose plans run on it as priced (strategy.runtime=deepspeed, "
                      "tuner.runtime=deepspeed or leave tuner.runtime out)")


def check_target(strategy: StrategySpec, caps: ExecutorCapabilities, target: TargetCapabilities,
                 model: ModelSpec | None = None) -> None:
    """Raise ConfigError naming the rule when `strategy` (on executor `caps`, of `model`) is something `target`
    cannot run."""
    _check_model(target, model)
    _check_executor(target, caps, "strategy.runtime")
    if strategy.parallelism.pp > 1 and not target.pipeline:
        raise _refuse(target, "pipeline", "strategy.pp", strategy.parallelism.pp,
                      f"tuner.target={target.name} runs the model as one module on every rank: use strategy.pp=1")
    if strategy.parallelism.sp > 1 and not target.sequence_parallel:
        raise _refuse(target, "sp", "strategy.sp", strategy.parallelism.sp,
                      f"tuner.target={target.name} builds its engine from ds_config.json alone, without DeepSpeed "
                      "Ulysses' attention and data loader: use strategy.sp=1")
    for i, s in enumerate(strategy.stages):
        if not recompute_allowed(target, s.layers, s.ckpt_layers):
            raise _refuse(target, "recompute-every-nth", f"strategy.ckpt_layers[{i}]", s.ckpt_layers,
                          f"tuner.target={target.name} recomputes every n-th of the stage's {s.layers} blocks "
                          f"(activation_checkpointing_kwargs every_n_layers): use one of "
                          f"{every_nth_counts(s.layers)}")


def check_target_tuning(target: TargetCapabilities, tuner: TunerSpec, caps: ExecutorCapabilities,
                        model: ModelSpec) -> None:
    """Raise ConfigError naming the rule when the tuner's settings ask for plans `target` cannot run: another
    executor, only pipelines, another model family."""
    _check_model(target, model)
    _check_executor(target, caps, "tuner.runtime")
    if not target.sequence_parallel and tuner.sp is not None and 1 not in tuner.sp:
        raise _refuse(target, "sp", "tuner.sp", list(tuner.sp), f"tuner.target={target.name} builds its engine "
                      "without DeepSpeed Ulysses: use tuner.sp=[1] or leave tuner.sp out")
    if not target.pipeline and tuner.pp is not None and 1 not in tuner.pp:
        raise _refuse(target, "pipeline", "tuner.pp", list(tuner.pp),
                      f"tuner.target={target.name} runs the model as one module on every rank: use tuner.pp=[1] "
                      "or leave tuner.pp out")
