"""The step inside the next first forward (overlap.optimizer_in_first_forward: executor `mist-paper`): the
optimizer runs per layer during the first micro-batch's forward, the gradient reduction during the last
backward, each beside that pass's compute on its own channel; nothing is left for the end of the iteration
(docs/design.md, The stage template)."""
from __future__ import annotations

import numpy as np

from mist_ds.cost.executors.interface import (EndOfIteration, OptimizerStep, PassPhases, PassWork, StageInputs,
                                              StageMoves)
from mist_ds.cost.memory import FP32_BYTES


def end_of_iteration(inputs: StageInputs, work: PassWork, phases: PassPhases, moves: StageMoves,
                     step: OptimizerStep) -> EndOfIteration:
    """The gradient crosses the data-parallel group once and the updated weights once: ZeRO-0 all-reduces;
    ZeRO-1 reduce-scatters and all-gathers the updated shard; ZeRO-2 has reduce-scattered every micro-batch
    (bwd_g2g) and all-gathers; ZeRO-3 gathers every forward anyway (fwd_g2g). The first forward's extra is
    at least the CPU Adam of the offloaded share."""
    hw, c, data_parallel = inputs.hw, inputs.c, inputs.data_parallel
    trained, grad_bytes = inputs.trained, inputs.grad_bytes
    b_w, partition = hw.dtype_bytes, step.partition
    step_reduce = np.select([c.zero == 0, c.zero == 1],
                            [data_parallel.all_reduce_time_s(grad_bytes * trained),
                             data_parallel.reduce_scatter_time_s(grad_bytes * trained)], default=0.0)
    step_gather = np.where((c.zero == 1) | (c.zero == 2), data_parallel.all_gather_time_s(b_w * trained), 0.0)
    # the executor's host work is serial with each pass (stage.pass_phases)
    first_fwd = hw.overlapped_time_s(work.fwd_compute + step.gpu_s, moves.fwd_g2g + step_gather,
                                     moves.fwd_h2d + hw.host_copy_time_s(b_w * partition * c.oo),
                                     moves.fwd_d2h + hw.host_copy_time_s(FP32_BYTES * partition * c.oo))
    first_fwd = first_fwd + moves.fwd_host
    last_bwd = hw.overlapped_time_s(work.bwd_compute + work.recompute, moves.bwd_g2g + step_reduce, moves.bwd_h2d,
                                    moves.bwd_d2h) + moves.bwd_host
    first_extra = np.maximum(first_fwd - phases.fwd_phase, hw.cpu_adam_time_s(partition * c.oo))
    return EndOfIteration(first_fwd_extra=first_extra, last_bwd_extra=last_bwd - phases.bwd_phase + step.tied_s,
                          end=np.zeros_like(phases.stable), grad_reduce=step_reduce)
