"""How each executor executes a stage, one module per distinct behaviour, chosen by capability fields
(never by an executor's name; docs/design.md, The stage template):

- the data moves, by ExecutorCapabilities.collectives: `deepspeed` (DeepSpeed 0.19.8's stock engines) or
  `ideal` (the textbook collectives);
- the end-of-iteration policy, by ExecutorCapabilities.overlap: `first_forward_step` (optimizer_in_first_forward),
  `mist` (overlap_grad_reduce or gather_weights_in_first_forward), else `end_work`.

An executor whose data moves differ adds a module with `moves(StageInputs) -> StageMoves`, a CollectiveModel value
and its row in COLLECTIVE_EXECUTORS; one whose end of iteration differs adds a module with `end_of_iteration` and
the overlap feature that selects it.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Mapping

from mist_ds.cost.executors import deepspeed, end_work, first_forward_step, ideal, mist
from mist_ds.cost.executors.interface import (EndOfIteration, OptimizerStep, PassPhases, PassWork, StageInputs,
                                              StageMoves)
from mist_ds.specs.executors import CollectiveModel, OverlapFeatures


@dataclass(frozen=True)
class CollectiveExecutor:
    moves: Callable[[StageInputs], StageMoves]
    """Prices the stage's data moves per micro-batch and per step."""
    partitioned_sends: bool
    """With t > 1 each TP rank sends 1 / t of a pipeline activation (its re-assembly: StageMoves.fwd_tp, bwd_tp)."""


COLLECTIVE_EXECUTORS: Mapping[CollectiveModel, CollectiveExecutor] = MappingProxyType({
    "deepspeed": CollectiveExecutor(deepspeed.moves, partitioned_sends=True),
    "ideal": CollectiveExecutor(ideal.moves, partitioned_sends=False)})
"""ExecutorCapabilities.collectives -> how that executor moves a stage's data."""


EndOfIterationPolicy = Callable[[StageInputs, PassWork, PassPhases, StageMoves, OptimizerStep], EndOfIteration]


def end_of_iteration_policy(overlap: OverlapFeatures) -> EndOfIterationPolicy:
    """The end_of_iteration function placing the reduction and the step for these overlap features."""
    if overlap.optimizer_in_first_forward:
        return first_forward_step.end_of_iteration
    if overlap.overlap_grad_reduce or overlap.gather_weights_in_first_forward:
        return mist.end_of_iteration
    return end_work.end_of_iteration
