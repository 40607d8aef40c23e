"""The textbook collectives (ExecutorCapabilities.collectives 'ideal': executors `mist-paper`, `megatron`): each
gradient byte crosses the data-parallel group once, Mist's offload semantics, a fused Adam step
(docs/design.md, The stage template)."""
from __future__ import annotations

import numpy as np

from mist_ds.cost.executors.interface import StageInputs, StageMoves
from mist_ds.cost.memory import FP32_BYTES

# Adam step traffic per parameter (fused, memory-bound): read + write fp32 master, exp_avg and
# exp_avg_sq (24 bytes), read the fp32 gradient (4); the low-precision weight write is added per dtype.
ADAM_STEP_BYTES_PER_PARAM = 28


def moves(inputs: StageInputs) -> StageMoves:
    """Each gradient byte crosses the group once (ExecutorCapabilities.collectives 'ideal'). ZeRO-3
    gathers the stage's weights in forward and again in backward, and reduce-scatters gradients in
    backward, every micro-batch; ZeRO-2 reduce-scatters gradients every micro-batch. Offload with Mist's
    semantics: the offloaded fraction of the stage's weights comes in for each pass, its gradients go
    out and come back every micro-batch. Gradients and the step cover the trainable elements; frozen weights
    are gathered only."""
    hw, c, data_parallel = inputs.hw, inputs.c, inputs.data_parallel
    weight_bytes, params = inputs.weight_bytes, inputs.trained
    grad_bytes, saved_offloaded = inputs.grad_bytes * params, inputs.saved_offloaded
    trained_bytes = hw.dtype_bytes * params
    gather = data_parallel.all_gather_time_s(weight_bytes)
    scatter = data_parallel.reduce_scatter_time_s(trained_bytes)
    none = np.zeros(np.broadcast(c.zero, weight_bytes).shape)
    fwd_h2d = hw.host_copy_time_s(c.wo * weight_bytes)
    step_reduce = np.select([c.zero <= 1, c.zero == 2], [data_parallel.all_reduce_time_s(grad_bytes),
                                                         data_parallel.all_gather_time_s(trained_bytes)], default=0.0)
    return StageMoves(
        fwd_g2g=np.where(c.zero == 3, gather, 0.0),
        bwd_g2g=np.where(c.zero == 3, gather + scatter, np.where(c.zero == 2, scatter, 0.0)),
        fwd_exposed=none, bwd_exposed=none,
        fwd_h2d=fwd_h2d, fwd_d2h=hw.host_copy_time_s(saved_offloaded),
        bwd_h2d=hw.host_copy_time_s(c.wo * weight_bytes + saved_offloaded + c.go * trained_bytes),
        bwd_d2h=hw.host_copy_time_s(c.go * trained_bytes), fwd_tp=none, bwd_tp=none, fwd_host=none, bwd_host=none,
        step_reduce=step_reduce,
        step_params=np.where(c.zero >= 1, params / c.d, params),
        step_bytes_per_param=ADAM_STEP_BYTES_PER_PARAM + hw.dtype_bytes,  # the weight written in the model dtype
        step_host_bytes_per_param=FP32_BYTES + hw.dtype_bytes,
        step_copies_s=none, reduce_hidden=step_reduce, reduce_exposed=none, reduce_rest=none,
        step_gather=none, step_gather_bytes=none)
