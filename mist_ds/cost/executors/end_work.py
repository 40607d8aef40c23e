"""Reduction and step after the last backward (no overlap feature moves them: executors `deepspeed`,
`megatron`), as DeepSpeed runs ReduceTiedGrads, ReduceGrads and OptimizerStep after the pipeline drains
(docs/design.md, The stage template)."""
from __future__ import annotations

import numpy as np

from mist_ds.cost.executors.interface import (EndOfIteration, OptimizerStep, PassPhases, PassWork, StageInputs,
                                              StageMoves)


def end_of_iteration(inputs: StageInputs, work: PassWork, phases: PassPhases, moves: StageMoves,
                     step: OptimizerStep) -> EndOfIteration:
    """No first-forward or last-backward extra; the end is the reduction, the step and the tied all-reduce."""
    none = np.zeros_like(phases.stable)
    return EndOfIteration(first_fwd_extra=none, last_bwd_extra=none,
                          end=moves.step_reduce + step.total_s + step.tied_s, grad_reduce=moves.step_reduce)
