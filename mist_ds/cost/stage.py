"""The stage template: per-stage stable time, first/last micro-batch extra (delta), end-of-iteration
work, for arrays of candidate strategies on a given executor (docs/design.md, The stage template); the
executor's own data moves and end of iteration come from cost/executors, its memory from cost/stage_memory.py.

Symbols: b micro-batch, s sequence, t TP, d data parallel, S stages (pp), G micro-batches, i stage
index, l layers, c checkpointed layers, z ZeRO stage, wo / go / oo / ao offload fractions.
Every input broadcasts; every output is an array of seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from mist_ds.cost.candidates import (ModelCosts, ShapeIndex, StageCandidates, stage_params, stage_trainable_params,
                                     vocab_shard_elements)
from mist_ds.cost.executors import COLLECTIVE_EXECUTORS, CollectiveExecutor, end_of_iteration_policy
from mist_ds.cost.executors.deepspeed import PARTITION_META_BYTES
from mist_ds.cost.executors.interface import (EndOfIteration, OptimizerStep, PassPhases, PassWork, StageInputs,
                                              StageMoves)
from mist_ds.cost.layer_time import LayerTimes, layer_times
from mist_ds.cost.memory import FP32_BYTES
from mist_ds.cost.sequence import block_all_to_all_s
from mist_ds.cost.stage_memory import saved_bytes
from mist_ds.hardware import HardwareModel
from mist_ds.specs import ExecutorCapabilities, TrainSpec

# Gradient-norm / overflow check: one scalar all-reduced across every GPU.
NORM_MESSAGE_BYTES = 8


@dataclass(frozen=True)
class StageTimes:
    stable_s: np.ndarray
    """Steady forward + backward of one micro-batch, everything included (TP, p2p, swaps)."""
    fwd_s: np.ndarray
    bwd_s: np.ndarray
    """The two halves of stable_s (p2p and TP collectives split by pass)."""
    delta_s: np.ndarray
    """(first forward + last backward) - stable: the executor's once-per-iteration extras."""
    first_fwd_extra_s: np.ndarray
    last_bwd_extra_s: np.ndarray
    end_s: np.ndarray
    """Work after the stage's last backward before the step completes (executors with a tail)."""
    compute_s: np.ndarray
    recompute_s: np.ndarray
    tp_s: np.ndarray
    sp_s: np.ndarray
    """Sequence parallelism's all-to-alls of one micro-batch, both passes (serial, cost/sequence.py)."""
    p2p_s: np.ndarray
    dp_comm_s: np.ndarray
    swap_s: np.ndarray
    host_s: np.ndarray
    """The executor's host work of one micro-batch, both passes, serial with them (ZeRO-3's coordinator)."""
    optimizer_s: np.ndarray
    grad_reduce_s: np.ndarray


def _times(costs: ModelCosts, hw: HardwareModel, ev: ShapeIndex,
           caps: ExecutorCapabilities) -> tuple[LayerTimes, LayerTimes, LayerTimes]:
    """Embedding, block and head times, evaluated once per distinct (b, s, t) and spread over the candidates."""
    out = []
    for cost in (costs.embedding, costs.block, costs.head):
        unique = layer_times(cost, hw, ev.b, ev.s, ev.t, caps.fused_kernels, ev.q, caps.runs_profiled_layers)
        out.append(LayerTimes(*(ev.spread(getattr(unique, f.name)) for f in fields(LayerTimes))))
    return tuple(out)


def _p2p_s(costs: ModelCosts, hw: HardwareModel, c: StageCandidates, ev: ShapeIndex,
           scatter_gather: bool, partitioned: bool = False) -> np.ndarray:
    """Blocking send / recv of activations (forward) and their gradients (backward), per micro-batch.

    Stage i's ranks are [i t d, (i + 1) t d): a boundary crosses nodes when a stage fills whole
    nodes or the boundary falls on a node edge. `partitioned`: with t > 1 each TP rank sends its 1 / t
    slice after a PARTITION_META_BYTES message (DeepSpeed's pipe_partitioned / grad_partitioned; the
    receiver's re-assembly is a TP collective, cost/executors/deepspeed.py).
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
    to_next = np.where(c.sends_to_next_rank == 0, 0.0, send(cross_next & (c.sends_to_next_rank > 0)))
    from_prev = np.where(c.sends_to_previous_rank == 0, 0.0, send(cross_prev & (c.sends_to_previous_rank > 0)))
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


def stage_times(costs: ModelCosts, hw: HardwareModel, caps: ExecutorCapabilities, train: TrainSpec,
                c: StageCandidates) -> StageTimes:
    """Seconds of one stage of each candidate: its inputs, the executor's data moves (executors.COLLECTIVE_EXECUTORS
    by caps.collectives), the passes and how their channels overlap, the optimizer step, and where the executor
    places the reduction and the step (executors.end_of_iteration_policy by caps.overlap)."""
    inputs = stage_inputs(costs, hw, caps, train, c)
    executor = COLLECTIVE_EXECUTORS[caps.collectives]
    moves = executor.moves(inputs)
    work = pass_work(inputs, executor, moves)
    phases = pass_phases(inputs, work, moves)
    step = optimizer_step(inputs, moves)
    end = end_of_iteration_policy(caps.overlap)(inputs, work, phases, moves, step)
    return _stage_times_of(work, phases, moves, step, end)


def stage_inputs(costs: ModelCosts, hw: HardwareModel, caps: ExecutorCapabilities, train: TrainSpec,
                 c: StageCandidates) -> StageInputs:
    """What every step of stage_times reads: the layers' times, the stage's parameters and weight bytes, the
    gradient element's bytes on this executor, the offloaded activations, the data-parallel group."""
    ev = c.shapes
    emb, block, head = _times(costs, hw, ev, caps)
    params = stage_params(costs, c, ev)
    b_w = hw.dtype_bytes
    _, saved_offloaded = saved_bytes(costs, c, ev, caps)
    return StageInputs(costs=costs, hw=hw, caps=caps, train=train, c=c, emb_times=emb, block_times=block,
                       head_times=head, params=params,
                       trained=stage_trainable_params(costs, c, ev),  # gradients, optimizer states, the step
                       weight_bytes=b_w * params,
                       grad_bytes=FP32_BYTES if caps.fp32_grads_with_bf16 and train.precision == "bf16" else b_w,
                       saved_offloaded=saved_offloaded, data_parallel=hw.group(c.d, c.t))


def pass_work(inputs: StageInputs, executor: CollectiveExecutor, moves: StageMoves) -> PassWork:
    """Compute, TP collectives and p2p of one micro-batch."""
    c, emb, block, head = inputs.c, inputs.emb_times, inputs.block_times, inputs.head_times
    fwd_compute = c.layers * block.fwd_compute_s + c.first * emb.fwd_compute_s + c.last * head.fwd_compute_s
    recompute = c.recompute * block.fwd_compute_s
    bwd_compute = c.layers * block.bwd_compute_s + c.first * emb.bwd_compute_s + c.last * head.bwd_compute_s
    fwd_tp = c.layers * block.fwd_tp_s + c.first * emb.fwd_tp_s + c.last * head.fwd_tp_s
    bwd_tp = c.layers * block.bwd_tp_s + c.recompute * block.fwd_tp_s + c.first * emb.bwd_tp_s + c.last * head.bwd_tp_s
    p2p = _p2p_s(inputs.costs, inputs.hw, c, c.shapes, inputs.caps.p2p_scatter_gather, executor.partitioned_sends)
    fwd_tp, bwd_tp = fwd_tp + moves.fwd_tp, bwd_tp + moves.bwd_tp
    block_sp = _block_all_to_all_s(inputs)
    if block_sp is None:  # no sequence parallelism: no work on the (many) candidates
        fwd_sp = bwd_sp = sp = np.zeros(np.broadcast(fwd_compute, p2p).shape)
    else:  # the recomputed forward exchanges again
        fwd_sp, bwd_sp = c.layers * block_sp, (c.layers + c.recompute) * block_sp
        sp = fwd_sp + bwd_sp
    return PassWork(fwd_compute=fwd_compute, bwd_compute=bwd_compute, recompute=recompute, fwd_tp=fwd_tp,
                    bwd_tp=bwd_tp, tp=fwd_tp + bwd_tp, p2p=p2p, fwd_sp=fwd_sp, bwd_sp=bwd_sp, sp=sp)


def _block_all_to_all_s(inputs: StageInputs) -> np.ndarray | None:
    """One block's all-to-alls of one pass over its sequence group (q consecutive ranks of one TP index, t apart),
    per distinct shape and spread; None where no candidate is sequence parallel."""
    ev = inputs.c.shapes
    if not np.any(ev.q > 1):
        return None
    return ev.spread(block_all_to_all_s(inputs.costs.model, inputs.hw, ev.b, ev.s, ev.q, ev.t))


def pass_phases(inputs: StageInputs, work: PassWork, moves: StageMoves) -> PassPhases:
    """Each pass's compute joined with its data moves on the executor's channels."""
    hw, c = inputs.hw, inputs.c
    fwd_compute, bwd_compute, recompute = work.fwd_compute, work.bwd_compute, work.recompute
    fwd_g2g, bwd_g2g = moves.fwd_g2g, moves.bwd_g2g
    fwd_h2d, fwd_d2h, bwd_h2d, bwd_d2h = moves.fwd_h2d, moves.fwd_d2h, moves.bwd_h2d, moves.bwd_d2h
    g2g_overlapped = inputs.caps.zero3_overlaps_compute
    if inputs.caps.overlap.offload_overlapped:
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
    # The executor's host work (ZeRO-3's hooks and fetches, ZeRO-2's reduction) runs between the modules' kernels:
    # serial.
    fwd_phase, bwd_phase = fwd_phase + moves.fwd_host, bwd_phase + moves.bwd_host
    return PassPhases(fwd_phase=fwd_phase, bwd_phase=bwd_phase,
                      stable=fwd_phase + bwd_phase + work.tp + work.sp + work.p2p)


def optimizer_step(inputs: StageInputs, moves: StageMoves) -> OptimizerStep:
    """The step over the rank's stepped parameters, on the device and (the offloaded share oo) on the host: the
    device's bytes (moves.step_bytes_per_param) and the fixed cost of the step's ops (moves.step_ops x
    cluster.gpu.step_op_s), the host's CPU Adam and copies; and the tied embedding's all-reduce between the first
    and the last stage."""
    hw, c, costs = inputs.hw, inputs.c, inputs.costs
    b_w, partition, step_bytes = hw.dtype_bytes, moves.step_params, moves.step_bytes_per_param
    gpu_step = (hw.memory_bound_time_s(step_bytes * partition * (1 - c.oo))
                + moves.step_ops * hw.cluster.gpu.step_op_s)
    cpu_step = hw.cpu_adam_time_s(partition * c.oo) + hw.host_copy_time_s(moves.step_host_bytes_per_param
                                                                          * partition * c.oo)
    tied = np.where((c.ties_across_ranks > 0) & costs.model.tie_embeddings & ((c.first + c.last) > 0),
                    hw.all_reduce_time_s(b_w * vocab_shard_elements(costs.model, c), 2,
                                         c.t * c.d * (c.pp - 1)), 0.0)
    return OptimizerStep(gpu_s=gpu_step, total_s=gpu_step + cpu_step + moves.step_copies_s + moves.step_host_s,
                         partition=partition, tied_s=tied)


def _stage_times_of(work: PassWork, phases: PassPhases, moves: StageMoves, step: OptimizerStep,
                    end: EndOfIteration) -> StageTimes:
    stable = phases.stable
    fwd = phases.fwd_phase + work.fwd_tp + work.fwd_sp + work.p2p / 2
    return StageTimes(stable_s=stable, fwd_s=fwd, bwd_s=stable - fwd,
                      delta_s=end.first_fwd_extra + end.last_bwd_extra,
                      first_fwd_extra_s=end.first_fwd_extra, last_bwd_extra_s=end.last_bwd_extra, end_s=end.end,
                      compute_s=work.fwd_compute + work.bwd_compute, recompute_s=work.recompute, tp_s=work.tp,
                      sp_s=work.sp,
                      p2p_s=work.p2p, dp_comm_s=moves.fwd_g2g + moves.bwd_g2g,
                      swap_s=moves.fwd_h2d + moves.fwd_d2h + moves.bwd_h2d + moves.bwd_d2h,
                      host_s=moves.fwd_host + moves.bwd_host,
                      optimizer_s=step.total_s, grad_reduce_s=end.grad_reduce)


def norm_sync_s(hw: HardwareModel, train: TrainSpec, world) -> np.ndarray:
    """The gradient-norm (clipping) all-reduce spanning every GPU, after the reduction."""
    return np.where(train.grad_clip > 0, hw.all_reduce_time_s(NORM_MESSAGE_BYTES, world, 1), 0.0)


def tail_s(hw: HardwareModel, train: TrainSpec, end_max_s, world) -> np.ndarray:
    """The iteration's tail after the pipeline drains: the slowest stage's end work (reduction and
    step) and then the gradient-norm sync; 0 on executors that leave no end work."""
    end_max_s = np.asarray(end_max_s, dtype=np.float64)
    return np.where(end_max_s > 0, end_max_s + norm_sync_s(hw, train, world), 0.0)
