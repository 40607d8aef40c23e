"""Validated, frozen, SI-unit descriptions of the model, cluster, training and strategy.

Nothing downstream of `mist_ds.config` sees a DictConfig: it sees these. The specs import nothing
else of mist_ds: they are the vocabulary every layer shares (docs/design.md, Architecture).
"""
from __future__ import annotations

from dataclasses import dataclass

from mist_ds.specs.cluster import ClusterSpec, GpuSpec, InterferenceSpec
from mist_ds.specs.errors import ConfigError
from mist_ds.specs.model import ModelSpec
from mist_ds.specs.executors import EXECUTORS, ExecutorCapabilities, OverlapFeatures, executor_capabilities
from mist_ds.specs.executor_rules import (check_executor, check_schedule_built, grad_reduce_overlapped,
                                         weight_gather_overlapped)
from mist_ds.specs.strategy import Parallelism, StageStrategy, StrategySpec
from mist_ds.specs.train import TrainSpec
from mist_ds.specs.tuner import TunerSpec


@dataclass(frozen=True)
class Specs:
    """Everything a planning command reads: the three inputs (model, cluster, train), the strategy
    the user named (may be the default: pure data parallel), and the tuner's settings."""

    model: ModelSpec
    cluster: ClusterSpec
    train: TrainSpec
    strategy: StrategySpec | None
    """None when the command chooses the strategy itself (tune)."""
    tuner: TunerSpec


__all__ = [
    "ClusterSpec", "ConfigError", "GpuSpec", "InterferenceSpec", "ModelSpec", "OverlapFeatures", "Parallelism",
    "EXECUTORS", "ExecutorCapabilities", "Specs", "StageStrategy", "StrategySpec", "TrainSpec", "TunerSpec",
    "check_executor", "check_schedule_built", "grad_reduce_overlapped", "executor_capabilities",
    "weight_gather_overlapped",
]
