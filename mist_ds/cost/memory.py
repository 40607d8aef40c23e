"""Model-state memory per GPU: weights, gradients, optimizer states and the runtime's own buffers.

One function serves `show`, `predict` and `tune`. Inputs broadcast as numpy arrays, so the same
code prices one strategy or millions of candidates. Bytes throughout.

What DeepSpeed really allocates (DeepSpeed 0.19.8; tests/test_model_states.py enumerates a real
engine's tensors on CPU and compares):
- ZeRO 0, bf16: BF16_Optimizer keeps fp32 gradient accumulators for every parameter beside the bf16
  gradients, and its fp32 master weights and Adam states partitioned over data parallel.
- ZeRO 1/2: the fp32 master and Adam states are partitioned; ZeRO-2 also partitions gradients and
  reduces them through a bucket of `reduce_bucket_size` elements.
- ZeRO 3: weights partitioned too, gathered through prefetch buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FP32_BYTES = 4
# Adam keeps two fp32 moments per parameter (Kingma & Ba 2015): exp_avg and exp_avg_sq.
ADAM_MOMENT_BYTES = 2 * FP32_BYTES
# DeepSpeed's default `reduce_bucket_size` / `allgather_bucket_size`, elements (runtime/zero/config.py).
DEFAULT_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-GPU bytes of one stage's model states; host_* are what offloading moved to CPU memory."""

    weights: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    buffers: np.ndarray
    host: np.ndarray

    @property
    def gpu_total(self) -> np.ndarray:
        return self.weights + self.grads + self.optimizer + self.buffers


def _sharded(bytes_full: np.ndarray, sharded: np.ndarray, dp: np.ndarray) -> np.ndarray:
    return np.where(sharded, bytes_full / dp, bytes_full)


def model_state_bytes(params, dp, zero_stage, dtype_bytes, mixed_precision=True, weights_offload=0.0,
                      grads_offload=0.0, optimizer_offload=0.0,
                      bucket_elements=DEFAULT_BUCKET_ELEMENTS) -> ModelStateBytes:
    """Bytes one GPU holds for `params` parameters (its stage's share, per TP rank).

    params: parameters on this GPU before ZeRO sharding; dp: data-parallel degree d; zero_stage: z;
    dtype_bytes: bytes per weight / gradient element (2 for bf16/fp16, 4 for fp32);
    *_offload: fraction moved to host memory; bucket_elements: DeepSpeed's reduce bucket size.
    """
    params, dp, z = np.asarray(params, float), np.asarray(dp, float), np.asarray(zero_stage)
    master_bytes = np.where(mixed_precision, FP32_BYTES, 0)
    weights_full = params * dtype_bytes
    grads_full = params * dtype_bytes
    optimizer_full = params * (master_bytes + ADAM_MOMENT_BYTES)
    weights = _sharded(weights_full, z >= 3, dp)
    grads = _sharded(grads_full, z >= 2, dp)
    optimizer = _sharded(optimizer_full, z >= 1, dp)
    wo, go, oo = (np.asarray(x, float) for x in (weights_offload, grads_offload, optimizer_offload))
    host = weights * wo + grads * go + optimizer * oo
    # Runtime buffers: BF16_Optimizer's fp32 gradient accumulators (ZeRO 0, mixed precision), the
    # ZeRO-1/2 reduce bucket (capped by the gradients it could hold).
    fp32_accumulators = np.where((z == 0) & mixed_precision, params * FP32_BYTES, 0.0)
    bucket = np.where((z == 1) | (z == 2), np.minimum(bucket_elements, params) * dtype_bytes, 0.0)
    return ModelStateBytes(weights=weights * (1 - wo), grads=grads * (1 - go), optimizer=optimizer * (1 - oo),
                           buffers=fp32_accumulators + bucket, host=host)
