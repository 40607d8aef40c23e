"""Price many strategies at once, bit for bit what `predict_strategy` gives each (docs/design.md, Batch
what-if).

Shared per setting: the symbolic analysis (ModelCosts) per (model, precision), the hardware model per
(cluster, precision). Stacked: the strategies sharing a model, a cluster, an executor and a training
setup have their stages priced in one `stage_times` / `stage_memory` call, every (strategy, stage)
one candidate of a flat array; each strategy then reads its own stages back and finishes as
`predict_strategy` does (`prediction_of`: the event simulation, throughput, fit). Stage pricing is
elementwise over candidates, so a stage priced in a stack is priced as it is alone; the one test of
that is tests/test_predict_many.py (every row against `predict`) and benchmarks/predict_many.py.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

from mist_ds.cost.predict import (Prediction, checked_caps, model_costs, prediction_of, predict_strategy,
                                  stage_candidates, stage_work)
from mist_ds.cost.candidates import StageCandidates
from mist_ds.cost.stage import stage_times
from mist_ds.cost.stage_memory import stage_memory
from mist_ds.hardware import hardware_model
from mist_ds.specs import ExecutorCapabilities, Specs
from mist_ds.specs.errors import noting_case
from mist_ds.specs.pipeline_order import V_SCHEDULES


def _stacked(candidates: Sequence[StageCandidates]) -> StageCandidates:
    """One flat StageCandidates of every strategy's stages, in order."""
    return StageCandidates(*(np.concatenate([getattr(c, f.name) for c in candidates])
                             for f in dataclasses.fields(StageCandidates)))


def _rows(priced, start: int, stop: int):
    """The stages [start, stop) of stacked StageTimes, StageMemory or StageWork."""
    return type(priced)(*(getattr(priced, f.name)[start:stop] for f in dataclasses.fields(priced)))


def _stack_key(specs: Specs, caps: ExecutorCapabilities) -> tuple:
    """What stacked strategies must share. Stage pricing reads the training setup's precision,
    optimizer and clipping, never its global batch (each candidate's G carries that); interleaved and
    plain schedules take different branches of the pricing, so they are never stacked together, and a V schedule's
    strategies are priced one by one (predict_strategy). A
    cluster (its GPU's peaks are a dict) and capabilities are keyed by their repr, which holds every field."""
    train = dataclasses.replace(specs.train, global_batch_size=1)
    return (specs.model, repr(specs.cluster), train, repr(caps), specs.strategy.virtual_stages > 1,
            specs.strategy.schedule in V_SCHEDULES)


def predict_specs_many(many: Sequence[Specs], caps: ExecutorCapabilities | None = None,
                       cache_dir: Path | None = None) -> list[Prediction]:
    """Predictions of every specs' strategy, in order; equal to [predict(s, cache_dir, caps) for s in
    many] bit for bit. Raises the ConfigError of the first strategy its executor refuses."""
    costs, hardware, groups = {}, {}, defaultdict(list)
    checked = []
    for i, specs in enumerate(many):
        row_caps = noting_case(i, checked_caps, specs, caps)
        checked.append(row_caps)
        groups[_stack_key(specs, row_caps)].append(i)
        precision = specs.train.precision
        if (specs.model, precision) not in costs:
            costs[specs.model, precision] = model_costs(specs, cache_dir)
        if (repr(specs.cluster), precision) not in hardware:
            hardware[repr(specs.cluster), precision] = hardware_model(specs.cluster, precision)
    out: list[Prediction | None] = [None] * len(many)
    for rows in groups.values():
        first = many[rows[0]]
        row_costs = costs[first.model, first.train.precision]
        hw = hardware[repr(first.cluster), first.train.precision]
        row_caps = checked[rows[0]]
        if first.strategy.schedule in V_SCHEDULES:
            # a V's stages are its chunks, folded into ranks after pricing (cost/executors/dual_pipe_v.py): alone
            for i in rows:
                out[i] = predict_strategy(many[i], row_costs, hw, row_caps)
            continue
        candidates = [stage_candidates(many[i].strategy, many[i].model.seq_len) for i in rows]
        stacked = _stacked(candidates)
        times = stage_times(row_costs, hw, row_caps, first.train, stacked)
        memory = stage_memory(row_costs, hw, row_caps, first.train, stacked)
        work = stage_work(row_costs, stacked)
        start = 0
        for i, c in zip(rows, candidates):
            stop = start + c.stage.size
            out[i] = prediction_of(many[i], row_costs, hw, row_caps, c, _rows(times, start, stop),
                                   _rows(memory, start, stop), _rows(work, start, stop))
            start = stop
    return out  # type: ignore[return-value]


__all__ = ["predict_specs_many"]
