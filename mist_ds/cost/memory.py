"""Memory per GPU: model states (what each executor really allocates), activations, buffers.

One function serves `show`, `predict` and `tune`; inputs broadcast as numpy arrays, so the same code
prices one strategy or millions of candidates. Bytes throughout.

DeepSpeed 0.19.8 (executors `deepspeed`, `mist`), measured on real engines on CPU
(tests/test_model_states.py enumerates every tensor an engine holds, deduplicated by storage).
b = bytes of the model dtype, P = parameters on the GPU, d = data parallel, Pa = P padded to a
multiple of 2d, ps = Pa / d, p3 = ceil(P / d), L = elements of the largest single parameter,
R = reduce_bucket_size elements, N = elements of the ZeRO-3 parameters kept whole
(<= stage3_param_persistence_threshold), k = 2 for ZeRO-1 in a pipeline (reduce_gradients appends a
second bucket) and with overlap_comm (executor `mist` at S = 1), else 1,
U = max(min(P, ps + 2(L - 1)), min(Pa, ps + L - 1)): an upper bound of the
whole parameters overlapping one rank's partition plus the padding inside it (L - 1 taken as 0 when
L is not given: U = ps). One parameter group; ZeRO-1/2 with overlap_comm off (DeepSpeed's default and
what mist_ds/emit writes; on, a second bucket). Measured in bf16 and fp32; fp16 follows bf16 but for
the pipeline row. ZeRO keeps an fp32 master partition in fp32 training too (12 bytes, not 8).
- ZeRO 0 without a pipeline, bf16/fp16: FP16_UnfusedOptimizer, nothing partitioned: weights bP,
  fp32 master + Adam 12P, gradients bP, buffers 4P (an fp32 copy of the gradients while stepping).
- ZeRO 0 in a pipeline, bf16: BF16_Optimizer: flat weights b Pa, gradients b Pa + bP (an
  accumulation buffer beside the module's .grad), fp32 master + Adam 12 ps, buffers 4 ps (the fp32
  gradient partition while stepping). With `bf16.immediate_grad_update` (what mist_ds/emit writes for a
  schedule that splits the backward, executor_rules.immediate_grad_update) a hook adds each gradient to the
  buffer as autograd lands it and drops the .grad (bf16_optimizer.py accumulate_hp_grads_and_remove_lp):
  gradients b Pa (one parameter's .grad between its landing and its hook is the layer's backward transient,
  cost/stage_memory.py).
- ZeRO 0, fp32, with or without a pipeline: torch AdamW: weights 4P, gradients 4P, Adam 8P.
- ZeRO 1 and 2: weights b Pa, fp32 master + Adam 12 ps, buffers max(k b R, 4 ps): the bucket is
  allocated whole whatever P and released before the fp32 gradient partition of the step exists.
  Gradients: ZeRO-1 b max(P, U) (the full .grad lives until the reduction after backward, then the
  partition), ZeRO-2 b U (the partition holds whole parameters), 2 b U with G > 1 micro-batches: from
  the second on, the accumulated partition (all_grad_tensors, stage_1_and_2.py:1038-1045) lives beside
  the fresh copy of the current one (grads_in_partition, allocated again at :2184-2194). ZeRO-1 with
  overlap_comm and G = 1: the hooks move each gradient into the bucket as it arrives, so the full .grad
  never lives; what does is the gradients of the O elements in tensors larger than the bucket, which
  DeepSpeed reduces outside it (stage_1_and_2.py:1443-1449, cloned under offload) and keeps, outside the
  rank's partition, until the epilogue clears .grad (:1067), and without offload the partition copy
  (grads_in_partition, at most U): b min(max(P, U), O) with offload, b min(max(P, U), U + O) without.
- ZeRO 3 (DeepSpeed pads each parameter to d: a few elements above p3): weights b p3, gradient
  partition b p3, fp32 master + Adam 12 p3, buffers b R + max(4 p3, b N): the bucket is never
  freed, the step's fp32 gradients add to it, the whole small parameters are resident outside the
  step. The layers gathered while they run are not model states (cost/stage_memory.py counts them).
- optimizer offload (cpu): master, Adam and the fp32 gradient partition live on the host, 16 bytes
  per element, with a b-byte copy of the updated partition; no device gradient partition. ZeRO-1/2:
  gradients b max(P, U) (ZeRO-1's full .grad) or 0 (ZeRO-2), buffers k b R + b L, host
  16 ps + b ps + b L (a staging buffer of the largest parameter on each side). ZeRO-3: gradients 0
  (the partition is allocated on the host), buffers b R + b N, host 16 p3 + b p3.
Each field is its own peak over the end of backward and the optimizer step (ZeRO-1's full .grad and
the bucket peak in the first, the partitions and the fp32 gradients in the second), so `gpu_total`
is at least the device bytes at either moment (ZeRO-3's per-parameter padding aside).
Other executors use the ZeRO paper's accounting (Rajbhandari et al. 2020): b + b + 12 bytes per
parameter, each part divided by d where sharded. Megatron-LM: its DDP keeps gradients in one contiguous
buffer that lives all iteration, in fp32 with bf16 (accumulate_allreduce_grads_in_fp32 is forced on)
and in the model dtype otherwise. Its mixed-precision optimizer hands Adam `main_grad.float()`, an
alias of an fp32 buffer but a new fp32 copy of a half one: with fp16 gradients the step adds 4 bytes
per parameter it updates (the shard with the distributed optimizer), while the activations are freed
(`step_only`: the stage's peak is the larger of backward and the step, cost/stage_memory.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mist_ds.specs.buckets import PLANNED_REDUCE_BUCKET_ELEMENTS
from mist_ds.specs.executors import ModelStateAccounting
from mist_ds.specs.executor_rules import runs_bf16_optimizer

FP32_BYTES = 4
ADAM_MOMENT_BYTES = 2 * FP32_BYTES  # exp_avg and exp_avg_sq (Kingma & Ba 2015)
MASTER_BYTES = FP32_BYTES
MASTER_ADAM_BYTES = MASTER_BYTES + ADAM_MOMENT_BYTES


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-GPU bytes of one stage's model states, each field at its own peak over the end of backward
    and the optimizer step (module docstring); `host` is what offloading keeps in CPU memory."""

    weights: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    buffers: np.ndarray
    host: np.ndarray
    step_only: np.ndarray | float = 0.0
    """Device bytes that exist only during the optimizer step, when no activation is held: part of the
    model states' own peak (`gpu_total`); a stage's peak counts them only beyond its activations
    (cost/stage_memory.py)."""

    @property
    def gpu_total(self) -> np.ndarray:
        """The model states' peak on the device: every field at its peak, the step's own bytes too."""
        return self.weights + self.grads + self.optimizer + self.buffers + self.step_only


@dataclass(frozen=True)
class ModelStateShape:
    """What a model-state accounting reads of one stage (module docstring's symbols); arrays broadcast, elements
    on one TP rank."""

    params: Any
    """P: the stage's parameters on the GPU (elements)."""
    dp: Any
    """d: data-parallel ranks."""
    zero: Any
    dtype_bytes: float
    """b: bytes of the model dtype."""
    mixed_precision: bool = True
    bf16: bool = True
    pipeline: Any = False
    """S > 1 (DeepSpeed steps bf16 ZeRO-0 pipelines with BF16_Optimizer, ZeRO-1 keeps a second bucket)."""
    weights_offload: Any = 0.0
    grads_offload: Any = 0.0
    optimizer_offload: Any = 0.0
    """Offloaded fractions (DeepSpeed's: any fraction > 0 offloads the whole)."""
    trainable_params: Any = None
    """The elements with requires_grad (None: all P); frozen ones hold weights only."""
    grad_accum: Any = 1
    """G: micro-batches per step (ZeRO-2 keeps two gradient partitions with more than one)."""
    reduce_bucket_elements: Any = PLANNED_REDUCE_BUCKET_ELEMENTS
    """R: the reduce bucket (the planned one by default, as mist_ds/emit writes it)."""
    largest_param_elements: Any = 0.0
    """L: the largest single parameter tensor (0 = unknown: ZeRO-1/2 gradient partitions are priced at ps,
    offload staging at 0)."""
    persistent_param_elements: Any = 0.0
    """N: ZeRO-3 parameters kept whole (0, as the emitter's stage3_param_persistence_threshold of 0 makes it)."""
    overlap_comm: Any = False
    """DeepSpeed's overlap_comm at ZeRO-1/2: a second bucket (setup_buckets in stage_1_and_2.py)."""
    oversized_param_elements: Any = None
    """O: elements of the tensors larger than R (None = unknown; read by ZeRO-1 with overlap_comm at G = 1)."""
    immediate_grad_update: Any = False
    """bf16.immediate_grad_update is set (executor_rules.immediate_grad_update): BF16_Optimizer keeps no .grad."""


def _padded(params, dp):
    """DeepSpeed pads a flat group to a multiple of 2 x dp elements (stage_1_and_2.py, bf16_optimizer.py)."""
    return np.ceil(params / (2 * dp)) * (2 * dp)


def partition_touch_elements(params, dp, largest_param_elements):
    """U: an upper bound, over the ranks, of the elements ZeRO-1/2 hold for one rank's partition
    [r ps, (r + 1) ps) of the padded flat group: the whole parameters overlapping it plus the padding
    inside it (DeepSpeed copies whole parameters, stage_1_and_2.py copy_grads_in_partition).

    A parameter of at most L elements that overlaps the partition sticks out by at most L - 1 on each
    side: U = max(min(P, ps + 2(L - 1)), min(Pa, ps + L - 1)), the second term for the rank holding
    the padding (only the left side sticks out). L = 0 (unknown) gives ps. Exact for d = 1 (Pa).
    """
    p = np.asarray(params, dtype=np.float64)
    d = np.asarray(dp, dtype=np.float64)
    padded = _padded(p, d)
    part = padded / d
    reach = np.maximum(np.asarray(largest_param_elements, dtype=np.float64) - 1, 0.0)
    return np.maximum(np.minimum(p, part + 2 * reach), np.minimum(padded, part + reach))


def deepspeed_model_states(shape: ModelStateShape) -> ModelStateBytes:
    """Model states a DeepSpeed 0.19.8 engine holds on one GPU (module docstring; ModelStateShape's fields:
    with O unknown, ZeRO-1's gradients are b max(P, U) at G = 1 too, an upper bound).

    DeepSpeed's optimizers own only the trainable elements T (`is_optimized_parameter`,
    deepspeed/runtime/utils.py: ZeRO-1/2's flat groups, BF16_Optimizer, FP16_UnfusedOptimizer, ZeRO-3's trainable
    groups), so every formula above reads P as T (L and O too are of trainable tensors), and the frozen F = P - T
    add their weights only: whole on every rank at ZeRO 0-2 (left out of the flat group), partitioned at ZeRO-3
    (the engine partitions every parameter of the module), b F or b ceil(F / d)."""
    whole = np.asarray(shape.params, dtype=np.float64)
    p = whole if shape.trainable_params is None else np.asarray(shape.trainable_params, dtype=np.float64)
    frozen = whole - p
    d = np.asarray(shape.dp, dtype=np.float64)
    z = np.asarray(shape.zero)
    b = float(shape.dtype_bytes)
    pipe = np.asarray(shape.pipeline, dtype=bool)
    overlap_comm = np.asarray(shape.overlap_comm, dtype=bool)
    largest = np.asarray(shape.largest_param_elements, dtype=np.float64)
    offloaded = np.asarray(shape.optimizer_offload) > 0
    padded = _padded(p, d)
    part = padded / d
    p3 = np.ceil(p / d)  # DeepSpeed pads each parameter to d: a few elements more
    touch = partition_touch_elements(p, d, largest)
    zero12 = (z == 1) | (z == 2)
    bf16_optimizer = runs_bf16_optimizer(z, pipe, bool(shape.mixed_precision and shape.bf16))
    torch_optimizer = (z == 0) & ~bf16_optimizer  # FP16_UnfusedOptimizer, or torch AdamW in fp32
    master = MASTER_BYTES if shape.mixed_precision else 0  # fp32 training: the weights are the master (ZeRO-0 only)
    shard = np.select([torch_optimizer, z == 3], [p, p3], default=part)  # elements the optimizer updates

    weights = b * np.select([z == 3, torch_optimizer], [p3, p], default=padded)
    weights = weights + b * np.where(z == 3, np.ceil(frozen / d), frozen)
    zero2_partitions = np.where(np.asarray(shape.grad_accum) > 1, 2.0, 1.0)
    module_grads = np.where(np.asarray(shape.immediate_grad_update, dtype=bool), 0.0, p)  # BF16_Optimizer's .grad
    grads = b * np.select([torch_optimizer, bf16_optimizer, z == 1, z == 2, z == 3],
                          [p, padded + module_grads, np.maximum(p, touch), zero2_partitions * touch, p3])
    grads = np.where(offloaded & (z >= 2), 0.0, grads)  # no device partition: gradients go to the host
    if shape.oversized_param_elements is not None:  # ZeRO-1, overlap_comm, G = 1: no full .grad (module docstring)
        whole = np.asarray(shape.oversized_param_elements, dtype=np.float64) + np.where(offloaded, 0.0, touch)
        hooked_alone = (z == 1) & overlap_comm & (np.asarray(shape.grad_accum) == 1)
        grads = np.where(hooked_alone, b * np.minimum(np.maximum(p, touch), whole), grads)
    optimizer = np.where(torch_optimizer, (master + ADAM_MOMENT_BYTES) * p, MASTER_ADAM_BYTES * shard)
    step_grads = np.where(torch_optimizer & (master == 0), 0.0, FP32_BYTES * shard)
    bucket = b * np.asarray(shape.reduce_bucket_elements, dtype=np.float64) * np.select(
        [zero12, z == 3], [np.where((pipe & (z == 1)) | overlap_comm, 2, 1), 1], default=0)
    staging = np.where(offloaded & zero12, b * largest, 0.0)  # one on the device, one on the host
    persistent = np.where(z == 3, b * np.asarray(shape.persistent_param_elements, dtype=np.float64), 0.0)

    host = np.where(offloaded, optimizer + step_grads + b * shard + staging, 0.0)
    optimizer = np.where(offloaded, 0.0, optimizer)
    step_grads = np.where(offloaded, 0.0, step_grads)
    # ZeRO-1/2 release the bucket before the step's fp32 gradients exist; ZeRO-3 keeps it, and its
    # persistent parameters are resident outside the step only.
    buffers = np.where(z == 3, bucket + np.maximum(step_grads, persistent), np.maximum(bucket, step_grads) + staging)
    weights_on_host = np.asarray(shape.weights_offload) > 0
    host = host + np.where(weights_on_host, weights, 0.0)
    weights = np.where(weights_on_host, 0.0, weights)
    return ModelStateBytes(weights=weights, grads=grads, optimizer=optimizer, buffers=buffers, host=host)


def textbook_model_states(shape: ModelStateShape, grad_bytes=None) -> ModelStateBytes:
    """b + b + 12 bytes per parameter (ZeRO paper), sharded by ZeRO stage, times (1 - offload); gradients (of
    `grad_bytes` each, None: b) and optimizer states of the trainable elements only. Reads P, d, ZeRO, b, mixed
    precision, the offload fractions and the trainable elements of `shape`."""
    params, dp, zero, dtype_bytes, trainable_params = (shape.params, shape.dp, shape.zero, shape.dtype_bytes,
                                                       shape.trainable_params)
    p = np.asarray(params, dtype=np.float64)
    trained = p if trainable_params is None else np.asarray(trainable_params, dtype=np.float64)
    d = np.asarray(dp, dtype=np.float64)
    z = np.asarray(zero)
    b = float(dtype_bytes)
    optimizer_bytes = (MASTER_BYTES if shape.mixed_precision else 0) + ADAM_MOMENT_BYTES
    g = b if grad_bytes is None else float(grad_bytes)
    weights = np.where(z >= 3, b * p / d, b * p)
    grads = np.where(z >= 2, g * trained / d, g * trained)
    optimizer = np.where(z >= 1, optimizer_bytes * trained / d, optimizer_bytes * trained)
    wo, go, oo = (np.asarray(x, dtype=np.float64)
                  for x in (shape.weights_offload, shape.grads_offload, shape.optimizer_offload))
    host = weights * wo + grads * go + optimizer * oo
    return ModelStateBytes(weights=weights * (1 - wo), grads=grads * (1 - go), optimizer=optimizer * (1 - oo),
                           buffers=np.zeros_like(p), host=host)


def megatron_model_states(shape: ModelStateShape) -> ModelStateBytes:
    """Megatron-LM (module docstring): the distributed optimizer is ZeRO-1; gradients in fp32 with
    bf16; with fp16 gradients the step's fp32 copy of the gradients it updates is `step_only`. Nothing but
    the optimizer states offloads."""
    params, dp, dtype_bytes, optimizer_offload = shape.params, shape.dp, shape.dtype_bytes, shape.optimizer_offload
    half_grads = bool(shape.mixed_precision and dtype_bytes == 2)
    fp32_main_grads = half_grads and shape.bf16
    zero1 = np.minimum(shape.zero, 1)
    states = textbook_model_states(replace(shape, zero=zero1, weights_offload=0.0, grads_offload=0.0),
                                   grad_bytes=FP32_BYTES if fp32_main_grads else None)
    if not half_grads or fp32_main_grads:
        return states
    p = np.asarray(params if shape.trainable_params is None else shape.trainable_params, dtype=np.float64)
    updated = np.where(zero1 >= 1, p / np.asarray(dp, dtype=np.float64), p)
    on_device = 1.0 - np.asarray(optimizer_offload, dtype=np.float64)  # an offloaded share steps on the host
    return replace(states, step_only=FP32_BYTES * updated * on_device)


def model_state_bytes(accounting: ModelStateAccounting, shape: ModelStateShape) -> ModelStateBytes:
    """Model states per GPU of a stage of `shape` under an executor's `accounting` (ExecutorCapabilities.model_states;
    module docstring). The one function show / predict / tune use; only DeepSpeed's accounting reads the reduce
    bucket, L, N, G, overlap_comm and O."""
    if accounting == "deepspeed":
        return deepspeed_model_states(shape)
    if accounting == "megatron":
        return megatron_model_states(shape)
    return textbook_model_states(shape)
