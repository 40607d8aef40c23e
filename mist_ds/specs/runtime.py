"""What each runtime can execute and how it executes it: one capability value per runtime, read by the
cost model, the tuner, the emitter and the runtime.

The same strategy costs differently depending on the runtime that executes it (docs/design.md,
Runtimes and capabilities). Every behaviour that differs by runtime is a field here, never a
comparison of the runtime's name: an ablation passes a modified value, and a runtime cloned under
another name prices, tunes and emits exactly alike (tests/test_runtime_caps.py). A strategy a
runtime cannot run is refused by `check_runtime` with the rule's name, never priced.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Literal, Mapping

import numpy as np

from mist_ds.specs.buckets import PLANNED_REDUCE_BUCKET_ELEMENTS
from mist_ds.specs.errors import ConfigError
from mist_ds.specs.model import ModelSpec
from mist_ds.specs.strategy import StrategySpec


@dataclass(frozen=True)
class OverlapFeatures:
    """Overlap-centric schedule features (docs/design.md, The stage template); each can be on or off."""

    prefetch_weights: bool = False
    """Next layer's H2D swap-in and ZeRO-3 all-gather run while the current layer computes."""
    overlap_grad_reduce: bool = False
    """Gradient reduce-scatter / all-reduce per layer during backward, instead of after it."""
    optimizer_in_first_forward: bool = False
    """The optimizer step is split per layer and runs during the first micro-batch's forward."""
    offload_overlapped: bool = False
    """D2H swap-outs (weights, activations, grads) overlap compute instead of blocking."""
    gather_weights_in_first_forward: bool = False
    """The post-step all-gather of the updated weights runs in chunks during the next iteration's first
    forward, each layer waiting for the chunks that hold its weights (optimizer_in_first_forward
    implies it)."""


ModelStateAccounting = Literal["deepspeed", "megatron", "zero-paper"]
"""Which allocation model cost/memory.py prices model states with (its module docstring)."""
CollectiveModel = Literal["deepspeed", "ideal"]
"""Which collectives a runtime runs for data parallelism, pipelines and the optimizer step: names the module of
cost/executors that prices its data moves (cost/executors/__init__.py COLLECTIVE_EXECUTORS; docs/design.md, What
DeepSpeed does)."""


@dataclass(frozen=True)
class RuntimeCapabilities:
    name: str
    """Shown in rule names (`<name>.<rule>`) and reports; never branched on."""
    built: bool
    """mist_ds can execute plans on it (False: the cost model can price it, nothing runs it here)."""
    executes_on_deepspeed: bool
    """Plans run on DeepSpeed engines: emit writes a ds_config.json for them and the runtime takes it."""
    model_states: ModelStateAccounting
    """Model-state allocation model: 'deepspeed' (what DeepSpeed 0.19.8's engines allocate, buffers
    sized by the largest tensor), 'megatron' (Megatron-LM's DDP buffer and distributed optimizer),
    'zero-paper' (the ZeRO paper's b + b + 12 bytes per parameter)."""
    zero3_overlaps_compute: bool
    """ZeRO-3's all-gathers and reduce-scatters run on the G2G channel concurrently with compute
    (DeepSpeed's prefetch with overlap_comm; Mist's prefetch); False: they add to the pass."""
    fp32_grads_with_bf16: bool
    """In bf16 training, gradients accumulate and are all-reduced in fp32 (Megatron-LM's main_grad
    with accumulate_allreduce_grads_in_fp32); False: in the model dtype."""
    replicates_kv_heads: bool
    """A TP degree above the KV heads replicates them (Megatron-LM, Mist); False: t must divide the KV
    heads (mist_ds.runtime splits them and keeps no replicas in step)."""
    zero_stages_with_pipeline: tuple[int, ...]
    uniform_zero: bool
    """Every stage must use the same ZeRO stage."""
    uniform_ckpt: bool
    """Every stage checkpoints the same number of layers (Megatron's uniform recompute)."""
    ckpt_whole_stage_only: bool
    """Per stage c is 0 or l (DeepSpeed's checkpoint interval covers the whole stage)."""
    weights_offload: str
    """'none' | 'zero3-all' (offload_param: all or nothing, ZeRO-3) | 'fraction'."""
    grads_offload: str
    """'none' | 'with-optimizer' (go equals oo) | 'fraction'."""
    optimizer_offload: str
    """'none' | 'whole' (all or nothing, ZeRO >= 1) | 'fraction'."""
    activations_offload: bool
    schedules: tuple[str, ...]
    overlap: OverlapFeatures
    p2p_scatter_gather: bool = False
    """Inter-node pipeline sends carry 1 / t of the activation per TP rank, re-assembled by an
    intra-node all-gather (Megatron-LM's scatter/gather optimization, Narayanan et al. SC'21 4.1)."""
    collectives: CollectiveModel = "ideal"
    """'deepspeed': the collectives and copies DeepSpeed 0.19.8 runs (ZeRO-1/2 all-reduce gradient
    buckets and all-gather the updated weights after the step, BF16_Optimizer steps the rank's
    partition and all-gathers it too, pipeline sends split over TP ranks, offloaded gradients move the
    rank's partition, torch's AdamW on the device); 'ideal': each gradient byte crosses the group
    once (ring all-reduce, or reduce-scatter and all-gather), Mist's offload semantics, a fused step."""
    fused_kernels: bool = False
    """Each run of element-wise / norm / softmax ops executes as one kernel, priced by the traffic
    that leaves it (symbolic.aggregate.fused_memory_traffic), and keeps for backward only what it
    cannot recompute (fused_saved_bytes). Mist's runtime: its layers use
    FlashAttention's modules and jit-fused bias-dropout-add (held-out L4 time MAPE 2.5% fused,
    27.1% eager). False: the model's eager op stream, one kernel per op, as mist_ds's runtimes run it."""

    grad_reduce_overlap_zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages whose data-parallel gradient reduction `overlap.overlap_grad_reduce` moves into the
    last backward without a pipeline (S = 1). Runtime `mist`: ZeRO-0 by its own per-layer reducer,
    ZeRO-1 by DeepSpeed's bucketed reduction hooks with overlap_comm, one block per bucket
    (mist_ds/runtime/overlap.py)."""
    grad_reduce_overlap_zero_stages_in_pipeline: tuple[int, ...] = (0, 1, 2, 3)
    """... in a pipeline (S > 1). Runtime `mist`: ZeRO-0 only (DeepSpeed's pipelines refuse
    overlap_comm, and ZeRO-1 keeps its reduce_gradients)."""
    activations_offload_whole_blocks: bool = False
    """ao is realized as whole blocks: the stage's first round(ao x l) blocks offload all their saved
    tensors but a leaf input (mist_ds/runtime/activations.py); False: the fraction ao of every block."""
    checked_on_gpu: bool = True
    """Its schedule has run on a GPU. False: its features were checked on CPU ranks (gloo) only, where
    concurrent communicators are safe; NCCL warns against them, so the tuner does not pick it by default
    (tuner.runtime names it)."""

    @property
    def offloads_fractions(self) -> bool:
        """Weights, gradients and optimizer states offload in any fraction, and activations at all."""
        return (self.weights_offload == self.grads_offload == self.optimizer_offload == "fraction"
                and self.activations_offload)


def _deepspeed() -> RuntimeCapabilities:
    return RuntimeCapabilities(
        name="deepspeed", built=True, executes_on_deepspeed=True, model_states="deepspeed",
        zero3_overlaps_compute=True,  # stage3 prefetch with overlap_comm (emit/ds_config.py zero_block)
        fp32_grads_with_bf16=False, replicates_kv_heads=False, zero_stages_with_pipeline=(0, 1),
        # A ZeRO-0 stage beside a ZeRO-1 one runs mismatched collectives around the step
        # (BF16_Optimizer vs DeepSpeedZeroOptimizer; gloo: received 4 bytes where 1 was expected).
        uniform_zero=True, uniform_ckpt=False,
        # mist_ds.runtime recomputes exactly the last c blocks of a stage, one block at a time
        ckpt_whole_stage_only=False, weights_offload="zero3-all", grads_offload="with-optimizer",
        optimizer_offload="whole", activations_offload=False, schedules=("1f1b",),
        overlap=OverlapFeatures(), collectives="deepspeed")


def grad_reduce_overlapped(caps: RuntimeCapabilities, overlap: OverlapFeatures, pp, zero) -> np.ndarray:
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


def weight_gather_overlapped(overlap: OverlapFeatures, pp, zero, d, bf16: bool) -> np.ndarray:
    """True where a stage's post-step all-gather of the updated weights runs in chunks during the next
    first forward (overlap.gather_weights_in_first_forward, the plan's): built for BF16_Optimizer, whose
    all-gather DeepSpeed calls through an overridable method (mist_ds/runtime/gather.py), with d > 1 (at
    d = 1 nothing is gathered); no capability narrows it further. Arrays broadcast."""
    return overlap.gather_weights_in_first_forward & runs_bf16_optimizer(zero, np.asarray(pp) > 1, bf16) & \
        (np.asarray(d) > 1)


def reduced_by_deepspeed_hooks(caps: RuntimeCapabilities, overlap: OverlapFeatures, pp, zero) -> np.ndarray:
    """True where DeepSpeed's own bucketed hooks reduce the gradients during the last backward
    (overlap_comm on: ZeRO >= 1 where grad_reduce_overlapped); ZeRO-0 uses mist_ds's per-layer reducer."""
    return grad_reduce_overlapped(caps, overlap, pp, zero) & (np.asarray(zero) >= 1)


def reduce_bucket_elements_of(caps: RuntimeCapabilities, overlap: OverlapFeatures, pp, zero,
                              block_elements) -> np.ndarray:
    """Elements of the ZeRO-1/2 reduce bucket the runtime allocates (and the emitter writes): one block
    of parameters (at most the planned bucket) where DeepSpeed's own hooks reduce it during the last
    backward (grad_reduce_overlapped at ZeRO >= 1), so that each block's gradients leave as the block's
    backward ends; the planned bucket elsewhere. Arrays broadcast."""
    return np.where(reduced_by_deepspeed_hooks(caps, overlap, pp, zero),
                    np.minimum(block_elements, PLANNED_REDUCE_BUCKET_ELEMENTS), PLANNED_REDUCE_BUCKET_ELEMENTS)


def _runtimes() -> Mapping[str, RuntimeCapabilities]:
    deepspeed = _deepspeed()
    # The `mist` schedule (mist_ds/runtime/overlap.py): each overlap feature enters here once it runs and
    # its numerics equal stock DeepSpeed's (tests/test_mist_runtime.py). Built: the gradient reduction in
    # the last backward, per layer at ZeRO-0 (any S), per block-sized bucket at ZeRO-1 without a
    # pipeline; the post-step all-gather in chunks during the next first forward where BF16_Optimizer
    # steps (bf16 ZeRO-0 pipelines, d > 1; mist_ds/runtime/gather.py). It runs several communicators at
    # once (the data-parallel reduction beside the pipeline's sends and the tied sum, the gather's own):
    # checked on gloo only, so tuner.runtime stays `deepspeed` by default until a GPU (NCCL) run has
    # checked it.
    mist = replace(deepspeed, name="mist", built=True, schedules=("1f1b", "mist"),
                   overlap=OverlapFeatures(overlap_grad_reduce=True, gather_weights_in_first_forward=True),
                   grad_reduce_overlap_zero_stages=(0, 1),
                   grad_reduce_overlap_zero_stages_in_pipeline=(0,), checked_on_gpu=False,
                   activations_offload=True, activations_offload_whole_blocks=True)
    mist_paper = RuntimeCapabilities(
        name="mist-paper", built=False, executes_on_deepspeed=False, model_states="zero-paper",
        zero3_overlaps_compute=True, fp32_grads_with_bf16=False, replicates_kv_heads=True,
        zero_stages_with_pipeline=(0, 1, 2, 3),
        uniform_zero=False,
        uniform_ckpt=False, ckpt_whole_stage_only=False, weights_offload="fraction", grads_offload="fraction",
        optimizer_offload="fraction", activations_offload=True, schedules=("1f1b", "mist"),
        overlap=OverlapFeatures(prefetch_weights=True, overlap_grad_reduce=True,
                                optimizer_in_first_forward=True, offload_overlapped=True),
        fused_kernels=True)
    megatron = RuntimeCapabilities(
        name="megatron", built=False, executes_on_deepspeed=False, model_states="megatron",
        zero3_overlaps_compute=False, fp32_grads_with_bf16=True, replicates_kv_heads=True,
        zero_stages_with_pipeline=(0, 1),
        uniform_zero=True, uniform_ckpt=True,
        ckpt_whole_stage_only=False, weights_offload="none", grads_offload="none", optimizer_offload="fraction",
        activations_offload=False, schedules=("1f1b", "interleaved"),
        # The reference measurements (SC'21, vTrain) ran Megatron-LM without overlapped grad reduce.
        # Megatron fuses three patterns only (bias-GELU, bias-dropout-add, scale-mask-softmax), fewer
        # than fused_kernels assumes: refitted each way (hyperbolic GEMM curve), its measured times
        # (vTrain) fit the eager stream better: held-out MAPE 12.6% vs 13.0%, and fused needed an HBM
        # efficiency of 0.55.
        overlap=OverlapFeatures(), fused_kernels=False, p2p_scatter_gather=True)
    return MappingProxyType({r.name: r for r in (deepspeed, mist, mist_paper, megatron)})


RUNTIMES: Mapping[str, RuntimeCapabilities] = _runtimes()
DEFAULT_RUNTIME_PREFERENCE: tuple[str, ...] = ("mist", "deepspeed")
"""The tuner plans for the first of these that is built and checked on a GPU (tuner.runtime overrides)."""


def runtime_capabilities(name: str, field: str = "strategy.runtime") -> RuntimeCapabilities:
    if name not in RUNTIMES:
        raise ConfigError(field, name, f"use one of {', '.join(RUNTIMES)}")
    return RUNTIMES[name]


def capabilities_of(runtime: "str | RuntimeCapabilities", field: str = "strategy.runtime") -> RuntimeCapabilities:
    """A capability value as given (an ablation's modified copy), or the named runtime's."""
    return runtime if isinstance(runtime, RuntimeCapabilities) else runtime_capabilities(runtime, field)


def _refuse(rule: str, field: str, value, fix: str) -> ConfigError:
    return ConfigError(field, value, f"{fix} [rule {rule}]", rule=rule)


def check_runtime(strategy: StrategySpec, caps: RuntimeCapabilities | None = None,
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
                      f"runtime {name} splits KV heads over TP ranks and does not replicate them: tp must "
                      f"divide model.num_kv_heads={model.num_kv_heads}")
    if strategy.schedule not in caps.schedules:
        raise _refuse(f"{name}.schedule", "strategy.schedule", strategy.schedule,
                      f"runtime {name} runs {', '.join(caps.schedules)}")
    stages = strategy.stages
    zeros = [s.zero_stage for s in stages]
    if caps.uniform_zero and len(set(zeros)) > 1:
        raise _refuse(f"{name}.uniform-zero", "strategy.zero_stage", zeros,
                      f"runtime {name} needs one ZeRO stage for every pipeline stage")
    # Megatron's --recompute-num-layers N recomputes the first min(N, layers) blocks of every stage:
    # one count everywhere, or every layer of every stage (full) when stages are uneven.
    most = max(s.ckpt_layers for s in stages)
    if caps.uniform_ckpt and any(s.ckpt_layers != min(most, s.layers) for s in stages):
        raise _refuse(f"{name}.uniform-recompute", "strategy.ckpt_layers", [s.ckpt_layers for s in stages],
                      f"runtime {name} recomputes the same number of layers on every stage (at most a "
                      "stage's layers: min(N, layers))")
    for i, s in enumerate(stages):
        if strategy.parallelism.pp > 1 and s.zero_stage not in caps.zero_stages_with_pipeline:
            raise _refuse(f"{name}.pipeline-zero", f"strategy.zero_stage[{i}]", s.zero_stage,
                          f"runtime {name} allows ZeRO {caps.zero_stages_with_pipeline} with pipelines "
                          "(strategy.pp > 1)")
        if caps.ckpt_whole_stage_only and s.ckpt_layers not in (0, s.layers):
            raise _refuse(f"{name}.ckpt-whole-stage", f"strategy.ckpt_layers[{i}]", s.ckpt_layers,
                          f"runtime {name} checkpoints all {s.layers} layers of a stage or none")
        _check_offload(name, caps, i, s)


def _check_offload(name: str, caps: RuntimeCapabilities, i: int, s) -> None:
    wo, go, oo, ao = s.weights_offload, s.grads_offload, s.optimizer_offload, s.activations_offload
    if wo > 0:
        if caps.weights_offload == "none":
            raise _refuse(f"{name}.no-weight-offload", f"strategy.offload.weights[{i}]", wo,
                          f"runtime {name} cannot offload weights")
        if caps.weights_offload == "zero3-all" and (wo != 1.0 or s.zero_stage != 3):
            raise _refuse(f"{name}.offload-param", f"strategy.offload.weights[{i}]", wo,
                          f"runtime {name} offloads weights only all at once (1.0) and only with ZeRO-3")
        if caps.grads_offload == "fraction" and go == 0:
            raise _refuse(f"{name}.weights-need-grads-offload", f"strategy.offload.grads[{i}]", go,
                          "offloading weights needs a gradient offload ratio > 0")
    if caps.grads_offload == "none" and go > 0:
        raise _refuse(f"{name}.no-grad-offload", f"strategy.offload.grads[{i}]", go,
                      f"runtime {name} cannot offload gradients")
    if caps.grads_offload == "with-optimizer" and go != oo:
        raise _refuse(f"{name}.grads-with-optimizer", f"strategy.offload.grads[{i}]", go,
                      f"runtime {name} moves the gradient partition with the optimizer states: "
                      f"grads offload must equal optimizer offload ({oo})")
    if oo > 0:
        if caps.optimizer_offload == "none":
            raise _refuse(f"{name}.no-optimizer-offload", f"strategy.offload.optimizer[{i}]", oo,
                          f"runtime {name} cannot offload optimizer states")
        if caps.optimizer_offload == "whole":
            if s.zero_stage == 0:
                raise _refuse(f"{name}.offload-optimizer-zero", f"strategy.offload.optimizer[{i}]", oo,
                              "optimizer offload needs ZeRO >= 1")
            if oo < 1.0:
                # DeepSpeed's offload_optimizer.ratio runs only with its compiled DeepSpeedCPUAdam and
                # moves whole optimizer sub-groups (sub_group_size, 1e9 elements by default): a stage
                # smaller than one sub-group is offloaded entirely whatever the ratio.
                raise _refuse(f"{name}.offload-ratio", f"strategy.offload.optimizer[{i}]", oo,
                              f"runtime {name} offloads optimizer states all at once: use 0 or 1 "
                              "(fractions: tuner.runtime=mist-paper)")
    if ao > 0 and not caps.activations_offload:
        raise _refuse(f"{name}.no-activation-offload", f"strategy.offload.activations[{i}]", ao,
                      f"runtime {name} cannot offload activations")


def allowed_stage_options(caps: RuntimeCapabilities, layers: int, pipeline: bool, *, ckpt, zero, wo, go, oo,
                          ao) -> np.ndarray:
    """Vectorized twin of check_runtime's per-stage rules: True where one stage of `layers` blocks with
    these options (arrays) is something the runtime can execute. The uniform-across-stages rules
    (uniform_zero, uniform_ckpt) are the caller's: they couple stages."""
    ckpt, zero, wo, go, oo, ao = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64)
                                                       for x in (ckpt, zero, wo, go, oo, ao)))
    ok = np.ones(ckpt.shape, dtype=bool)
    if pipeline:
        ok &= np.isin(zero, caps.zero_stages_with_pipeline)
    if caps.ckpt_whole_stage_only:
        ok &= (ckpt == 0) | (ckpt == layers)
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
