"""DeepSpeed 0.19.8's stock engines (ExecutorCapabilities.collectives 'deepspeed': executors `deepspeed`,
`mist`): the data-parallel collectives its ZeRO optimizers and BF16_Optimizer run, partitioned pipeline
sends, offload of the rank's partition, torch's AdamW (docs/design.md, What DeepSpeed does)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.cost.candidates import stage_trainable_tensors, vocab_shard_elements
from mist_ds.cost.executors.interface import StageInputs, StageMoves
from mist_ds.cost.executors.mist import layerwise_reduce
from mist_ds.cost.memory import FP32_BYTES
from mist_ds.specs.executor_rules import reduce_bucket_elements_of, reduces_gradients_in_fp32, runs_bf16_optimizer

# torch's AdamW as DeepSpeed runs it with `torch_adam: true` (foreach on a GPU, torch/optim/adam.py
# _multi_tensor_adam; the single-tensor loop elsewhere does the same passes): eight passes over fp32
# tensors, each reading and writing whole tensors: weight decay on p (r+w, 8), lerp of exp_avg with g
# (12), exp_avg_sq *= beta2 (8), addcmul with g twice (16), sqrt into a new tensor (8), div (8), add eps
# (8), addcdiv into p (16).
TORCH_ADAMW_STEP_BYTES_PER_PARAM = 84
# Its ops per tensor on CPU tensors (_single_tensor_adam): step_t += 1, param.mul_ (decoupled weight decay),
# exp_avg.lerp_, exp_avg_sq.mul_ and addcmul_, _get_value(step_t) (an .item()), exp_avg_sq.sqrt(), the division by
# bias_correction2_sqrt, add_(eps), param.addcdiv_: ten (microbench.dispatched_ops counts them; tests/test_cost.py).
TORCH_ADAMW_OPS_PER_TENSOR = 10
# On a GPU, _multi_tensor_adam: eight foreach ops on the device per step (_foreach_mul_ for weight decay,
# _foreach_lerp_, _foreach_mul_, _foreach_addcmul_, _foreach_sqrt, _foreach_div_, _foreach_add_, _foreach_addcdiv_;
# the step counters are CPU tensors), each launching a kernel per FOREACH_TENSORS_PER_LAUNCH tensors
# (ATen/native/cuda/MultiTensorApply.cuh depth_to_max_tensors: 110, 64, 48, 36 for 1-4 tensor lists; 48 is
# addcdiv_'s three lists) and per FOREACH_ELEMENTS_PER_LAUNCH elements (kChunkSize 65536 x depth_to_max_blocks 320).
TORCH_ADAMW_FOREACH_OPS = 8
FOREACH_TENSORS_PER_LAUNCH = 48
FOREACH_ELEMENTS_PER_LAUNCH = 65536 * 320
# ZeRO-3 steps its partition in sub-groups of this many elements (zero_optimization.sub_group_size, default 1e9,
# deepspeed/runtime/zero/config.py; mist_ds never sets it): one flat tensor per sub-group.
ZERO3_SUB_GROUP_ELEMENTS = 1_000_000_000
# A partitioned pipeline send's header: PartitionedTensor.to_meta, nine int64 (deepspeed/runtime/utils.py).
PARTITION_META_BYTES = 72
# ZeRO-0 and BF16_Optimizer all-reduce gradients in buffers of this many elements
# (MEMORY_OPT_ALLREDUCE_SIZE, deepspeed/runtime/engine.py:151; allreduce_gradients, pipe/engine.py:294-298).
ENGINE_ALLREDUCE_ELEMENTS = 500_000_000


def in_pieces(collective, message, count):
    """`count` calls (at least one) of one collective sharing `message` bytes equally: each pays its own
    latency (and protocol), as DeepSpeed issues one per bucket or per module."""
    count = np.maximum(count, 1.0)
    return count * collective(message / count)


def zero3_gathers_per_block(costs) -> int:
    """All-gathers ZeRO-3 issues per block per pass: one per parameter-holding submodule
    (partitioned_param_coordinator.py fetch_sub_module gathers the module's parameters in one coalesced
    call, :364-381, and each prefetch round takes what the live limit freed, about one submodule,
    :452-484). Counted as the block's linears (its forward GEMMs on weights); a norm's few elements go in
    its neighbour's prefetch round."""
    return max(sum(1 for gemm in costs.block.gemms if gemm[0] == "fwd"), 1)


def zero3_host_s(costs, hw, c) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) host seconds of ZeRO-3's coordinator for one micro-batch of a stage: its hooks on every
    module call (deepspeed/runtime/zero/parameter_offload.py _register_deepspeed_module: pre- and post-forward
    hooks, and autograd functions on each call's inputs and outputs whose backward runs the pre- and post-backward
    hooks), and for each call of a module holding parameters one fetch and one release per pass
    (partitioned_param_coordinator.py fetch_sub_module: the coalesced all-gather issued and its handle waited on
    before the module runs, :364-409; release_sub_module, :492): cluster.gpu.zero3_hook_us and zero3_fetch_us per
    call, the latter beyond the all-gather the collectives price. The recomputed forward runs them again. Serial
    with the pass: on CPU ranks the host is the device; on a GPU the host may run ahead of the kernels, so this is
    an upper bound there (GPU clusters leave both at 0: not measured). Calls of the runtime's wrappers around each
    layer are not counted."""
    gpu, ev = hw.cluster.gpu, c.shapes
    if gpu.zero3_fetch_s == 0 and gpu.zero3_hook_s == 0:  # no work on the (many) candidates
        none = np.zeros(np.broadcast(c.zero, c.layers).shape)
        return none, none

    def per_call(layer):
        return gpu.zero3_hook_s * ev(layer, "module_calls") + gpu.zero3_fetch_s * ev(layer, "fetching_calls")

    block = per_call(costs.block)
    once = c.layers * block + c.first * per_call(costs.embedding) + c.last * per_call(costs.head)
    zero3 = c.zero == 3
    return np.where(zero3, once, 0.0), np.where(zero3, once + c.recompute * block, 0.0)


def zero12_host_s(hw, tensors, params) -> np.ndarray:
    """Host seconds of one ZeRO-1/2 gradient reduction of a stage of `tensors` trained tensors and `params` trained
    parameters (zero/stage_1_and_2.py, the config mist_ds emits: contiguous gradients, overlap_comm off): a hook per
    tensor (grad_handling_hook -> reduce_independent_p_g_buckets_and_remove_grads: the gradient copied into the reduce
    bucket, which setup_buckets allocates afresh for each reduction), then independent_gradient_partition_epilogue
    (the bucket averaged and all-reduced, the rank's partition kept): cluster.gpu.zero12_tensor_us per tensor and
    zero12_per_mib_us per MiB of gradient, beyond the all-reduce the collectives price. ZeRO-2 reduces every
    micro-batch, ZeRO-1 once, at the accumulation boundary (engine.py allreduce_gradients). Serial with the pass:
    on CPU ranks the host is the device (docs/design.md, What DeepSpeed does: on the development VM the hooks took
    40-100 us a tensor inside the engine); GPU clusters leave both at 0 (not measured). Not priced: ZeRO-1's hooks in
    the micro-batches before the boundary (they return early), and that a stage's gradients beyond one bucket
    reuse its pages (the per-byte figure is measured with them fresh)."""
    gpu = hw.cluster.gpu
    return gpu.zero12_tensor_s * tensors + gpu.zero12_byte_s * hw.dtype_bytes * params


@dataclass(frozen=True)
class StepOps:
    """What DeepSpeed 0.19.8's wrapper around torch's AdamW adds to one rank's step (docs/design.md, What DeepSpeed
    does): tensor ops (microbench.dispatched_ops: through torch's dispatcher, `detach` left out) per trained
    parameter tensor of the stage, per tensor with elements in the rank's partition (ZeRO-1/2's norm and overflow
    loops), and once per step; bytes read and written per stepped parameter (the optimizer's own passes apart).
    Counted on CPU ranks (tiny, dp 2, 100 tensors, gradient_clipping 1.0) and read in the code each entry cites."""

    per_tensor: float
    per_partition_tensor: float
    once: float
    bytes_per_param: float


# ZeRO-0 fp32: the engine's own step (engine.py _take_model_step): clip_fp32_gradients, deepspeed/runtime/utils.py
# clip_grad_norm_: per gradient a norm and a mul_ by the clip coefficient, once the norms stacked and all-reduced;
# zero_grad sets the gradients to None. No clipping (train.grad_clip 0): nothing.
ENGINE_CLIP_STEP = StepOps(per_tensor=2, per_partition_tensor=0, once=13, bytes_per_param=12)
# ZeRO-0 bf16 (DDP_BFLOAT16) and fp16 (engine.py _do_optimizer_sanity_check, _configure_fp16_optimizer: torch's AdamW
# is no FusedAdam): fp16/unfused_optimizer.py FP16_UnfusedOptimizer.step: per tensor the overflow check
# (CheckOverflow.has_overflow_serial -> utils.py has_inf_or_nan: amax, amin and their tests, an .item()), the norm
# (utils.py get_weight_norm: a float copy, norm, pow, add), the fp32 gradient copy, unscale_and_clip_grads' mul_,
# and the fp32 master copied into the 16-bit weight (copy_); zero_grad sets to None.
UNFUSED_STEP = StepOps(per_tensor=20, per_partition_tensor=0, once=9, bytes_per_param=36)
# bf16 pipelines at ZeRO-0 (runs_bf16_optimizer): bf16_optimizer.py BF16_Optimizer.step: per fp32 gradient
# get_global_norm_of_tensors' norm (a copy and a norm); one flat partition stepped; clip_tensors_by_global_norm
# scales only above the clip; update_lp_params copies the flat partition into the bf16 one; clear_hp_grads zeroes it.
BF16_OPTIMIZER_STEP = StepOps(per_tensor=2, per_partition_tensor=0, once=28, bytes_per_param=32)
# ZeRO-1/2 (zero/stage_1_and_2.py DeepSpeedZeroOptimizer.step): per parameter a slice and a view (the partition's
# bookkeeping, free_grad_in_param_list, get_flat_partition); per tensor in the partition get_grad_norm_direct (a
# view, a float copy, a norm), in fp16 / bf16 also has_overflow_partitioned_grads_serial (check_grad_overflow: 13
# ops of has_inf_or_nan and the count); once the flat fp32 gradient, unscale_and_clip_grads, one flat step and the
# copy into the 16-bit partition (:3145).
ZERO12_STEP = {"fp32": StepOps(per_tensor=2, per_partition_tensor=3, once=49, bytes_per_param=48),
               "16-bit": StepOps(per_tensor=2, per_partition_tensor=16, once=43, bytes_per_param=48)}
# ... with offload_optimizer: complete_grad_norm_calculation_for_cpu_offload reads each partition tensor's norm
# (an .item()); the host copies are step_host_bytes_per_param.
ZERO12_OFFLOAD_STEP = StepOps(per_tensor=2, per_partition_tensor=1, once=46, bytes_per_param=0)
# ZeRO-3 (zero/stage3.py DeepSpeedZeroOptimizer_Stage3.step): every parameter has a partition on every rank; per
# parameter two views, a slice, get_grad_norm_direct's float copy and norm; with offload the norm is squared and
# summed on the host (pow, add_) instead.
ZERO3_STEP = {"fp32": StepOps(per_tensor=5, per_partition_tensor=0, once=43, bytes_per_param=48),
              "16-bit": StepOps(per_tensor=5, per_partition_tensor=0, once=43, bytes_per_param=44)}
ZERO3_OFFLOAD_STEP = StepOps(per_tensor=4, per_partition_tensor=0, once=41, bytes_per_param=0)
NO_STEP_OPS = StepOps(per_tensor=0, per_partition_tensor=0, once=0, bytes_per_param=0)


def step_work(zero, pipeline, precision: str, offloaded, grad_clip: float, tensors, d):
    """(ops, wrapper bytes per stepped parameter) of the optimizer wrapper DeepSpeed 0.19.8 builds for mist_ds's
    config (engine.py _configure_optimizer), per candidate: ZeRO stage `zero`, in a pipeline, `offloaded` optimizer
    (a fraction > 0), on a stage of `tensors` trained parameter tensors over `d` data-parallel ranks; torch's AdamW
    apart (torch_adam_ops). A tensor of a ZeRO-1/2 partition: tensors / d, plus one straddling its edge."""
    zero, pipeline, offloaded, tensors, d = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64)
                                                                  for x in (zero, pipeline, offloaded, tensors, d)))
    width = "fp32" if precision == "fp32" else "16-bit"
    bf16_optimizer = runs_bf16_optimizer(zero, pipeline > 0, precision == "bf16")
    off = offloaded > 0
    zero0 = ENGINE_CLIP_STEP if grad_clip > 0 else NO_STEP_OPS
    if precision != "fp32":
        zero0 = UNFUSED_STEP
    cases = [(zero == 0) & bf16_optimizer, zero == 0, (zero <= 2) & off, zero <= 2, (zero == 3) & off, zero == 3]
    entries = [BF16_OPTIMIZER_STEP, zero0, ZERO12_OFFLOAD_STEP, ZERO12_STEP[width], ZERO3_OFFLOAD_STEP,
               ZERO3_STEP[width]]

    def pick(name):
        return np.select(cases, [getattr(e, name) for e in entries], default=0.0)

    in_partition = np.minimum(tensors, tensors / d + (d > 1))
    ops = pick("per_tensor") * tensors + pick("per_partition_tensor") * in_partition + pick("once")
    return ops, pick("bytes_per_param")


def torch_adam_ops(flat, tensors, stepped, cpu: bool):
    """Ops of torch's AdamW (`torch_adam`) over one rank's step: on CPU ranks the single-tensor loop,
    TORCH_ADAMW_OPS_PER_TENSOR per stepped tensor; on a GPU the foreach ops, each launched per
    FOREACH_TENSORS_PER_LAUNCH tensors and per FOREACH_ELEMENTS_PER_LAUNCH elements. Stepped tensors: the
    stage's `tensors` where the step is not `flat` (ZeRO-0's wrappers), else one flat partition per group, ZeRO-3
    per sub-group; `stepped` elements."""
    groups = np.maximum(np.ceil(stepped / ZERO3_SUB_GROUP_ELEMENTS), 1.0)
    count = np.where(flat, groups, tensors)
    if cpu:
        return TORCH_ADAMW_OPS_PER_TENSOR * count
    launches = np.maximum(np.ceil(count / FOREACH_TENSORS_PER_LAUNCH), np.ceil(stepped / FOREACH_ELEMENTS_PER_LAUNCH))
    return TORCH_ADAMW_FOREACH_OPS * np.maximum(launches, 1.0)


@dataclass(frozen=True)
class DataParallelTraffic:
    """The data-parallel collectives DeepSpeed 0.19.8 runs for one stage, as full message bytes (what an
    all-reduce reduces, what an all-gather assembles), by when they run (docs/design.md, What DeepSpeed
    does; cost/accounting.py cites the lines). Arrays broadcast with the inputs."""

    micro_all_reduce: np.ndarray
    """Every micro-batch's backward: ZeRO-2 all-reduces its gradient buckets (average_tensor with
    use_multi_rank_bucket_allreduce)."""
    micro_reduce_scatter: np.ndarray
    """Every micro-batch's backward: ZeRO-3 reduce-scatters the gradients."""
    micro_gather_fwd: np.ndarray
    micro_gather_bwd: np.ndarray
    """ZeRO-3 gathers every parameter in each forward (a weight two modules share, once more) and
    backward."""
    step_all_reduce: np.ndarray
    """Once per step: ZeRO-0 and ZeRO-1 all-reduce the gradients (BF16_Optimizer too)."""
    step_all_gather: np.ndarray
    """After the step: ZeRO-1/2 and BF16_Optimizer all-gather the updated weights."""
    partitioned_step: np.ndarray
    """The optimizer steps the rank's 1 / d of the parameters (ZeRO >= 1, BF16_Optimizer)."""


def data_parallel_traffic(zero, pipeline, bf16: bool, weight_bytes, shared_weight_bytes=0.0,
                          trained_bytes=None, dtype_bytes=None, q=1) -> DataParallelTraffic:
    """What DeepSpeed's optimizer for ZeRO stage `zero` moves over the data-parallel group for a stage of
    `weight_bytes` (model dtype, `dtype_bytes` per element); BF16_Optimizer runs bf16 pipelines with ZeRO-0.
    `shared_weight_bytes`: a weight two modules of the stage use (ZeRO-3 gathers it for each). `trained_bytes`
    (None: all the weights): those with requires_grad, the only ones reduced and, in ZeRO-1/2's and BF16_Optimizer's
    flat groups, gathered after the step; ZeRO-3 gathers frozen weights too. `q`: the sequence-parallel degree,
    under which ZeRO-1/2 reduce in fp32 (reduces_gradients_in_fp32; `dtype_bytes` needed there)."""
    trained_bytes = weight_bytes if trained_bytes is None else trained_bytes
    zero, pipeline, weight_bytes, trained_bytes = np.broadcast_arrays(*(
        np.asarray(x, dtype=np.float64) for x in (zero, pipeline, weight_bytes, trained_bytes)))
    bf16_optimizer = runs_bf16_optimizer(zero, pipeline, bf16)
    none = np.zeros_like(weight_bytes)
    zero3 = zero == 3
    fp32_reduction = reduces_gradients_in_fp32(zero, q)
    reduced_bytes = (np.where(fp32_reduction, trained_bytes * FP32_BYTES / dtype_bytes, trained_bytes)
                     if fp32_reduction.any() else trained_bytes)
    return DataParallelTraffic(
        micro_all_reduce=np.where(zero == 2, reduced_bytes, none),
        micro_reduce_scatter=np.where(zero3, trained_bytes, none),
        micro_gather_fwd=np.where(zero3, weight_bytes + shared_weight_bytes, none),
        micro_gather_bwd=np.where(zero3, weight_bytes, none),
        step_all_reduce=np.where(zero <= 1, reduced_bytes, none),
        step_all_gather=np.where((zero == 1) | (zero == 2) | bf16_optimizer, trained_bytes, none),
        partitioned_step=(zero >= 1) | bf16_optimizer)


def moves(inputs: StageInputs) -> StageMoves:
    """What DeepSpeed 0.19.8 moves for a stage of `inputs.weight_bytes` whose `inputs.trained` elements train
    (ExecutorCapabilities.collectives 'deepspeed'; docs/design.md, What DeepSpeed does):
    - data parallel: data_parallel_traffic (ZeRO-2's per-micro-batch bucket all-reduce, the post-step
      gather of ZeRO-1/2 and BF16_Optimizer, ZeRO-3's gathers and reduce-scatters); ZeRO-3's first gather
      of a forward and last reduce-scatter of a backward hide behind no compute;
    - pipelines with t > 1 send 1 / t of each activation and gradient and re-assemble it with an
      all-gather over the TP group (pipe_partitioned / grad_partitioned): one in forward on a receiving
      stage, two in backward on a sending one (the received gradient and its own output);
    - offload moves the rank's partition (P / d): offload_param copies it in before each gather;
      gradients of ZeRO-2/3 go out every micro-batch and come back to accumulate (ZeRO-1 once, at the
      boundary, when there are several micro-batches); at the boundary the fp32 gradient goes down and the
      updated weights come up (not with offload_param: they stay on the host);
    - the step is torch's AdamW (`torch_adam`), over the rank's partition where it is partitioned, inside the
      wrapper DeepSpeed builds for the ZeRO stage and precision: their bytes and ops (step_work, torch_adam_ops);
    - offloaded activations (executor `mist`) go down in forward and come back in backward, copies that
      add to the pass (offload_overlapped is off);
    - with the reduction in the last backward (executor `mist`): executors/mist.py layerwise_reduce;
    - ZeRO-3's coordinator on the host, serial with each pass: zero3_host_s; ZeRO-1/2's gradient reduction on the
      host (zero12_host_s), serial with each backward at ZeRO-2, once at the boundary at ZeRO-1.
    """
    costs, hw, train, c, data_parallel = inputs.costs, inputs.hw, inputs.train, inputs.c, inputs.data_parallel
    weight_bytes, params, saved_offloaded = inputs.weight_bytes, inputs.trained, inputs.saved_offloaded
    b_w, ev = hw.dtype_bytes, c.shapes
    model = costs.model
    shared = np.where((c.pp == 1) & model.tie_embeddings, b_w * vocab_shard_elements(model, c), 0.0)
    traffic = data_parallel_traffic(c.zero, c.pp > 1, train.precision == "bf16", weight_bytes, shared,
                                    trained_bytes=b_w * params, dtype_bytes=b_w, q=c.q)
    layer_bytes = b_w * ev(costs.block, "params")
    layer_trained_bytes = b_w * ev(costs.block, "trainable_params")
    zero3 = c.zero == 3
    # ZeRO-3: one gather per submodule, the embedding and head one each; the reduce-scatter per reduce
    # bucket (stage3.py reduce_independent_p_g_buckets_and_remove_grads flushes a full one, :1583). ZeRO-1/2 all-reduce
    # per bucket (stage_1_and_2.py:1414-1424), ZeRO-0 and BF16_Optimizer per 5e8-element buffer.
    modules = zero3_gathers_per_block(costs)
    gathers = c.layers * modules + c.first + c.last
    bucket = reduce_bucket_elements_of(inputs.caps, inputs.caps.overlap, c.pp, c.zero, ev(costs.block, "params"))
    buckets = np.ceil(params / np.maximum(bucket, 1.0))
    buffers = np.where(c.zero >= 1, buckets, np.ceil(params / ENGINE_ALLREDUCE_ELEMENTS))
    fwd_exposed = np.where(zero3, in_pieces(data_parallel.all_gather_time_s, layer_bytes, modules), 0.0)
    bwd_exposed = np.where(zero3 & (layer_trained_bytes > 0), in_pieces(
        data_parallel.reduce_scatter_time_s, layer_trained_bytes, np.ceil(layer_trained_bytes / b_w / bucket)), 0.0)

    several = c.G > 1
    grads_every_micro = (c.go > 0) & (zero3 | ((c.zero == 2) & several))
    grads_at_boundary = (c.go > 0) & (c.zero == 1) & several
    grad_copy = hw.host_copy_time_s(c.go * b_w * params / c.d)
    weight_in = hw.host_copy_time_s(c.wo * weight_bytes / c.d)

    activations_copy = np.where(saved_offloaded > 0, hw.host_copy_time_s(saved_offloaded), 0.0)
    activation = ev(costs.block, "output_bytes")
    rebuild = np.where((c.pp > 1) & (c.t > 1), hw.all_gather_time_s(activation, c.t, 1), 0.0)
    none = np.zeros(np.broadcast(c.zero, weight_bytes).shape)

    fwd_host, bwd_host = zero3_host_s(costs, hw, c)
    step_params = np.where(traffic.partitioned_step, params / c.d, params)
    tensors = stage_trainable_tensors(costs, c, ev)
    reduction_host = zero12_host_s(hw, tensors, params)  # placed by ZeRO stage below
    wrapper_ops, wrapper_bytes = step_work(c.zero, c.pp > 1, train.precision, c.oo, train.grad_clip, tensors, c.d)
    adam_ops = torch_adam_ops(traffic.partitioned_step, tensors, step_params, hw.cluster.gpu.is_cpu_process)

    def ran(collective, message, count=1.0):  # a collective DeepSpeed does not run costs nothing, latency included
        return np.where(message > 0, in_pieces(collective, message, count), 0.0)

    return StageMoves(
        fwd_g2g=ran(data_parallel.all_gather_time_s, traffic.micro_gather_fwd, gathers),
        bwd_g2g=(ran(data_parallel.all_gather_time_s, traffic.micro_gather_bwd, gathers)
                 + ran(data_parallel.reduce_scatter_time_s, traffic.micro_reduce_scatter, buckets)
                 + ran(data_parallel.all_reduce_time_s, traffic.micro_all_reduce, buckets)),
        fwd_exposed=fwd_exposed, bwd_exposed=bwd_exposed,
        fwd_h2d=weight_in, fwd_d2h=none + activations_copy,
        bwd_h2d=weight_in + np.where(grads_every_micro & several, grad_copy, 0.0) + activations_copy,
        bwd_d2h=np.where(grads_every_micro, grad_copy, 0.0),
        fwd_tp=(1 - c.first) * rebuild, bwd_tp=2 * (1 - c.last) * rebuild, fwd_host=fwd_host,
        bwd_host=bwd_host + np.where(c.zero == 2, reduction_host, 0.0),
        step_reduce=(ran(data_parallel.all_reduce_time_s, traffic.step_all_reduce, buffers)
                     + ran(data_parallel.all_gather_time_s, traffic.step_all_gather)),
        step_params=step_params,
        # ZeRO-0 fp32 steps the weights themselves; every other wrapper's bytes include the copy into them
        step_bytes_per_param=TORCH_ADAMW_STEP_BYTES_PER_PARAM + wrapper_bytes,
        step_ops=wrapper_ops + adam_ops,
        step_host_bytes_per_param=FP32_BYTES + b_w * (1 - c.wo),
        step_copies_s=np.where(grads_at_boundary, 2 * grad_copy, 0.0),
        step_host_s=np.where(c.zero == 1, reduction_host, 0.0),
        step_gather=ran(data_parallel.all_gather_time_s, traffic.step_all_gather),
        step_gather_bytes=traffic.step_all_gather,
        **layerwise_reduce(inputs, ran, traffic.step_all_gather))
