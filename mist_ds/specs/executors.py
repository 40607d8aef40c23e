"""What each executor can execute and how it executes it: one capability row per executor, read by the cost model,
the tuner, the emitter and the runtime (docs/design.md, Executors and capabilities).

An executor is what runs a strategy (stock DeepSpeed, executor `mist` on DeepSpeed, Mist's own runtime, Megatron-LM),
chosen by the config key `strategy.runtime`. The same strategy costs differently depending on its executor. Every
behaviour that differs by executor is a field here, never a comparison of the executor's name: an ablation passes a
modified row, and a row cloned under another name prices, tunes and emits exactly alike
(tests/test_executors.py). This file is the table, data only; the rules read from it are in
executor_rules.py. Adding an executor: a row here, and its cost module under cost/executors where its data moves
differ.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Literal, Mapping

from mist_ds.specs.errors import ConfigError
from mist_ds.specs.pipeline_order import V_SCHEDULES


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


@dataclass(frozen=True)
class SplitBackward:
    """What a schedule that splits the backward into B and W (`zb-h1`, specs/pipeline_order.py SPLIT_SCHEDULES)
    composes with on an executor's engines; the emitter and the runtime refuse the rest (`<name>.split-*`,
    executor_rules.check_schedule_built). The ZeRO stages are `zero_stages_with_pipeline`'s."""

    tensor_parallel: bool = False
    """t > 1: TP's collectives of the backward stay in B and a W computes a rank's own weight-gradient shard only;
    the pipeline's sends, split over the TP ranks (DeepSpeed's pipe_partitioned / grad_partitioned), go out as
    DeepSpeed's own do. Checked on CPU ranks at tp 2 x pp 2 (tests/test_zero_bubble_runtime.py)."""
    activations_offload: bool = False
    """ao > 0: the offload's pack hooks would also save the deferred W's operands, which its one-block-ahead
    prefetch in backward does not know about."""
    precisions: tuple[str, ...] = ()
    """train.precision values it runs in. In bf16 BF16_Optimizer moves low-precision gradients into its fp32 ones
    after each backward and clears them before the next, which a W run later would miss, unless it accumulates each
    as it lands (`bf16.immediate_grad_update`, which the emitter writes for a split schedule); fp16's loss scale
    is in the output gradients W multiplies, as in B."""
    own_models: bool = False
    """A Hugging Face or user's model (family hf / module): their GEMM modules (GPT-2's Conv1D calls addmm) are not
    all `F.linear`, which is what the runtime splits, so W would not be what the cost model prices."""


@dataclass(frozen=True)
class DualPipeV:
    """Where an executor's pricing holds DeepSpeed's DualPipeV (`dualpipev`, specs/pipeline_order.py V_SCHEDULES):
    two chunks per rank in a V. executor_rules.check_executor refuses `dualpipev` before pricing where `priced` is
    False (`<name>.dualpipev`), and where it is True what DeepSpeed 0.19.8's DualPipeVEngine asserts against
    (`<name>.dualpipev-*`); `built_schedules` says whether the executor's engines run it."""

    priced: bool = False
    """Its cost model cuts the layers into 2S chunks, rank r holding chunks r and 2S - 1 - r (each with its F, B and
    memory, W inside B as DeepSpeed runs it), and the event simulator replays DualPipeVSchedule's stream. False:
    its partition model places S stages, one per rank, and simulates streams of one chunk per rank only."""
    tensor_parallel: bool = False
    """t > 1. DeepSpeed splits the pipeline's sends over the TP ranks whenever t > 1 (pipe_partitioned /
    grad_partitioned), which DualPipeVEngine refuses (`<name>.dualpipev-tp`)."""


@dataclass(frozen=True)
class SequenceParallel:
    """Where sequence parallelism (strategy.sp > 1, DeepSpeed Ulysses; docs/design.md, Glossary) composes with an
    executor's plans; executor_rules.check_executor refuses the rest (`<name>.sp-*`)."""

    priced: bool = False
    """The cost model prices sp > 1 on it: attention's all-to-alls over the sequence group, the s / sp slice of every
    other op and activation, gradients reduced over d x sp. False: any sp > 1 is refused (`<name>.sp`)."""
    with_pipeline: bool = False
    """pp > 1 with sp > 1. DeepSpeed 0.19.8's Ulysses for Hugging Face models (ALST, UlyssesSPAttentionHF) builds its
    groups over the whole world and runs with DeepSpeed's own engine at pp = 1 only."""
    with_tensor_parallel: bool = False
    """tp > 1 with sp > 1. Ulysses' sequence groups are consecutive ranks over the data group and AutoTP installs
    groups of its own (tried: "Data inconsistency within the TP group")."""
    built: bool = False
    """mist_ds's runtime trains sp > 1 plans on it (DeepSpeed's DistributedAttention / UlyssesSPAttentionHF
    installed). False: priced and planned, but mist_ds.runtime refuses them (`<name>.sp-not-built`)."""


ModelStateAccounting = Literal["deepspeed", "megatron", "zero-paper"]
"""Which allocation model cost/memory.py prices model states with (its module docstring)."""
CollectiveModel = Literal["deepspeed", "ideal"]
"""Which collectives an executor runs for data parallelism, pipelines and the optimizer step: names the module of
cost/executors that prices its data moves (cost/executors/__init__.py COLLECTIVE_EXECUTORS; docs/design.md, What
DeepSpeed does)."""


@dataclass(frozen=True)
class ExecutorCapabilities:
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
    uniform_recompute: bool
    """Every stage recomputes the same number of blocks (Megatron's uniform recompute)."""
    recompute_whole_stage_only: bool
    """Per stage c is 0 or l (DeepSpeed's activation-checkpointing interval covers the whole stage)."""
    weights_offload: str
    """'none' | 'zero3-all' (offload_param: all or nothing, ZeRO-3) | 'fraction'."""
    grads_offload: str
    """'none' | 'with-optimizer' (go equals oo) | 'fraction'."""
    optimizer_offload: str
    """'none' | 'whole' (all or nothing, ZeRO >= 1) | 'fraction'."""
    activations_offload: bool
    schedules: tuple[str, ...]
    """Schedules it is priced with (docs/design.md, Glossary: the order of a pipeline's work)."""
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
    last backward without a pipeline (S = 1). Executor `mist`: ZeRO-0 by its own per-layer reducer,
    ZeRO-1 by DeepSpeed's bucketed reduction hooks with overlap_comm, one block per bucket
    (mist_ds/runtime/overlap.py)."""
    grad_reduce_overlap_zero_stages_in_pipeline: tuple[int, ...] = (0, 1, 2, 3)
    """... in a pipeline (S > 1). Executor `mist`: ZeRO-0 only (DeepSpeed's pipelines refuse
    overlap_comm, and ZeRO-1 keeps its reduce_gradients)."""
    activations_offload_whole_blocks: bool = False
    """ao is realized as whole blocks: the stage's first round(ao x l) blocks offload all their saved
    tensors but a leaf input (mist_ds/runtime/activations.py); False: the fraction ao of every block."""
    runs_on_stock_engine: bool = False
    """Its pp = 1 plans run as priced on the engine stock `deepspeed.initialize` builds from ds_config.json alone, as
    a consumer that builds its own engine calls it (HF Trainer; TargetCapabilities.stock_engine); False: they need
    mist_ds.runtime's schedule."""
    built_schedules: tuple[str, ...] = ("1f1b", "mist", "interleaved")
    """Of `schedules`, those its engines run (where `built`): a plan with another is priced, and refused by the
    emitter and the runtime (`<name>.schedule-not-built`)."""
    split_backward: SplitBackward = SplitBackward()
    """Where a built schedule splits the backward (zb-h1): what it composes with."""
    dual_pipe_v: DualPipeV = DualPipeV()
    """Whether it prices DeepSpeed's DualPipeV (`dualpipev`: two chunks per rank in a V) and what it composes with."""
    sequence_parallel: SequenceParallel = SequenceParallel()
    """Where sequence parallelism (sp > 1) composes with its plans."""
    checked_on_gpu: bool = True
    """Its schedule has run on a GPU. False: its features were checked on CPU ranks (gloo) only, where
    concurrent communicators are safe; NCCL warns against them, so the tuner does not pick it by default
    (tuner.runtime names it)."""

    def __post_init__(self) -> None:
        # One truth for "priced": `schedules` lists what the cost model prices, so an ablation that prices dualpipev
        # must say so in both places or the rules and the simulator would disagree.
        priced = any(s in V_SCHEDULES for s in self.schedules)
        if priced != self.dual_pipe_v.priced:
            raise ValueError(f"executor {self.name}: dual_pipe_v.priced={self.dual_pipe_v.priced} but schedules "
                             f"{self.schedules} {'list' if priced else 'do not list'} {', '.join(V_SCHEDULES)}")

    @property
    def runs_profiled_layers(self) -> bool:
        """Its plans run mist_ds's own layers op by op (on DeepSpeed, unfused): the layers `mist-ds profile` times
        whole, so a pass the profile database holds is priced at its measured time (cost/layer_time.py)."""
        return self.executes_on_deepspeed and not self.fused_kernels

    @property
    def offloads_fractions(self) -> bool:
        """Weights, gradients and optimizer states offload in any fraction, and activations at all."""
        return (self.weights_offload == self.grads_offload == self.optimizer_offload == "fraction"
                and self.activations_offload)


def _deepspeed() -> ExecutorCapabilities:
    return ExecutorCapabilities(
        name="deepspeed", built=True, executes_on_deepspeed=True, model_states="deepspeed",
        zero3_overlaps_compute=True,  # stage3 prefetch with overlap_comm (emit/ds_config.py zero_block)
        fp32_grads_with_bf16=False, replicates_kv_heads=False, zero_stages_with_pipeline=(0, 1),
        # A ZeRO-0 stage beside a ZeRO-1 one runs mismatched collectives around the step
        # (BF16_Optimizer vs DeepSpeedZeroOptimizer; gloo: received 4 bytes where 1 was expected).
        uniform_zero=True, uniform_recompute=False,
        # mist_ds.runtime recomputes exactly the last c blocks of a stage, one block at a time
        recompute_whole_stage_only=False, weights_offload="zero3-all", grads_offload="with-optimizer",
        optimizer_offload="whole", activations_offload=False,
        # DualPipeV is priced on the engine it would run on, DeepSpeed's own (DualPipeVEngine subclasses
        # PipelineEngine), and not run: mist_ds.runtime builds no DualPipeVModule from a plan's layers yet
        schedules=("1f1b", "dualpipev"), built_schedules=("1f1b",), dual_pipe_v=DualPipeV(priced=True),
        overlap=OverlapFeatures(), collectives="deepspeed", runs_on_stock_engine=True,
        # Ulysses' all-to-alls, the s / q slices and the d q data group (mist_ds/cost/sequence.py), at pp = 1 and
        # tp = 1 only: DeepSpeed 0.19.8 runs it there (SequenceParallel's fields say why not elsewhere). Run on the
        # zoo's models by mist_ds.runtime (mist_ds/runtime/sequence.py; tests/test_sequence_parallel_runtime.py: the
        # census equals this pricing); a Hugging Face model's is mist_ds.initialize's (rule runtime.hf-sp there).
        sequence_parallel=SequenceParallel(priced=True, built=True))


def _executors() -> Mapping[str, ExecutorCapabilities]:
    deepspeed = _deepspeed()
    # The `mist` schedule (mist_ds/runtime/overlap.py): each overlap feature enters here once it runs and
    # its numerics equal stock DeepSpeed's (tests/test_mist_runtime.py). Built: the gradient reduction in
    # the last backward, per layer at ZeRO-0 (any S), per block-sized bucket at ZeRO-1 without a
    # pipeline; the post-step all-gather in chunks during the next first forward where BF16_Optimizer
    # steps (bf16 ZeRO-0 pipelines, d > 1; mist_ds/runtime/gather.py). It runs several communicators at
    # once (the data-parallel reduction beside the pipeline's sends and the tied sum, the gather's own):
    # checked on gloo only, so tuner.runtime stays `deepspeed` by default until a GPU (NCCL) run has
    # checked it.
    # ZB-H1 (mist_ds/cost/executors/zero_bubble.py) is priced on it and runs (mist_ds/runtime/zero_bubble.py) in
    # fp32, bf16 and fp16 on the zoo's models, with TP, without activation offload (SplitBackward says why not).
    # DualPipeV would run on DeepSpeed's DualPipeVEngine, not on executor mist's MistPipelineEngine: not priced here
    mist = replace(deepspeed, name="mist", built=True, schedules=("1f1b", "mist", "zb-h1"),
                   built_schedules=("1f1b", "mist", "zb-h1"), dual_pipe_v=DualPipeV(),
                   split_backward=SplitBackward(tensor_parallel=True, precisions=("fp32", "bf16", "fp16")),
                   overlap=OverlapFeatures(overlap_grad_reduce=True, gather_weights_in_first_forward=True),
                   grad_reduce_overlap_zero_stages=(0, 1),
                   grad_reduce_overlap_zero_stages_in_pipeline=(0,), checked_on_gpu=False, runs_on_stock_engine=False,
                   activations_offload=True, activations_offload_whole_blocks=True,
                   # priced as deepspeed's, not run: its ZeRO-0 per-layer reducer (runtime/overlap.py) averages over
                   # the d q ranks where DeepSpeed averages over d (the 1 / q a gradient clip would see)
                   sequence_parallel=SequenceParallel(priced=True, built=False))
    mist_paper = ExecutorCapabilities(
        name="mist-paper", built=False, executes_on_deepspeed=False, model_states="zero-paper",
        zero3_overlaps_compute=True, fp32_grads_with_bf16=False, replicates_kv_heads=True,
        zero_stages_with_pipeline=(0, 1, 2, 3),
        uniform_zero=False,
        uniform_recompute=False, recompute_whole_stage_only=False, weights_offload="fraction", grads_offload="fraction",
        optimizer_offload="fraction", activations_offload=True, schedules=("1f1b", "mist"),
        overlap=OverlapFeatures(prefetch_weights=True, overlap_grad_reduce=True,
                                optimizer_in_first_forward=True, offload_overlapped=True),
        fused_kernels=True)
    megatron = ExecutorCapabilities(
        name="megatron", built=False, executes_on_deepspeed=False, model_states="megatron",
        zero3_overlaps_compute=False, fp32_grads_with_bf16=True, replicates_kv_heads=True,
        zero_stages_with_pipeline=(0, 1),
        uniform_zero=True, uniform_recompute=True,
        recompute_whole_stage_only=False, weights_offload="none", grads_offload="none", optimizer_offload="fraction",
        activations_offload=False, schedules=("1f1b", "interleaved"),
        # The reference measurements (SC'21, vTrain) ran Megatron-LM without overlapped grad reduce.
        # Megatron fuses three patterns only (bias-GELU, bias-dropout-add, scale-mask-softmax), fewer
        # than fused_kernels assumes: refitted each way (hyperbolic GEMM curve), its measured times
        # (vTrain) fit the eager stream better: held-out MAPE 12.6% vs 13.0%, and fused needed an HBM
        # efficiency of 0.55.
        overlap=OverlapFeatures(), fused_kernels=False, p2p_scatter_gather=True)
    return MappingProxyType({r.name: r for r in (deepspeed, mist, mist_paper, megatron)})


EXECUTORS: Mapping[str, ExecutorCapabilities] = _executors()
DEFAULT_EXECUTOR_PREFERENCE: tuple[str, ...] = ("mist", "deepspeed")
"""The tuner plans for the first of these that is built and checked on a GPU (tuner.runtime overrides)."""


def executor_capabilities(name: str, field: str = "strategy.runtime") -> ExecutorCapabilities:
    if name not in EXECUTORS:
        raise ConfigError(field, name, f"use one of {', '.join(EXECUTORS)}")
    return EXECUTORS[name]


def capabilities_of(executor: "str | ExecutorCapabilities", field: str = "strategy.runtime") -> ExecutorCapabilities:
    """A capability row as given (an ablation's modified copy), or the named executor's."""
    return executor if isinstance(executor, ExecutorCapabilities) else executor_capabilities(executor, field)


