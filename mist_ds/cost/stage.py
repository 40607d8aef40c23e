"""The stage template: per-stage stable time, first/last micro-batch extra (delta), end-of-iteration
work, and peak memory, for arrays of candidate strategies on a given runtime (docs/design.md, The stage template).

Symbols: b micro-batch, s sequence, t TP, d data parallel, S stages (pp), G micro-batches, i stage
index, l layers, c checkpointed layers, z ZeRO stage, wo / go / oo / ao offload fractions.
Every input broadcasts; every output is an array of seconds or bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np

from mist_ds.cost.layer_time import LayerTimes, layer_times
from mist_ds.cost.memory import FP32_BYTES, model_state_bytes
from mist_ds.hardware import HardwareModel
from mist_ds.specs import ModelSpec, RuntimeCapabilities, TrainSpec, grad_reduce_overlapped, weight_gather_overlapped
from mist_ds.specs.runtime import reduce_bucket_elements_of, reduced_by_deepspeed_hooks, runs_bf16_optimizer
from mist_ds.symbolic import LayerCost

# Adam step traffic per parameter (fused, memory-bound): read + write fp32 master, exp_avg and
# exp_avg_sq (24 bytes), read the fp32 gradient (4); the low-precision weight write is added per dtype.
ADAM_STEP_BYTES_PER_PARAM = 28
# torch's AdamW as DeepSpeed runs it with `torch_adam: true` (foreach on a GPU, torch/optim/adam.py
# _multi_tensor_adam; the single-tensor loop elsewhere does the same passes): eight passes over fp32
# tensors, each reading and writing whole tensors: weight decay on p (r+w, 8), lerp of exp_avg with g
# (12), exp_avg_sq *= beta2 (8), addcmul with g twice (16), sqrt into a new tensor (8), div (8), add eps
# (8), addcdiv into p (16).
TORCH_ADAMW_STEP_BYTES_PER_PARAM = 84
# Gradient-norm / overflow check: one scalar all-reduced across every GPU.
NORM_MESSAGE_BYTES = 8
# A partitioned pipeline send's header: PartitionedTensor.to_meta, nine int64 (deepspeed/runtime/utils.py).
PARTITION_META_BYTES = 72


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
                          trained_bytes=None) -> DataParallelTraffic:
    """What DeepSpeed's optimizer for ZeRO stage `zero` moves over the data-parallel group for a stage of
    `weight_bytes` (model dtype); BF16_Optimizer runs bf16 pipelines with ZeRO-0. `shared_weight_bytes`:
    a weight two modules of the stage use (ZeRO-3 gathers it for each). `trained_bytes` (None: all the
    weights): those with requires_grad, the only ones reduced and, in ZeRO-1/2's and BF16_Optimizer's flat
    groups, gathered after the step; ZeRO-3 gathers frozen weights too."""
    trained_bytes = weight_bytes if trained_bytes is None else trained_bytes
    zero, pipeline, weight_bytes, trained_bytes = np.broadcast_arrays(*(
        np.asarray(x, dtype=np.float64) for x in (zero, pipeline, weight_bytes, trained_bytes)))
    bf16_optimizer = runs_bf16_optimizer(zero, pipeline, bf16)
    none = np.zeros_like(weight_bytes)
    zero3 = zero == 3
    return DataParallelTraffic(
        micro_all_reduce=np.where(zero == 2, trained_bytes, none),
        micro_reduce_scatter=np.where(zero3, trained_bytes, none),
        micro_gather_fwd=np.where(zero3, weight_bytes + shared_weight_bytes, none),
        micro_gather_bwd=np.where(zero3, weight_bytes, none),
        step_all_reduce=np.where(zero <= 1, trained_bytes, none),
        step_all_gather=np.where((zero == 1) | (zero == 2) | bf16_optimizer, trained_bytes, none),
        partitioned_step=(zero >= 1) | bf16_optimizer)


@dataclass(frozen=True)
class StageCandidates:
    """Arrays (broadcast together) describing one pipeline stage of each candidate strategy."""

    b: np.ndarray
    s: np.ndarray
    t: np.ndarray
    d: np.ndarray
    pp: np.ndarray
    G: np.ndarray
    stage: np.ndarray
    layers: np.ndarray
    ckpt: np.ndarray
    zero: np.ndarray
    wo: np.ndarray
    go: np.ndarray
    oo: np.ndarray
    ao: np.ndarray
    v: np.ndarray
    """Model chunks per stage (interleaved 1F1B; 1 otherwise)."""

    @classmethod
    def of(cls, **values) -> "StageCandidates":
        """Arrays broadcast together; `v` defaults to 1 (no interleaving)."""
        values = {"v": 1, **values}
        arrays = np.broadcast_arrays(*(np.asarray(values[f.name], dtype=np.float64) for f in fields(cls)))
        return cls(*arrays)

    # Derived arrays are cached: time and memory of the same candidates share them.
    @cached_property
    def first(self) -> np.ndarray:
        return (self.stage == 0).astype(np.float64)

    @cached_property
    def last(self) -> np.ndarray:
        return (self.stage == self.pp - 1).astype(np.float64)

    @cached_property
    def shapes(self) -> "ShapeIndex":
        return ShapeIndex(self)

    @cached_property
    def _derived(self) -> dict:
        return {}

    def derived(self, name: str, source, compute):
        """compute(), once per (name, source) for these candidates: time and memory share what both
        derive (the source, kept with the value, is what it was derived from)."""
        key = (name, id(source))
        if key not in self._derived:
            self._derived[key] = (source, compute())
        return self._derived[key][1]


class ShapeIndex:
    """Layer costs depend on (b, s, t) only, which take few distinct values among many candidates:
    evaluate each quantity once per distinct triple and spread it back."""

    def __init__(self, c: "StageCandidates") -> None:
        # One integer key per (b, s, t): sorting integers is ~40x faster than rows (np.unique axis=0).
        s_span, t_span = c.s.max() + 1, c.t.max() + 1
        keys = ((c.b * s_span + c.s) * t_span + c.t).astype(np.int64).ravel()
        unique, inverse = np.unique(keys, return_inverse=True)
        self.inverse = inverse.reshape(c.b.shape)
        self.t = (unique % int(t_span)).astype(np.float64)
        self.s = ((unique // int(t_span)) % int(s_span)).astype(np.float64)
        self.b = (unique // int(t_span * s_span)).astype(np.float64)
        self._memo: dict[tuple[int, str], tuple[LayerCost, np.ndarray]] = {}

    def __call__(self, cost: LayerCost, key: str) -> np.ndarray:
        """cost's `key` on every candidate; memoized, as time and memory read the same quantities."""
        memo_key = (id(cost), key)
        if memo_key not in self._memo:  # the cost is kept with its value: its id cannot be reused
            self._memo[memo_key] = (cost, cost(key, self.b, self.s, self.t)[self.inverse])
        return self._memo[memo_key][1]

    def spread(self, values: np.ndarray) -> np.ndarray:
        return values[self.inverse]


@dataclass(frozen=True)
class ModelCosts:
    model: ModelSpec
    embedding: LayerCost
    block: LayerCost
    head: LayerCost


@dataclass(frozen=True)
class StageTimes:
    stable_s: np.ndarray
    """Steady forward + backward of one micro-batch, everything included (TP, p2p, swaps)."""
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    """The two halves of stable_s (p2p and TP collectives split by pass)."""
    delta_s: np.ndarray
    """(first forward + last backward) - stable: the runtime's once-per-iteration extras."""
    first_fwd_extra_s: np.ndarray
    last_bwd_extra_s: np.ndarray
    end_s: np.ndarray
    """Work after the stage's last backward before the step completes (runtimes with a tail)."""
    compute_s: np.ndarray
    recompute_s: np.ndarray
    tp_s: np.ndarray
    p2p_s: np.ndarray
    dp_comm_s: np.ndarray
    swap_s: np.ndarray
    optimizer_s: np.ndarray
    grad_reduce_s: np.ndarray


@dataclass(frozen=True)
class StageMemory:
    peak_bytes: np.ndarray
    weights: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    transient: np.ndarray
    buffers: np.ndarray
    host_bytes: np.ndarray
    in_flight: np.ndarray
    """Micro-batches in flight at the peak: `activations` and `host_activations` are per micro-batch x this."""
    host_activations: np.ndarray
    state_buffers: np.ndarray
    """The model states' own buffers (reduce buckets, step gradients, staging): `buffers` without the
    p2p buffers, the gathered ZeRO-3 layers and the step's excess."""
    state_host: np.ndarray
    """Model-state bytes on the host (offloaded optimizer, gradients, weights): `host_bytes` without
    the offloaded activations."""


def stage_params(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex) -> np.ndarray:
    """Parameters on one GPU of the stage (its TP shard); a tied head shares the embedding at S = 1.
    Derived once per candidates (time and memory both read it)."""
    return c.derived("params", costs, lambda: _stage_params(costs, c, ev))


def stage_trainable_params(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex) -> np.ndarray:
    """Of stage_params, the elements with requires_grad: what gets gradients, optimizer states and data-parallel
    reductions (a frozen parameter holds its weight only)."""
    return c.derived("trainable_params", costs,
                     lambda: _stage_params(costs, c, ev, "trainable_params", costs.model.trains_vocab()))


def _stage_params(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex, key: str = "params",
                  counts_vocab: bool = True) -> np.ndarray:
    """The layers' `key` elements summed over the stage; a tied vocabulary matrix the embedding and the head both
    count (where `counts_vocab`) once at S = 1."""
    params = (c.layers * ev(costs.block, key) + c.first * ev(costs.embedding, key) + c.last * ev(costs.head, key))
    if costs.model.tie_embeddings and counts_vocab:
        params = params - np.where((c.pp == 1), vocab_shard_elements(costs.model, c), 0.0)
    return params


def _times(costs: ModelCosts, hw: HardwareModel, ev: ShapeIndex,
           fused: bool) -> tuple[LayerTimes, LayerTimes, LayerTimes]:
    out = []
    for cost in (costs.embedding, costs.block, costs.head):
        unique = layer_times(cost, hw, ev.b, ev.s, ev.t, fused)
        out.append(LayerTimes(*(ev.spread(getattr(unique, f.name)) for f in fields(LayerTimes))))
    return tuple(out)


def _p2p_s(costs: ModelCosts, hw: HardwareModel, c: StageCandidates, ev: ShapeIndex,
           scatter_gather: bool, partitioned: bool = False) -> np.ndarray:
    """Blocking send / recv of activations (forward) and their gradients (backward), per micro-batch.

    Stage i's ranks are [i t d, (i + 1) t d): a boundary crosses nodes when a stage fills whole
    nodes or the boundary falls on a node edge. `partitioned`: with t > 1 each TP rank sends its 1 / t
    slice after a PARTITION_META_BYTES message (DeepSpeed's pipe_partitioned / grad_partitioned; the
    receiver's re-assembly is a TP collective, _deepspeed_moves).
    """
    message = ev(costs.block, "output_bytes")
    cross_prev, cross_next = stage_boundaries_cross_nodes(c.stage, c.t * c.d, hw.cluster.gpus_per_node)

    def send(cross):
        if partitioned:
            split = hw.p2p_time_s(message / c.t, cross) + hw.p2p_time_s(PARTITION_META_BYTES, cross)
            return np.where(c.t > 1, split, hw.p2p_time_s(message, cross))
        if not scatter_gather:
            return hw.p2p_time_s(message, cross)
        # A TP rank sends its 1 / t slice across nodes; the receivers all-gather it over NVLink.
        split = hw.p2p_time_s(message / c.t, cross) + hw.all_gather_time_s(message, c.t, 1)
        return np.where(cross & (c.t > 1), split, hw.p2p_time_s(message, cross))

    # np.where, not a product: a single node has no inter-node bandwidth (infinite time) and the first
    # stage has no previous boundary at all.
    to_next = np.where(c.last > 0, 0.0, send(cross_next & (c.last == 0)))
    from_prev = np.where(c.first > 0, 0.0, send(cross_prev & (c.first == 0)))
    # Interleaved: every chunk crosses each boundary, and v - 1 chunks wrap from the last stage to
    # the first (the same node only when the whole pipeline fits in one).
    if not np.any(c.v > 1):
        return 2 * (to_next + from_prev)  # each: activation forward, its gradient backward
    wrap = send(c.pp * c.t * c.d > hw.cluster.gpus_per_node)
    wraps = np.where((c.first + c.last) > 0, (c.v - 1) * wrap, 0.0)
    return 2 * (c.v * (to_next + from_prev) + wraps)


def stage_boundaries_cross_nodes(stage, width, gpus_per_node) -> tuple[np.ndarray, np.ndarray]:
    """(previous boundary, next boundary) of stage `stage` cross a node edge, when each stage holds
    `width` = t d consecutive ranks."""
    stage, width = np.asarray(stage, dtype=np.float64), np.asarray(width, dtype=np.float64)
    whole = width >= gpus_per_node

    def on_node_edge(rank):  # rank % gpus_per_node == 0, without the (slow) float remainder
        return np.floor(rank / gpus_per_node) * gpus_per_node == rank

    return whole | on_node_edge(stage * width), whole | on_node_edge((stage + 1) * width)


def in_flight_micro_batches(stage, pp, grad_accum, chunks=1) -> np.ndarray:
    """Micro-batches' worth of activations stage `stage` holds at its peak: 1F1B, min(S - i - 1, G - 1)
    + 1; interleaved with v chunks, Megatron-LM's warm-up of 2 (S - i - 1) + (v - 1) S chunk forwards
    plus one, at most G v, each chunk 1 / v of the stage."""
    stage, pp, grad_accum, chunks = (np.asarray(x, dtype=np.float64) for x in (stage, pp, grad_accum, chunks))
    one_f_one_b = np.minimum(pp - stage - 1, grad_accum - 1) + 1
    if not np.any(chunks > 1):
        return one_f_one_b
    interleaved = np.minimum(2 * (pp - stage - 1) + (chunks - 1) * pp + 1, grad_accum * chunks) / chunks
    return np.where(chunks > 1, interleaved, one_f_one_b)


def _saved_bytes(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex,
                 caps: RuntimeCapabilities) -> tuple[np.ndarray, np.ndarray]:
    """Activation bytes one micro-batch leaves for backward on the stage, and the part offloaded;
    fused: the blocks keep what fused kernels keep (RuntimeCapabilities.fused_kernels). The ends
    stay eager: the L4 rows' last stages (vocabulary-parallel loss) match the eager count. Derived once
    per candidates (time and memory both read it)."""
    fused, whole = caps.fused_kernels, caps.activations_offload_whole_blocks
    return c.derived(f"saved fused={fused} whole={whole}", costs,
                     lambda: _stage_saved_bytes(costs, c, ev, fused, whole))


def offloaded_blocks(c: StageCandidates) -> np.ndarray:
    """round(ao x l), halves up: the blocks a whole-block activation offload moves (runtime `mist`,
    mist_ds/runtime/activations.py offloaded_block_count)."""
    return np.floor(c.ao * c.layers + 0.5)


def _stage_saved_bytes(costs: ModelCosts, c: StageCandidates, ev: ShapeIndex, fused: bool,
                       whole_blocks: bool) -> tuple[np.ndarray, np.ndarray]:
    full = ev(costs.block, "saved_bytes_fused" if fused else "saved_bytes")
    ckpt = ev(costs.block, "saved_bytes_ckpt")
    blocks = (c.layers - c.ckpt) * full + c.ckpt * ckpt
    ends = c.first * ev(costs.embedding, "saved_bytes") + c.last * ev(costs.head, "saved_bytes")
    if not whole_blocks:
        return blocks + ends, blocks * c.ao
    # The first k blocks: the stage's non-recomputed blocks come first, then recomputed ones (which keep
    # their input only). A leaf input stays where it is: on a stage after the first with t > 1, block 0's
    # input is the activation DeepSpeed rebuilds from its TP parts into its pipe buffers (a leaf); with
    # t = 1 it is a clone of the receive buffer (pipe/engine.py:702-705) and goes (saved_bytes_ckpt is a
    # block's input).
    k = offloaded_blocks(c)
    kept_full = np.minimum(k, c.layers - c.ckpt)
    receive_buffer = np.where((k > 0) & (c.first == 0) & (c.t > 1), ckpt, 0.0)
    return blocks + ends, kept_full * full + (k - kept_full) * ckpt - receive_buffer


def stage_times(costs: ModelCosts, hw: HardwareModel, caps: RuntimeCapabilities, train: TrainSpec,
                c: StageCandidates) -> StageTimes:
    ev = c.shapes
    emb, block, head = _times(costs, hw, ev, caps.fused_kernels)
    overlap = caps.overlap
    fwd_compute = c.layers * block.fwd_compute_s + c.first * emb.fwd_compute_s + c.last * head.fwd_compute_s
    recompute = c.ckpt * block.fwd_compute_s
    bwd_compute = c.layers * block.bwd_compute_s + c.first * emb.bwd_compute_s + c.last * head.bwd_compute_s
    fwd_tp = c.layers * block.fwd_tp_s + c.first * emb.fwd_tp_s + c.last * head.fwd_tp_s
    bwd_tp = c.layers * block.bwd_tp_s + c.ckpt * block.fwd_tp_s + c.first * emb.bwd_tp_s + c.last * head.bwd_tp_s
    p2p = _p2p_s(costs, hw, c, ev, caps.p2p_scatter_gather, partitioned=caps.collectives == "deepspeed")

    params = stage_params(costs, c, ev)
    trained = stage_trainable_params(costs, c, ev)  # what has gradients, optimizer states and is stepped
    b_w = hw.dtype_bytes
    weight_bytes = b_w * params
    data_parallel = hw.group(c.d, c.t)
    saved, saved_offloaded = _saved_bytes(costs, c, ev, caps)
    grad_bytes = FP32_BYTES if caps.fp32_grads_with_bf16 and train.precision == "bf16" else b_w
    if caps.collectives == "deepspeed":
        moves = _deepspeed_moves(costs, hw, caps, train, c, data_parallel, weight_bytes, trained, saved_offloaded)
    else:
        moves = _ideal_moves(hw, c, data_parallel, weight_bytes, grad_bytes * trained, trained, saved_offloaded)
    fwd_g2g, bwd_g2g = moves.fwd_g2g, moves.bwd_g2g
    fwd_h2d, fwd_d2h, bwd_h2d, bwd_d2h = moves.fwd_h2d, moves.fwd_d2h, moves.bwd_h2d, moves.bwd_d2h
    fwd_tp, bwd_tp = fwd_tp + moves.fwd_tp, bwd_tp + moves.bwd_tp
    tp = fwd_tp + bwd_tp
    swap = fwd_h2d + fwd_d2h + bwd_h2d + bwd_d2h

    g2g_overlapped = caps.zero3_overlaps_compute
    if overlap.offload_overlapped:
        fwd_phase = hw.overlapped_time_s(fwd_compute, fwd_g2g, fwd_h2d, fwd_d2h)
        bwd_phase = hw.overlapped_time_s(bwd_compute + recompute, bwd_g2g, bwd_h2d, bwd_d2h)
    else:
        # What cannot overlap: the pass's first gather waits for nothing to hide behind, its last
        # reduce-scatter follows the last compute (moves.*_exposed; 0 where prefetch is perfect).
        fwd_hidden, bwd_hidden = fwd_g2g - moves.fwd_exposed, bwd_g2g - moves.bwd_exposed
        fwd_phase = np.where(g2g_overlapped & (c.zero == 3),
                             hw.overlapped_time_s(fwd_compute, fwd_hidden, 0, 0) + moves.fwd_exposed,
                             fwd_compute + fwd_g2g) + fwd_h2d + fwd_d2h
        bwd_phase = (np.where(g2g_overlapped & (c.zero == 3),
                              hw.overlapped_time_s(bwd_compute + recompute, bwd_hidden, 0, 0) + moves.bwd_exposed,
                              bwd_compute + recompute + bwd_g2g) + bwd_h2d + bwd_d2h)
    stable = fwd_phase + bwd_phase + tp + p2p

    # End of iteration: gradient reduction over data parallel and the optimizer step.
    reduce, partition, step_bytes = moves.step_reduce, moves.step_params, moves.step_bytes_per_param
    gpu_step = hw.memory_bound_time_s((step_bytes + b_w) * partition * (1 - c.oo))
    cpu_step = hw.cpu_adam_time_s(partition * c.oo) + hw.host_copy_time_s(moves.step_host_bytes_per_param
                                                                          * partition * c.oo)
    step = gpu_step + cpu_step + moves.step_copies_s
    tied = np.where((c.pp > 1) & costs.model.tie_embeddings & ((c.first + c.last) > 0),
                    hw.all_reduce_time_s(b_w * vocab_shard_elements(costs.model, c), 2,
                                         c.t * c.d * (c.pp - 1)), 0.0)

    if overlap.optimizer_in_first_forward:
        # Mist: the step runs per layer inside the first forward, the reduction inside the last
        # backward; both overlap that pass's compute on their own channels. The gradient crosses
        # the data-parallel group once and the updated weights once: ZeRO-0 all-reduces; ZeRO-1
        # reduce-scatters and all-gathers the updated shard; ZeRO-2 has reduce-scattered every
        # micro-batch (bwd_g2g) and all-gathers; ZeRO-3 gathers every forward anyway (fwd_g2g).
        step_reduce = np.select([c.zero == 0, c.zero == 1],
                                [data_parallel.all_reduce_time_s(grad_bytes * trained),
                                 data_parallel.reduce_scatter_time_s(grad_bytes * trained)], default=0.0)
        step_gather = np.where((c.zero == 1) | (c.zero == 2), data_parallel.all_gather_time_s(b_w * trained), 0.0)
        first_fwd = hw.overlapped_time_s(fwd_compute + gpu_step, fwd_g2g + step_gather,
                                         fwd_h2d + hw.host_copy_time_s(b_w * partition * c.oo),
                                         fwd_d2h + hw.host_copy_time_s(FP32_BYTES * partition * c.oo))
        last_bwd = hw.overlapped_time_s(bwd_compute + recompute, bwd_g2g + step_reduce, bwd_h2d, bwd_d2h)
        reduce = step_reduce
        first_extra = np.maximum(first_fwd - fwd_phase, hw.cpu_adam_time_s(partition * c.oo))
        last_extra = last_bwd - bwd_phase + tied
        end = np.zeros_like(stable)
    elif overlap.overlap_grad_reduce or overlap.gather_weights_in_first_forward:
        layerwise = grad_reduce_overlapped(caps, overlap, c.pp, c.zero)
        gathered = weight_gather_overlapped(overlap, c.pp, c.zero, c.d, train.precision == "bf16") & (
            moves.step_gather > 0)
        first_extra = np.where(gathered, _gather_in_first_forward_s(costs, hw, c, emb, block, data_parallel,
                                                                     moves.step_gather_bytes), 0.0)
        last_extra = np.where(layerwise, hw.overlapped_time_s(bwd_compute + recompute, bwd_g2g + moves.reduce_hidden,
                                                              0, 0) + moves.reduce_exposed
                              - (bwd_compute + recompute + bwd_g2g), 0.0)
        end = np.where(layerwise, moves.reduce_rest, reduce) - np.where(gathered, moves.step_gather, 0.0) + step + tied
    else:
        first_extra = last_extra = np.zeros_like(stable)
        end = reduce + step + tied
    fwd = fwd_phase + fwd_tp + p2p / 2
    return StageTimes(stable_s=stable, fwd_s=fwd, bwd_s=stable - fwd, delta_s=first_extra + last_extra,
                      first_fwd_extra_s=first_extra, last_bwd_extra_s=last_extra, end_s=end,
                      compute_s=fwd_compute + bwd_compute,
                      recompute_s=recompute, tp_s=tp, p2p_s=p2p, dp_comm_s=fwd_g2g + bwd_g2g, swap_s=swap,
                      optimizer_s=step, grad_reduce_s=reduce)


@dataclass(frozen=True)
class _StageMoves:
    """How a runtime moves one stage's data, per micro-batch (fwd_*, bwd_*: seconds on each channel)
    and per step; `*_exposed`: the part of the pass's G2G time that no compute can hide."""

    fwd_g2g: np.ndarray
    bwd_g2g: np.ndarray
    fwd_exposed: np.ndarray
    bwd_exposed: np.ndarray
    fwd_h2d: np.ndarray
    fwd_d2h: np.ndarray
    bwd_h2d: np.ndarray
    bwd_d2h: np.ndarray
    fwd_tp: np.ndarray
    bwd_tp: np.ndarray
    """TP-group collectives the runtime adds to the layers' own (re-assembling partitioned sends)."""
    step_reduce: np.ndarray
    """Data-parallel collectives of the step: the gradient reduction and the updated weights' gather."""
    step_params: np.ndarray
    """Parameters the optimizer steps on one GPU (its partition where the step is partitioned)."""
    step_bytes_per_param: float
    """Device memory traffic of the optimizer kernel per stepped parameter (bytes)."""
    step_host_bytes_per_param: float
    """Host copies per host-stepped parameter (bytes): gradient down, updated weight up."""
    step_copies_s: np.ndarray
    """Host copies at the accumulation boundary outside the step (seconds)."""
    reduce_hidden: np.ndarray
    """With the gradient reduction in the last backward (grad_reduce_overlapped): the collectives that
    run beside its compute (G2G seconds)."""
    reduce_exposed: np.ndarray
    """... the reduction issued when the backward's compute is done (seconds, serial)."""
    reduce_rest: np.ndarray
    """... the data-parallel collectives still at the end of the iteration (seconds)."""
    step_gather: np.ndarray
    """The post-step all-gather of the updated weights, as one collective at the end (seconds; in
    step_reduce and reduce_rest)."""
    step_gather_bytes: np.ndarray
    """... its full message (bytes)."""


def _ideal_moves(hw: HardwareModel, c: StageCandidates, data_parallel, weight_bytes, grad_bytes, params,
                 saved_offloaded) -> _StageMoves:
    """Each gradient byte crosses the group once (RuntimeCapabilities.collectives 'ideal'). ZeRO-3
    gathers the stage's weights in forward and again in backward, and reduce-scatters gradients in
    backward, every micro-batch; ZeRO-2 reduce-scatters gradients every micro-batch. Offload with Mist's
    semantics: the offloaded fraction of the stage's weights comes in for each pass, its gradients go
    out and come back every micro-batch. `params`: the trainable elements (gradients, the step); frozen weights
    are gathered only."""
    trained_bytes = hw.dtype_bytes * params
    gather = data_parallel.all_gather_time_s(weight_bytes)
    scatter = data_parallel.reduce_scatter_time_s(trained_bytes)
    none = np.zeros(np.broadcast(c.zero, weight_bytes).shape)
    fwd_h2d = hw.host_copy_time_s(c.wo * weight_bytes)
    step_reduce = np.select([c.zero <= 1, c.zero == 2], [data_parallel.all_reduce_time_s(grad_bytes),
                                                         data_parallel.all_gather_time_s(trained_bytes)], default=0.0)
    return _StageMoves(
        fwd_g2g=np.where(c.zero == 3, gather, 0.0),
        bwd_g2g=np.where(c.zero == 3, gather + scatter, np.where(c.zero == 2, scatter, 0.0)),
        fwd_exposed=none, bwd_exposed=none,
        fwd_h2d=fwd_h2d, fwd_d2h=hw.host_copy_time_s(saved_offloaded),
        bwd_h2d=hw.host_copy_time_s(c.wo * weight_bytes + saved_offloaded + c.go * trained_bytes),
        bwd_d2h=hw.host_copy_time_s(c.go * trained_bytes), fwd_tp=none, bwd_tp=none,
        step_reduce=step_reduce,
        step_params=np.where(c.zero >= 1, params / c.d, params),
        step_bytes_per_param=ADAM_STEP_BYTES_PER_PARAM, step_host_bytes_per_param=FP32_BYTES + hw.dtype_bytes,
        step_copies_s=none, reduce_hidden=step_reduce, reduce_exposed=none, reduce_rest=none,
        step_gather=none, step_gather_bytes=none)


def _deepspeed_moves(costs: ModelCosts, hw: HardwareModel, caps: RuntimeCapabilities, train: TrainSpec,
                     c: StageCandidates, data_parallel,
                     weight_bytes, params, saved_offloaded) -> _StageMoves:
    """What DeepSpeed 0.19.8 moves for a stage of `weight_bytes` whose `params` elements train
    (RuntimeCapabilities.collectives 'deepspeed'; docs/design.md, What DeepSpeed does):
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
    - the step is torch's AdamW (`torch_adam`), over the rank's partition where it is partitioned;
    - offloaded activations (runtime `mist`) go down in forward and come back in backward, copies that
      add to the pass (offload_overlapped is off).
    """
    b_w, ev = hw.dtype_bytes, c.shapes
    model = costs.model
    shared = np.where((c.pp == 1) & model.tie_embeddings, b_w * vocab_shard_elements(model, c), 0.0)
    traffic = data_parallel_traffic(c.zero, c.pp > 1, train.precision == "bf16", weight_bytes, shared,
                                    trained_bytes=b_w * params)
    layer_bytes = b_w * ev(costs.block, "params")
    layer_trained_bytes = b_w * ev(costs.block, "trainable_params")
    zero3 = c.zero == 3
    fwd_exposed = np.where(zero3, data_parallel.all_gather_time_s(layer_bytes), 0.0)
    bwd_exposed = np.where(zero3 & (layer_trained_bytes > 0), data_parallel.reduce_scatter_time_s(layer_trained_bytes),
                           0.0)

    several = c.G > 1
    grads_every_micro = (c.go > 0) & (zero3 | ((c.zero == 2) & several))
    grads_at_boundary = (c.go > 0) & (c.zero == 1) & several
    grad_copy = hw.host_copy_time_s(c.go * b_w * params / c.d)
    weight_in = hw.host_copy_time_s(c.wo * weight_bytes / c.d)

    activations_copy = np.where(saved_offloaded > 0, hw.host_copy_time_s(saved_offloaded), 0.0)
    activation = ev(costs.block, "output_bytes")
    rebuild = np.where((c.pp > 1) & (c.t > 1), hw.all_gather_time_s(activation, c.t, 1), 0.0)
    none = np.zeros(np.broadcast(c.zero, weight_bytes).shape)

    def ran(collective, message):  # a collective DeepSpeed does not run costs nothing, latency included
        return np.where(message > 0, collective(message), 0.0)

    return _StageMoves(
        fwd_g2g=ran(data_parallel.all_gather_time_s, traffic.micro_gather_fwd),
        bwd_g2g=(ran(data_parallel.all_gather_time_s, traffic.micro_gather_bwd)
                 + ran(data_parallel.reduce_scatter_time_s, traffic.micro_reduce_scatter)
                 + ran(data_parallel.all_reduce_time_s, traffic.micro_all_reduce)),
        fwd_exposed=fwd_exposed, bwd_exposed=bwd_exposed,
        fwd_h2d=weight_in, fwd_d2h=none + activations_copy,
        bwd_h2d=weight_in + np.where(grads_every_micro & several, grad_copy, 0.0) + activations_copy,
        bwd_d2h=np.where(grads_every_micro, grad_copy, 0.0),
        fwd_tp=(1 - c.first) * rebuild, bwd_tp=2 * (1 - c.last) * rebuild,
        step_reduce=(ran(data_parallel.all_reduce_time_s, traffic.step_all_reduce)
                     + ran(data_parallel.all_gather_time_s, traffic.step_all_gather)),
        step_params=np.where(traffic.partitioned_step, params / c.d, params),
        step_bytes_per_param=TORCH_ADAMW_STEP_BYTES_PER_PARAM,
        step_host_bytes_per_param=FP32_BYTES + b_w * (1 - c.wo),
        step_copies_s=np.where(grads_at_boundary, 2 * grad_copy, 0.0),
        step_gather=ran(data_parallel.all_gather_time_s, traffic.step_all_gather),
        step_gather_bytes=traffic.step_all_gather,
        **_layerwise_reduce(costs, hw, caps, c, data_parallel, ran, traffic))


def _layerwise_reduce(costs: ModelCosts, hw: HardwareModel, caps: RuntimeCapabilities, c: StageCandidates,
                      data_parallel, ran, traffic: DataParallelTraffic) -> dict[str, np.ndarray]:
    """Runtime `mist`'s reduction in the last backward (mist_ds/runtime/overlap.py; where
    grad_reduce_overlapped): at ZeRO-0 one all-reduce per layer, issued once the layer's gradients are
    complete; at ZeRO-1 (S = 1) DeepSpeed's hooks all-reduce a bucket of at most one block's elements
    whenever it fills, so a block leaves in ceil(block / bucket) all-reduces. Backward runs the head, the
    blocks from the last, then the embedding, so every layer's all-reduce but the stage's first layer's
    runs beside compute; that one follows it. In a pipeline the tied weights are left out (their
    gradients are summed over the tied group first, then all-reduced at the end, as stock DeepSpeed
    orders the two), and so is the post-step gather of the updated weights (at the end, or in the next
    first forward: _gather_in_first_forward_s)."""
    b_w, ev, model = hw.dtype_bytes, c.shapes, costs.model
    bucket = reduce_bucket_elements_of(caps, caps.overlap, c.pp, c.zero, ev(costs.block, "params"))  # as emitted
    pieces = np.where(c.zero >= 1, np.ceil(ev(costs.block, "trainable_params") / np.maximum(bucket, 1.0)), 1.0)
    tied = (c.pp > 1) & model.tie_embeddings
    vocab_bytes = b_w * vocab_shard_elements(model, c) * model.trains_vocab()  # a frozen one is reduced by no one
    block = b_w * ev(costs.block, "trainable_params")
    embedding_bytes = b_w * ev(costs.embedding, "trainable_params")
    embedding = np.where(tied, embedding_bytes - vocab_bytes, embedding_bytes)
    # At S = 1 the tied weight is one parameter, complete once the embedding's backward has run: it is
    # reduced with the embedding's bucket, not the head's.
    head_bytes = b_w * ev(costs.head, "trainable_params")
    head = np.where(model.tie_embeddings, head_bytes - vocab_bytes, head_bytes)
    embedding_last = (c.first > 0) & (embedding > 0)  # the stage's first layer to finish last has parameters
    block_reduce = pieces * ran(data_parallel.all_reduce_time_s, block / pieces)
    return {
        "reduce_hidden": (c.layers - 1 + embedding_last) * block_reduce
        + c.last * ran(data_parallel.all_reduce_time_s, head),
        "reduce_exposed": np.where(embedding_last, ran(data_parallel.all_reduce_time_s, embedding), block_reduce),
        "reduce_rest": (ran(data_parallel.all_reduce_time_s,
                            np.where(tied & ((c.first + c.last) > 0), vocab_bytes, 0.0))
                        + ran(data_parallel.all_gather_time_s, traffic.step_all_gather)),
    }


@dataclass(frozen=True)
class _GatherLayout:
    """Where a stage's layers lie in its flat weights, for the chunked gather (elements)."""

    embedding: np.ndarray
    block: np.ndarray
    partition: np.ndarray
    """P = W / d: one rank's share of the stage's weights."""
    first_end: np.ndarray
    """Where the stage's first layer (embedding or first block) ends."""


def _gather_layout(costs: ModelCosts, c: StageCandidates) -> _GatherLayout:
    ev, first = c.shapes, c.first > 0
    embedding = np.where(first, ev(costs.embedding, "trainable_params"), 0.0)
    block = ev(costs.block, "trainable_params")
    weights = embedding + c.layers * block + c.last * ev(costs.head, "trainable_params")
    return _GatherLayout(embedding, block, weights / np.maximum(c.d, 1.0), np.where(first, embedding, block))


def gather_chunk_count(costs: ModelCosts, c: StageCandidates) -> np.ndarray:
    """Chunks of the post-step all-gather in the first forward (mist_ds/runtime/gather.py gather_chunks):
    ceil(layers / d), the stage's layers (blocks, embedding, head) over the data-parallel ranks; one where
    the first layer holds all of rank 0's partition."""
    return _chunk_count(c, _gather_layout(costs, c))


def _chunk_count(c: StageCandidates, layout: _GatherLayout) -> np.ndarray:
    count = np.maximum(1.0, np.ceil((c.layers + c.first + c.last) / np.maximum(c.d, 1.0)))
    return np.where(layout.first_end >= layout.partition, 1.0, count)


def _gather_in_first_forward_s(costs: ModelCosts, hw: HardwareModel, c: StageCandidates, emb: LayerTimes,
                               block: LayerTimes, data_parallel, message_bytes) -> np.ndarray:
    """Seconds the chunked post-step all-gather adds before and within the next first forward
    (mist_ds/runtime/gather.py), from where the stage's layers lie in its flat weights (embedding on the
    first stage, l blocks, head on the last; W elements, partitions of P = W / d). K = gather_chunk_count
    chunks run back to back from the step: the first holds the first layer's share of rank 0's partition
    (it ends at z0; all of the partition when z0 >= P or K = 1), the other K - 1 split the rest equally.
    A layer runs once the chunks holding it are done: the first layer after the first chunk, and the layer
    holding the last chunk's start x* in rank 0's partition after the forward compute S* of the layers
    before it (0 when the embedding holds it). Between them the needed chunk and the compute grow
    together, so the worst wait is at one of the two: exposed = max(first chunk, T - S*), T the K
    all-gathers, plus the interference of the window where both run."""
    layout = _gather_layout(costs, c)
    chunks = _chunk_count(c, layout)
    embedding, per_block, partition, first_end = layout.embedding, layout.block, layout.partition, layout.first_end
    single = chunks == 1
    head_share = np.minimum(first_end / partition, 1.0)
    rest = np.maximum(chunks - 1, 1.0)
    first_wait = np.where(single, data_parallel.all_gather_time_s(message_bytes),
                          data_parallel.all_gather_time_s(message_bytes * head_share))
    each_other = data_parallel.all_gather_time_s(message_bytes * (1 - head_share) / rest)
    total = np.where(single, first_wait, first_wait + (chunks - 1) * each_other)
    last_chunk_start = np.where(single, 0.0, first_end + (chunks - 2) / rest * (partition - first_end))
    before = np.floor((last_chunk_start - embedding) / per_block)  # blocks wholly before that offset
    compute_before = np.where((c.first > 0) & (last_chunk_start < embedding), 0.0,
                              c.first * emb.fwd_compute_s + np.clip(before, 0, c.layers) * block.fwd_compute_s)
    exposed = np.maximum(first_wait, total - compute_before)
    window = np.clip(np.minimum(compute_before, total - first_wait), 0.0, None)
    return exposed + hw.overlapped_time_s(window, window, 0, 0) - window


def norm_sync_s(hw: HardwareModel, train: TrainSpec, world) -> np.ndarray:
    """The gradient-norm (clipping) all-reduce spanning every GPU, after the reduction."""
    return np.where(train.grad_clip > 0, hw.all_reduce_time_s(NORM_MESSAGE_BYTES, world, 1), 0.0)


def tail_s(hw: HardwareModel, train: TrainSpec, end_max_s, world) -> np.ndarray:
    """The iteration's tail after the pipeline drains: the slowest stage's end work (reduction and
    step) and then the gradient-norm sync; 0 on runtimes that leave no end work."""
    end_max_s = np.asarray(end_max_s, dtype=np.float64)
    return np.where(end_max_s > 0, end_max_s + norm_sync_s(hw, train, world), 0.0)


def vocab_shard_elements(model: ModelSpec, c: StageCandidates) -> np.ndarray:
    """Elements of one TP rank's token-embedding tensor (a tied LM head's too): the zoo's V / t rows, or what
    DeepSpeed AutoTP leaves on a rank of a Hugging Face model (the whole table where it keeps it replicated)."""
    ev = c.shapes
    return ev.spread(np.array([model.vocab_tensor(int(t)) for t in ev.t], dtype=np.float64))


def _trained_vocab(model: ModelSpec, c: StageCandidates) -> tuple[np.ndarray, np.ndarray]:
    """Whether the stage holds a trainable vocabulary matrix: (on the first stage, on the last)."""
    return (c.first > 0) & model.trains_vocab("embedding"), (c.last > 0) & model.trains_vocab("head")


def largest_tensor(model: ModelSpec, c: StageCandidates) -> np.ndarray:
    """Elements of the stage's largest trainable parameter tensor on one TP rank (the vocab shard on the ends)."""
    ev = c.shapes  # few distinct t: evaluate per distinct shape, spread back
    block = ev.spread(np.array([model.largest_block_tensor(int(t)) for t in ev.t], dtype=np.float64))
    vocab = ev.spread(np.array([model.vocab_tensor(int(t)) for t in ev.t], dtype=np.float64))
    first, last = _trained_vocab(model, c)
    return np.where(first | last, np.maximum(block, vocab), block)


def oversized_tensors(model: ModelSpec, c: StageCandidates, bucket_elements) -> np.ndarray:
    """Elements of the stage's trainable parameter tensors (one TP rank) larger than the reduce bucket, which
    DeepSpeed reduces outside it (stage_1_and_2.py:1443-1449): the token embedding and gpt's positions on the first
    stage, the head on the last unless it is the embedding's own tensor (tied at S = 1). Infinite (unknown)
    where a block's largest tensor exceeds the bucket: only that tensor's size is known."""
    ev = c.shapes
    vocab = ev.spread(np.array([model.vocab_tensor(int(t)) for t in ev.t], dtype=np.float64))
    block = ev.spread(np.array([model.largest_block_tensor(int(t)) for t in ev.t], dtype=np.float64))
    positions = float(model.seq_len * model.hidden_size if model.family == "gpt" else 0)
    first, last = _trained_vocab(model, c)
    head_of_its_own = last & ~((c.first > 0) & model.tie_embeddings)
    ends = (np.where(first & (vocab > bucket_elements), vocab, 0.0)
            + c.first * np.where(positions > bucket_elements, positions, 0.0))
    ends = ends + np.where(head_of_its_own & (vocab > bucket_elements), vocab, 0.0)
    return np.where(block > bucket_elements, np.inf, ends)


def stage_memory(costs: ModelCosts, hw: HardwareModel, caps: RuntimeCapabilities, train: TrainSpec,
                 c: StageCandidates) -> StageMemory:
    """Peak bytes on one GPU of the stage (docs/design.md, Memory of a stage)."""
    ev = c.shapes
    params = stage_params(costs, c, ev)
    hooked = reduced_by_deepspeed_hooks(caps, caps.overlap, c.pp, c.zero)
    bucket = reduce_bucket_elements_of(caps, caps.overlap, c.pp, c.zero, ev(costs.block, "params"))
    deepspeed = caps.model_states == "deepspeed"  # only DeepSpeed's engines size buffers by their tensors
    oversized = oversized_tensors(costs.model, c, bucket) if deepspeed else None
    states = model_state_bytes(caps.model_states, params, c.d, c.zero, hw.dtype_bytes, train.mixed_precision,
                               pipeline=c.pp > 1, weights_offload=c.wo, grads_offload=c.go, optimizer_offload=c.oo,
                               bf16=train.precision == "bf16", overlap_comm=hooked, reduce_bucket_elements=bucket,
                               largest_param_elements=largest_tensor(costs.model, c) if deepspeed else 0.0,
                               grad_accum=c.G, oversized_param_elements=oversized,
                               trainable_params=stage_trainable_params(costs, c, ev))
    in_flight = in_flight_micro_batches(c.stage, c.pp, c.G, c.v)
    saved, saved_offloaded = _saved_bytes(costs, c, ev, caps)
    activations = (saved - saved_offloaded) * in_flight
    block_saved = ev(costs.block, "saved_bytes")
    block_bwd_peak = ev(costs.block, "bwd_peak_bytes")
    transient = np.maximum.reduce([
        ev(costs.block, "fwd_peak_bytes") - block_saved,
        block_bwd_peak - block_saved,
        np.where(c.ckpt > 0, block_bwd_peak - ev(costs.block, "saved_bytes_ckpt"), 0.0),
        c.first * (np.maximum(ev(costs.embedding, "fwd_peak_bytes"), ev(costs.embedding, "bwd_peak_bytes"))
                   - ev(costs.embedding, "saved_bytes")),
        c.last * (np.maximum(ev(costs.head, "fwd_peak_bytes"), ev(costs.head, "bwd_peak_bytes"))
                  - ev(costs.head, "saved_bytes")),
    ])
    # Pipeline send / receive buffers of one activation each; ZeRO-3 holds the gathered layer and the
    # prefetched next one.
    p2p_buffers = np.where(c.pp > 1, 2 * ev(costs.block, "output_bytes"), 0.0)
    gathered = np.where(c.zero == 3, 2 * hw.dtype_bytes * ev(costs.block, "params"), 0.0)
    buffers = states.buffers + p2p_buffers + gathered
    if caps.activations_offload_whole_blocks:
        # In backward an offloaded block's saved tensors are back on the device with the next block's
        # prefetched (mist_ds/runtime/activations.py): up to two blocks' offloaded share.
        returned = np.minimum(offloaded_blocks(c), 2) * saved_offloaded / np.maximum(offloaded_blocks(c), 1)
        buffers = buffers + returned
    # The step's own bytes (Megatron's fp32 copy of half gradients) raise the peak only by what they
    # exceed the activations, transients and buffers they never coexist with.
    buffers = buffers + np.maximum(states.step_only - (activations + transient + buffers), 0.0)
    # Runtime `mist`'s chunked post-step gather (mist_ds/runtime/gather.py): its receive buffers, the stage's
    # weights in all, live from the step into the next first forward, beside the model states' own buffers
    # and the pipe buffers, before any activation is saved.
    gathered = weight_gather_overlapped(caps.overlap, c.pp, c.zero, c.d, train.precision == "bf16")
    gather_buffers = np.where(gathered, hw.dtype_bytes * params, 0.0)
    buffers = buffers + np.maximum(states.buffers + p2p_buffers + gather_buffers - (activations + transient + buffers),
                                   0.0)
    # The module's own buffers (rotary tables, masks) sit beside its weights, whole on every rank
    # (specs/hf.py ModuleBuffer).
    weights = states.weights + (c.first * costs.model.buffer_bytes("embedding")
                                + c.layers * costs.model.buffer_bytes("block") + c.last * costs.model.buffer_bytes("head"))
    peak = weights + states.grads + states.optimizer + activations + transient + buffers
    return StageMemory(peak_bytes=peak, weights=weights, grads=states.grads, optimizer=states.optimizer,
                       activations=activations, transient=transient, buffers=buffers,
                       host_bytes=states.host + saved_offloaded * in_flight, in_flight=in_flight,
                       host_activations=saved_offloaded * in_flight,
                       state_buffers=np.broadcast_to(states.buffers, peak.shape),
                       state_host=np.broadcast_to(states.host, peak.shape))
