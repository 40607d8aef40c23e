"""Observing a planned engine (mist_ds.runtime.PlannedEngine) from outside: the model-state census at the
moments of a step (mist_ds/observe/moments.py), the step census (mist_ds/observe/counting.py) and what the
engine ran (mist_ds/observe/report.py), each a function taking the engine.

    planned = mist_ds.runtime.initialize(config, model)
    watch_model_states(planned)                    # later observed steps count model states
    loss = planned.train_batch(batches)            # an observed step (observed=False: not counted)
    loss, census = count_step(planned, batches)    # one step under the step census: never time it
    what_ran(planned)                              # facts read from the live engine

What these observe of one engine lives in its `EngineObservation`, which the engine runs each step inside
(PlannedEngine.observer): the runtime imports nothing from here.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from mist_ds.observe.counting import StepCounter, group_names
from mist_ds.observe.moments import MomentRecorder


@dataclass
class EngineObservation:
    """What mist_ds.observe watches in one PlannedEngine (its `observer`)."""

    planned: Any
    """The PlannedEngine observed."""
    recorder: MomentRecorder | None = None
    """The model-state census at the step's moments, once `watch_model_states` installed it."""
    collectives: dict[str, Any] | None = None
    """The collectives of the last observed step (a model-state-counted step or the step census), by
    "kind/group": calls, and calls issued during a backward (mist_ds/observe/counting.py)."""

    @property
    def counts_model_states(self) -> bool:
        return self.recorder is not None

    @contextlib.contextmanager
    def step(self, observed: bool):
        """Around one step: with model states watched, `observed` says whether this step is counted; a
        counted step has its collectives watched too (without FLOPs: the cheaper observer)."""
        if self.recorder is None:
            yield
            return
        self.recorder.measuring = observed
        if not observed:
            yield
            return
        with step_counter(self.planned, count_flops=False) as counter:
            yield
        self.collectives = counter.counts.to_dict()


def observation(planned) -> EngineObservation:
    """The engine's EngineObservation, made (and set as its observer) on first use."""
    if planned.observer is None:
        planned.observer = EngineObservation(planned)
    return planned.observer


def step_counter(planned, count_flops: bool = True) -> StepCounter:
    """A StepCounter naming the groups of the engine's plan as the cost model's accounting does."""
    par = planned.plan.strategy.parallelism
    return StepCounter(group_names(par, int(planned.engine.global_rank), bool(planned.tied_ranks)), count_flops)


def watch_model_states(planned) -> EngineObservation:
    """Count what the engine holds at the moments model states peak, in every later observed step
    (mist_ds/observe/moments.py); `what_ran` then reports the peaks. Hooks are installed once."""
    watched = observation(planned)
    if watched.recorder is None:
        watched.recorder = MomentRecorder(planned.engine, gc_check=False)
        watched.recorder.install(planned.grad_reducer)
    return watched


def count_step(planned, micro_batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, dict[str, Any]]:
    """One step under the step census (mist_ds/observe/counting.py): (loss, FLOPs and payload bytes by
    "kind/group"). Counting slows the step: never time a counted step."""
    watched = observation(planned)
    with step_counter(planned) as counter:
        loss = planned.train_batch(micro_batches, observed=False)
    watched.collectives = counter.counts.to_dict()
    return loss, watched.collectives
