"""Shared helpers of the accuracy benchmarks: reference rows, fast specs building, error metrics.

Rows are priced without Hydra per row: one `compose` per model shape, then specs are derived with
dataclasses.replace and `resolve_strategy` (the same validation the CLI runs).
"""
from __future__ import annotations

import csv
import dataclasses
from functools import lru_cache
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from mist_ds.config import compose
from mist_ds.cost.predict import Prediction, model_costs, predict_strategy
from mist_ds.hardware import hardware_model
from mist_ds.specs import RuntimeCapabilities, Specs
from mist_ds.specs.strategy import resolve_strategy

REFERENCE = Path(__file__).resolve().parent / "reference"


def reference_rows(name: str) -> list[dict[str, str]]:
    """Rows of benchmarks/reference/<name>.csv (copied from the project's shared reference data)."""
    with open(REFERENCE / f"{name}.csv") as handle:
        return list(csv.DictReader(line for line in handle if not line.startswith("#")))


@lru_cache(maxsize=None)
def base_specs(overrides: tuple[str, ...]) -> Specs:
    return compose(list(overrides), with_strategy=False)


def specs_for(overrides: tuple[str, ...], *, nodes: int, gpus_per_node: int, global_batch: int,
              cluster_changes: dict | None = None, gpu_changes: dict | None = None, **strategy) -> Specs:
    base = base_specs(overrides)
    gpu = dataclasses.replace(base.cluster.gpu, **(gpu_changes or {}))
    cluster = dataclasses.replace(base.cluster, nodes=nodes, gpus_per_node=gpus_per_node, gpu=gpu,
                                  **(cluster_changes or {}))
    train = dataclasses.replace(base.train, global_batch_size=global_batch)
    defaults = dict(runtime="megatron", dp=None, grad_accum=None, layers_per_stage=None, ckpt_layers="none",
                    zero_stage=0, offload={}, schedule="1f1b", allow_cross_node_tp=False)
    resolved = resolve_strategy(base.model, cluster, train, **{**defaults, **strategy})
    return dataclasses.replace(base, cluster=cluster, train=train, strategy=resolved)


_costs: dict = {}


def predict_specs(specs: Specs, caps: RuntimeCapabilities | None = None) -> Prediction:
    """predict of `specs`, on `caps` where given (an ablation), else on the runtime the strategy names."""
    key = (specs.model, specs.train.precision)
    if key not in _costs:
        _costs[key] = model_costs(specs)
    return predict_strategy(specs, _costs[key], hardware_model(specs.cluster, specs.train.precision), caps)


def mape(predicted, measured) -> float:
    predicted, measured = np.asarray(predicted), np.asarray(measured)
    return float(np.mean(np.abs(predicted - measured) / measured))


def spearman(predicted, measured) -> float:
    if len(predicted) < 2:
        return float("nan")
    return float(spearmanr(predicted, measured).statistic)


def top1_regret(predicted, measured) -> float:
    """How much slower the predicted-best configuration really was than the measured best."""
    predicted, measured = np.asarray(predicted), np.asarray(measured)
    return float(measured[np.argmin(predicted)] / measured.min() - 1.0)
