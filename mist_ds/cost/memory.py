"""Memory per GPU: model states (what each runtime really allocates), activations, buffers.

One function serves `show`, `predict` and `tune`; inputs broadcast as numpy arrays, so the same code
prices one strategy or millions of candidates. Bytes throughout.

DeepSpeed 0.19.8 (runtime `deepspeed`), measured on real engines on CPU (tests/test_model_states.py
enumerates every tensor an engine holds, deduplicated by storage; b = bytes of the model dtype,
P = parameters on the GPU, d = data parallel, Pa = P padded to a multiple of 2d, ps = Pa / d):
- ZeRO 0, bf16/fp16, no pipeline: FP16_UnfusedOptimizer, nothing partitioned: weights bP, fp32
  master 4P, Adam 8P, gradients bP, and an fp32 copy of the gradients (4P) while stepping.
- ZeRO 0 in a pipeline (bf16): BF16_Optimizer: weights 2P, a full-size gradient buffer bP, the
  low-precision .grad (2P) until the step, fp32 master and Adam partitioned (12 ps), fp32 gradient
  partition (4 ps) while stepping.
- ZeRO 0, fp32: torch AdamW: weights 4P, Adam 8P, gradients 4P.
- ZeRO 1 and 2 (identical allocations: contiguous gradients partition both): weights b Pa, fp32
  master and Adam 12 ps, gradient partition b ps from backward to the step, a reduce bucket of
  min(reduce_bucket_size, P) elements in backward, fp32 gradient partition 4 ps while stepping.
- ZeRO 3: weights b P/d, gradient partition b P/d, fp32 master + Adam 12 P/d, fp32 gradients 4 P/d
  while stepping, a reduce bucket of reduce_bucket_size elements kept for good, small parameters
  (<= stage3_param_persistence_threshold) resident whole, gathered layers while they run.
- optimizer offload: master, Adam, the fp32 gradient partition and a staging copy live on the host.
Other runtimes use the ZeRO paper's accounting (Rajbhandari et al. 2020): b + b + 12 bytes per
parameter, each part divided by d where sharded; Megatron keeps fp32 main gradients (4 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FP32_BYTES = 4
ADAM_MOMENT_BYTES = 2 * FP32_BYTES  # exp_avg and exp_avg_sq (Kingma & Ba 2015)
MASTER_BYTES = FP32_BYTES
# DeepSpeed defaults (runtime/zero/config.py), elements.
DEFAULT_REDUCE_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-GPU bytes of one stage's model states at their peak (inside the optimizer step or at the
    end of backward, whichever is larger); `host` is what offloading keeps in CPU memory."""

    weights: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    buffers: np.ndarray
    host: np.ndarray

    @property
    def gpu_total(self) -> np.ndarray:
        return self.weights + self.grads + self.optimizer + self.buffers


def _padded(params, dp):
    """DeepSpeed pads a flat group to a multiple of 2 x dp elements (stage_1_and_2.py, bf16_optimizer.py)."""
    return np.ceil(params / (2 * dp)) * (2 * dp)


def deepspeed_model_states(params, dp, zero, dtype_bytes, mixed_precision, pipeline, optimizer_offload,
                           weights_offload, reduce_bucket_elements=DEFAULT_REDUCE_BUCKET_ELEMENTS,
                           largest_param=0.0, persistent_params=0.0) -> ModelStateBytes:
    """Model states a DeepSpeed 0.19.8 engine holds on one GPU (module docstring)."""
    p = np.asarray(params, dtype=np.float64)
    d = np.asarray(dp, dtype=np.float64)
    z = np.asarray(zero)
    b = float(dtype_bytes)
    offloaded = np.asarray(optimizer_offload) > 0
    padded = _padded(p, d)
    part = padded / d
    p3 = np.ceil(p / d)  # ZeRO-3 pads each parameter to d; a whole-layer bound here
    zero0_plain = (z == 0) & ~np.asarray(pipeline, dtype=bool)
    zero0_pipe = (z == 0) & np.asarray(pipeline, dtype=bool)
    mixed = bool(mixed_precision)

    weights = np.select([z == 3], [b * p3], default=np.where((z == 1) | (z == 2), b * padded, b * p))
    if mixed:
        master_adam_full = (MASTER_BYTES + ADAM_MOMENT_BYTES) * p
        step_grads_full = FP32_BYTES * p
        grads = np.select([zero0_plain, zero0_pipe, z == 3], [b * p, b * padded + 2 * p, b * p3], default=b * part)
    else:
        master_adam_full = ADAM_MOMENT_BYTES * p  # fp32 training: the weights are the master
        step_grads_full = 0 * p
        grads = np.select([z == 3], [b * p3], default=np.where(z == 0, b * p, b * part))
    optimizer = np.select([zero0_plain, z == 3], [master_adam_full, master_adam_full / np.maximum(p, 1) * p3],
                          default=master_adam_full / np.maximum(p, 1) * part)
    step_grads = np.select([zero0_plain, z == 3], [step_grads_full, FP32_BYTES * p3], default=FP32_BYTES * part)
    bucket = np.select([(z == 1) | (z == 2), z == 3],
                       [b * np.minimum(reduce_bucket_elements, p), b * reduce_bucket_elements], default=0.0)
    persistent = np.where(z == 3, b * np.asarray(persistent_params, dtype=np.float64), 0.0)

    host = np.where(offloaded, optimizer + step_grads + b * np.where(z == 3, p3, part), 0.0)
    optimizer = np.where(offloaded, 0.0, optimizer)
    step_grads = np.where(offloaded, 0.0, step_grads)
    weights_on_host = np.asarray(weights_offload) > 0
    host = host + np.where(weights_on_host, weights, 0.0)
    weights = np.where(weights_on_host, 0.0, weights)
    # The larger of the two moments: backward's end (gradients + bucket) and the step (gradients + fp32 copy).
    buffers = np.maximum(bucket, step_grads) + persistent
    return ModelStateBytes(weights=weights, grads=grads, optimizer=optimizer, buffers=buffers, host=host)


def textbook_model_states(params, dp, zero, dtype_bytes, mixed_precision, weights_offload=0.0, grads_offload=0.0,
                          optimizer_offload=0.0, grad_bytes=None) -> ModelStateBytes:
    """b + b + 12 bytes per parameter (ZeRO paper), sharded by ZeRO stage, times (1 - offload)."""
    p = np.asarray(params, dtype=np.float64)
    d = np.asarray(dp, dtype=np.float64)
    z = np.asarray(zero)
    b = float(dtype_bytes)
    optimizer_bytes = (MASTER_BYTES if mixed_precision else 0) + ADAM_MOMENT_BYTES
    g = b if grad_bytes is None else float(grad_bytes)
    weights = np.where(z >= 3, b * p / d, b * p)
    grads = np.where(z >= 2, g * p / d, g * p)
    optimizer = np.where(z >= 1, optimizer_bytes * p / d, optimizer_bytes * p)
    wo, go, oo = (np.asarray(x, dtype=np.float64) for x in (weights_offload, grads_offload, optimizer_offload))
    host = weights * wo + grads * go + optimizer * oo
    return ModelStateBytes(weights=weights * (1 - wo), grads=grads * (1 - go), optimizer=optimizer * (1 - oo),
                           buffers=np.zeros_like(p), host=host)


def model_state_bytes(runtime: str, params, dp, zero, dtype_bytes, mixed_precision=True, pipeline=False,
                      weights_offload=0.0, grads_offload=0.0, optimizer_offload=0.0,
                      reduce_bucket_elements=DEFAULT_REDUCE_BUCKET_ELEMENTS, bf16: bool = True) -> ModelStateBytes:
    """Model states per GPU on `runtime` (module docstring). The one function show / predict / tune use."""
    if runtime in ("deepspeed", "mist"):
        return deepspeed_model_states(params, dp, zero, dtype_bytes, mixed_precision, pipeline, optimizer_offload,
                                      weights_offload, reduce_bucket_elements)
    if runtime == "megatron":  # main gradients in fp32 with bf16 (its rule); distributed optimizer = ZeRO-1
        return textbook_model_states(params, dp, np.minimum(zero, 1), dtype_bytes, mixed_precision,
                                     optimizer_offload=optimizer_offload,
                                     grad_bytes=FP32_BYTES if (mixed_precision and dtype_bytes == 2 and bf16)
                                     else None)
    return textbook_model_states(params, dp, zero, dtype_bytes, mixed_precision, weights_offload, grads_offload,
                                 optimizer_offload)
