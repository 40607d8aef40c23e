"""The rules an executor's capability row implies (docs/design.md, Executors and capabilities): `check_executor`
refuses a strategy its executor cannot run, with the rule's name, before anything is priced;
`allowed_stage_options` is its vectorized twin for the tuner's grids; the predicates below say where an overlap
feature applies to a stage. The rows themselves are data in executors.py.
"""
from __future__ import annotations

import numpy as np

from mist_ds.specs.buckets import PLANNED_REDUCE_BUCKET_ELEMENTS
from mist_ds.specs.errors import ConfigError
from mist_ds.specs.executors import (EXECUTORS, ExecutorCapabilities, OverlapFeatures, SequenceParallel,
                                     capabilities_of)
from mist_ds.specs.model import ModelSpec
from mist_ds.specs.pipeline_order import SPLIT_SCHEDULES, V_SCHEDULES
from mist_ds.specs.strategy import Parallelism, StrategySpec
from mist_ds.specs.target_rules import recompute_allowed
from mist_ds.specs.targets import DEFAULT_TARGET, TargetCapabilities, target_capabilities


def grad_reduce_overlapped(caps: ExecutorCapabilities, overlap: OverlapFeatures, pp, zero) -> np.ndarray:
    """True where a stage at ZeRO stage `zero` of a `pp`-stage pipeline reduces its gradients during
    the last backward (arrays broadcast); `overlap` is the plan's (the emitted "mist" block's)."""
    pp, zero = np.asarray(pp), np.asarray(zero)
    in_scope = np.where(pp > 1, np.isin(zero, caps.grad_reduce_overlap_zero_stages_in_pipeline),
                        np.isin(zero, caps.grad_reduce_overlap_zero_stages))
    return overlap.overlap_grad_reduce & in_scope


def runs_bf16_optimizer(zero, pipeline, bf16: bool) -> np.ndarray:
    """True where DeepSpeed 0.19.8 steps a stage with BF16_Optimizer: bf16 pipelines at ZeRO-0
    (runtime/engine.py _do_optimizer_sanity_check: equal model and accumulation dtypes, pipeline)."""
    return (np.asarray(zero) == 0) & (np.asarray(pipeline) > 0) & bool(bf16)


def reduces_gradients_in_fp32(zero, q) -> np.ndarray:
    """True where DeepSpeed 0.19.8 reduces a stage's gradients in fp32 whatever the training type: ZeRO-1/2 under
    sequence parallelism (q > 1), whose bucket all-reduce casts to fp32 then (zero/stage_1_and_2.py allreduce_bucket:
    `if pg_correctness_test or self.sequence_parallel_size > 1: communication_data_type = torch.float32`, ignoring
    seq_parallel_communication_data_type, which ZeRO-0 and ZeRO-3 follow; ZeRO-1/2 reach it through reduce_scatter,
    on by default and in the emitted config: average_tensor -> allreduce_and_scatter / allreduce_no_retain). Arrays
    broadcast."""
    return np.isin(np.asarray(zero), (1, 2)) & (np.asarray(q) > 1)


def immediate_grad_update(split_backward, bf16: bool) -> np.ndarray:
    """True where mist_ds's ds_config sets `bf16.immediate_grad_update`: bf16 under a schedule that splits the
    backward (`split_backward`: pipeline_order.SPLIT_SCHEDULES holds the strategy's schedule), so that
    BF16_Optimizer accumulates each deferred W's gradient as autograd lands it (mist_ds/emit precision_block).
    Where BF16_Optimizer runs (`runs_bf16_optimizer`) it then drops each bf16 gradient once its hook has added it
    to the accumulation buffer (bf16_optimizer.py accumulate_hp_grads_and_remove_lp): cost/memory.py prices its
    gradients without the module's .grad. Arrays broadcast."""
    return (np.asarray(split_backward) > 0) & bool(bf16)


def weight_gather_overlapped(overlap: OverlapFeatures, pp, zero, d, bf16: bool) -> np.ndarray:
    """True where a stage's post-step all-gather of the updated weights runs in chunks during the next
    first forward (overlap.gather_weights_in_first_forward, the plan's): built for BF16_Optimizer, whose
    all-gather DeepSpeed calls through an overridable method (mist_ds/runtime/gather.py), with d > 1 (at
    d = 1 nothing is gathered); no capability narrows it further. Arrays broadcast."""
    return overlap.gather_weights_in_first_forward & runs_bf16_optimizer(zero, np.asarray(pp) > 1, bf16) & \
        (np.asarray(d) > 1)


def reduced_by_deepspeed_hooks(caps: ExecutorCapabilities, overlap: OverlapFeatures, pp, zero) -> np.ndarray:
    """True where DeepSpeed's own bucketed hooks reduce the gradients during the last backward
    (overlap_comm on: ZeRO >= 1 where grad_reduce_overlapped); ZeRO-0 uses mist_ds's per-layer reducer."""
    return grad_reduce_overlapped(caps, overlap, pp, zero) & (np.asarray(zero) >= 1)


def reduce_bucket_elements_of(caps: ExecutorCapabilities, overlap: OverlapFeatures, pp, zero,
                              block_elements) -> np.ndarray:
    """Elements of the ZeRO-1/2 reduce bucket the runtime allocates (and the emitter writes): one block
    of parameters (at most the planned bucket) where DeepSpeed's own hooks reduce it during the last
    backward (grad_reduce_overlapped at ZeRO >= 1), so that each block's gradients leave as the block's
    backward ends; the planned bucket elsewhere. Arrays broadcast."""
    return np.where(reduced_by_deepspeed_hooks(caps, overlap, pp, zero),
                    np.minimum(block_elements, PLANNED_REDUCE_BUCKET_ELEMENTS), PLANNED_REDUCE_BUCKET_ELEMENTS)


def _refuse(rule: str, field: str, value, fix: str) -> ConfigError:
    return ConfigError(field, value, f"{fix} [rule {rule}]", rule=rule)


def check_schedule_built(strategy: StrategySpec, caps: ExecutorCapabilities, precision: str | None = None,
                         model: ModelSpec | None = None) -> None:
    """Refuse, before anything is emitted or run, a schedule the executor is priced with but does not run, and a
    schedule that splits the backward where the executor's split does not compose (`caps.split_backward`; the
    `precision`, train.precision, and `model` rules apply where they are given)."""
    name, schedule = caps.name, strategy.schedule
    if schedule in caps.schedules and schedule not in caps.built_schedules:
        raise _refuse(f"{name}.schedule-not-built", "strategy.schedule", schedule,
                      f"executor {name} prices {schedule} but runs only "
                      f"{', '.join(caps.built_schedules)}: use strategy.schedule=1f1b to train the plan")
    if schedule not in SPLIT_SCHEDULES:
        return
    split, par, fix = caps.split_backward, strategy.parallelism, "or train the plan with strategy.schedule=1f1b"
    if par.pp == 1:
        raise _refuse(f"{name}.split-pipeline", "strategy.pp", par.pp,
                      f"{schedule} orders a pipeline's stages and a stage of its own has no bubble to fill: "
                      f"use strategy.schedule=1f1b at pp = 1")
    if par.tp > 1 and not split.tensor_parallel:
        raise _refuse(f"{name}.split-tp", "strategy.tp", par.tp,
                      f"executor {name} runs {schedule} without tensor parallelism only: strategy.tp=1, {fix}")
    offloading = [s.activations_offload for s in strategy.stages]
    if any(offloading) and not split.activations_offload:
        raise _refuse(f"{name}.split-activation-offload", "strategy.offload.activations", offloading,
                      f"executor {name} runs {schedule} without activation offload: "
                      f"strategy.offload.activations=0, {fix}")
    if precision is not None and precision not in split.precisions:
        raise _refuse(f"{name}.split-precision", "train.precision", precision,
                      f"executor {name} runs {schedule} in {', '.join(split.precisions) or 'no precision'} only: "
                      f"train.precision={split.precisions[0] if split.precisions else 'fp32'}, {fix}")
    if model is not None and (model.hf is not None or model.module is not None) and not split.own_models:
        raise _refuse(f"{name}.split-own-model", "strategy.schedule", schedule,
                      f"executor {name} splits the backward of the zoo's models only (of an own model the GEMMs "
                      "it would defer are not all the ones priced as W): use strategy.schedule=1f1b")


def check_executor(strategy: StrategySpec, caps: ExecutorCapabilities | None = None,
                  model: ModelSpec | None = None) -> None:
    """Raise ConfigError naming the rule when `strategy` (of `model`, for the rules that need it) is
    something its runtime cannot execute."""
    caps = capabilities_of(caps or strategy.runtime)
    name = caps.name
    # a Hugging Face model is sharded by DeepSpeed AutoTP, whose own rules ModelSpec.check_tensor_parallel applies
    # (beyond the KV heads it shards unevenly; rank 0, priced, holds the largest share)
    if model is not None and model.hf is None and not caps.replicates_kv_heads and \
            model.num_kv_heads % strategy.parallelism.tp:
        raise _refuse(f"{name}.kv-heads-split", "strategy.tp", strategy.parallelism.tp,
                      f"executor {name} splits KV heads over TP ranks and does not replicate them: tp must "
                      f"divide model.num_kv_heads={model.num_kv_heads}")
    _check_sequence_parallel(name, caps.sequence_parallel, strategy.parallelism)
    _check_dual_pipe_v(strategy, caps)
    if strategy.schedule not in caps.schedules:
        raise _refuse(f"{name}.schedule", "strategy.schedule", strategy.schedule,
                      f"executor {name} runs {', '.join(caps.schedules)}")
    stages = strategy.stages
    zeros = [s.zero_stage for s in stages]
    if caps.uniform_zero and len(set(zeros)) > 1:
        raise _refuse(f"{name}.uniform-zero", "strategy.zero_stage", zeros,
                      f"executor {name} needs one ZeRO stage for every pipeline stage")
    # Megatron's --recompute-num-layers N recomputes the first min(N, layers) blocks of every stage:
    # one count everywhere, or every layer of every stage (full) when stages are uneven.
    most = max(s.ckpt_layers for s in stages)
    if caps.uniform_recompute and any(s.ckpt_layers != min(most, s.layers) for s in stages):
        raise _refuse(f"{name}.uniform-recompute", "strategy.ckpt_layers", [s.ckpt_layers for s in stages],
                      f"executor {name} recomputes the same number of layers on every stage (at most a "
                      "stage's layers: min(N, layers))")
    for i, s in enumerate(stages):
        if strategy.parallelism.pp > 1 and s.zero_stage not in caps.zero_stages_with_pipeline:
            raise _refuse(f"{name}.pipeline-zero", f"strategy.zero_stage[{i}]", s.zero_stage,
                          f"executor {name} allows ZeRO {caps.zero_stages_with_pipeline} with pipelines "
                          "(strategy.pp > 1)")
        if caps.recompute_whole_stage_only and s.ckpt_layers not in (0, s.layers):
            raise _refuse(f"{name}.recompute-whole-stage", f"strategy.ckpt_layers[{i}]", s.ckpt_layers,
                          f"executor {name} recomputes all {s.layers} blocks of a stage or none")
        _check_offload(name, caps, i, s)


def _check_sequence_parallel(name: str, rules: SequenceParallel, par: Parallelism) -> None:
    if par.sp == 1:
        return
    if not rules.priced:
        raise _refuse(f"{name}.sp", "strategy.sp", par.sp,
                      f"executor {name} is not priced with sequence parallelism: use strategy.sp=1")
    if par.pp > 1 and not rules.with_pipeline:
        raise _refuse(f"{name}.sp-pipeline", "strategy.sp", par.sp,
                      f"executor {name} runs sequence parallelism at strategy.pp=1 only (DeepSpeed Ulysses' groups "
                      f"span the whole world): use strategy.sp=1 or strategy.pp=1 (pp is {par.pp})")
    if par.tp > 1 and not rules.with_tensor_parallel:
        raise _refuse(f"{name}.sp-tp", "strategy.sp", par.sp,
                      f"executor {name} does not run sequence parallelism with tensor parallelism (Ulysses' groups "
                      f"and AutoTP's clash): use strategy.sp=1 or strategy.tp=1 (tp is {par.tp})")


def _runnable_schedules(caps: ExecutorCapabilities) -> tuple[str, ...]:
    """The schedules a refusal may point to: those the executor prices and runs (where it runs any), else prices."""
    return tuple(s for s in caps.schedules if s in caps.built_schedules) if caps.built else caps.schedules


def _check_dual_pipe_v(strategy: StrategySpec, caps: ExecutorCapabilities) -> None:
    """DeepSpeed's DualPipeV (V_SCHEDULES): refused where the executor's pricing cannot hold two chunks per rank,
    and where it can, what DualPipeVEngine asserts against (deepspeed/runtime/pipe/dualpipev.py)."""
    schedule, par, name = strategy.schedule, strategy.parallelism, caps.name
    if schedule not in V_SCHEDULES:
        return
    runnable = _runnable_schedules(caps)
    fix = f"use strategy.schedule={runnable[0]} (executor {name} {'runs' if caps.built else 'prices'} " \
          f"{', '.join(runnable)})"
    rules = caps.dual_pipe_v
    if not rules.priced:
        pricing = [n for n, row in EXECUTORS.items() if row.dual_pipe_v.priced]
        elsewhere = (f", or price it on executor {' or '.join(pricing)} (strategy.runtime={pricing[0]})"
                     if pricing else "")
        raise _refuse(f"{name}.dualpipev", "strategy.schedule", schedule,
                      f"executor {name} does not price {schedule}: DeepSpeed's DualPipeV cuts the layers into 2 x pp "
                      "chunks and places two on each pipeline rank in a V (rank r: chunks r and 2 pp - 1 - r; at tp 1, "
                      "with at least 2 x pp micro-batches, W inside the backward), while this executor's pricing "
                      f"places pp stages, one per rank, and its engine runs one chunk per rank; {fix}{elsewhere}")
    if par.pp < 2:
        raise _refuse(f"{name}.dualpipev-pipeline", "strategy.pp", par.pp,
                      f"{schedule} places a pipeline's chunks on two or more ranks: use strategy.pp >= 2, or {fix}")
    if par.tp > 1 and not rules.tensor_parallel:
        raise _refuse(f"{name}.dualpipev-tp", "strategy.tp", par.tp,
                      f"DeepSpeed splits pipeline sends over the TP ranks at tp > 1 (pipe_partitioned), which "
                      f"DualPipeV refuses: strategy.tp=1, or {fix}")
    if par.grad_accum < 2 * par.pp:
        raise _refuse(f"{name}.dualpipev-micro-batches", "strategy.grad_accum", par.grad_accum,
                      f"DualPipeV needs at least 2 x pp = {2 * par.pp} micro-batches (each rank's two chunks fill "
                      f"its warm-up): raise train.global_batch_size or lower strategy.micro_batch_size, or {fix}")


def check_sequence_parallel_built(strategy: StrategySpec, caps: ExecutorCapabilities) -> None:
    """Refuse, before a rank trains it, an sp > 1 plan the executor prices but mist_ds's runtime does not run yet."""
    if strategy.parallelism.sp > 1 and not caps.sequence_parallel.built:
        raise _refuse(f"{caps.name}.sp-not-built", "strategy.sp", strategy.parallelism.sp,
                      f"executor {caps.name} prices sequence parallelism but mist_ds.runtime does not run it yet: "
                      "train the plan with strategy.sp=1 (tune: tuner.sp=[1])")


def _check_offload(name: str, caps: ExecutorCapabilities, i: int, s) -> None:
    wo, go, oo, ao = s.weights_offload, s.grads_offload, s.optimizer_offload, s.activations_offload
    if wo > 0:
        if caps.weights_offload == "none":
            raise _refuse(f"{name}.no-weight-offload", f"strategy.offload.weights[{i}]", wo,
                          f"executor {name} cannot offload weights")
        if caps.weights_offload == "zero3-all" and (wo != 1.0 or s.zero_stage != 3):
            raise _refuse(f"{name}.offload-param", f"strategy.offload.weights[{i}]", wo,
                          f"executor {name} offloads weights only all at once (1.0) and only with ZeRO-3")
        if caps.grads_offload == "fraction" and go == 0:
            raise _refuse(f"{name}.weights-need-grads-offload", f"strategy.offload.grads[{i}]", go,
                          "offloading weights needs a gradient offload ratio > 0")
    if caps.grads_offload == "none" and go > 0:
        raise _refuse(f"{name}.no-grad-offload", f"strategy.offload.grads[{i}]", go,
                      f"executor {name} cannot offload gradients")
    if caps.grads_offload == "with-optimizer" and go != oo:
        raise _refuse(f"{name}.grads-with-optimizer", f"strategy.offload.grads[{i}]", go,
                      f"executor {name} moves the gradient partition with the optimizer states: "
                      f"grads offload must equal optimizer offload ({oo})")
    if oo > 0:
        if caps.optimizer_offload == "none":
            raise _refuse(f"{name}.no-optimizer-offload", f"strategy.offload.optimizer[{i}]", oo,
                          f"executor {name} cannot offload optimizer states")
        if caps.optimizer_offload == "whole":
            if s.zero_stage == 0:
                raise _refuse(f"{name}.offload-optimizer-zero", f"strategy.offload.optimizer[{i}]", oo,
                              "optimizer offload needs ZeRO >= 1")
            if oo < 1.0:
                # DeepSpeed's offload_optimizer.ratio runs only with its compiled DeepSpeedCPUAdam and
                # moves whole optimizer sub-groups (sub_group_size, 1e9 elements by default): a stage
                # smaller than one sub-group is offloaded entirely whatever the ratio.
                raise _refuse(f"{name}.offload-ratio", f"strategy.offload.optimizer[{i}]", oo,
                              f"executor {name} offloads optimizer states all at once: use 0 or 1 "
                              "(fractions: tuner.runtime=mist-paper)")
    if ao > 0 and not caps.activations_offload:
        raise _refuse(f"{name}.no-activation-offload", f"strategy.offload.activations[{i}]", ao,
                      f"executor {name} cannot offload activations")


def allowed_stage_options(caps: ExecutorCapabilities, layers: int, pipeline: bool, *, recompute, zero, wo, go, oo,
                          ao, target: TargetCapabilities | str = DEFAULT_TARGET) -> np.ndarray:
    """Vectorized twin of check_executor's per-stage rules and check_target's: True where one stage of `layers`
    blocks with these options (arrays) is something the runtime can execute and `target` (what consumes the plan)
    runs. The uniform-across-stages rules (uniform_zero, uniform_recompute) are the caller's: they couple stages."""
    recompute, zero, wo, go, oo, ao = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64)
                                                       for x in (recompute, zero, wo, go, oo, ao)))
    ok = recompute_allowed(target_capabilities(target), layers, recompute)
    if pipeline:
        ok &= np.isin(zero, caps.zero_stages_with_pipeline)
    if caps.recompute_whole_stage_only:
        ok &= (recompute == 0) | (recompute == layers)
    if caps.weights_offload == "none":
        ok &= wo == 0
    elif caps.weights_offload == "zero3-all":
        ok &= (wo == 0) | ((wo == 1) & (zero == 3))
    if caps.grads_offload == "fraction":
        ok &= (wo == 0) | (go > 0)
    elif caps.grads_offload == "none":
        ok &= go == 0
    elif caps.grads_offload == "with-optimizer":
        ok &= go == oo
    if caps.optimizer_offload == "none":
        ok &= oo == 0
    elif caps.optimizer_offload == "whole":
        ok &= (oo == 0) | ((zero >= 1) & (oo == 1))
    if not caps.activations_offload:
        ok &= ao == 0
    return ok
