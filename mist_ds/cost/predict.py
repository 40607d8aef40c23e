"""Predict one strategy: iteration time, throughput, MFU, per-stage time and memory, fit."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mist_ds.cost.accounting import comm_bytes, stage_flops
from mist_ds.cost.host import host_use
from mist_ds.cost.iteration import bubble_s, iteration_time_s
from mist_ds.cost.layer_time import profile_sources
from mist_ds.cost.executors.dual_pipe_v import (VSpan, chunk_candidates, per_rank, rank_memory, rank_times,
                                                simulate_dualpipev)
from mist_ds.cost.executors.zero_bubble import (SplitSpan, deferred_weight_bytes, pipeline_bubble_s, simulate_split,
                                                stage_weight_gradient_s)
from mist_ds.cost.sequence import on_rank
from mist_ds.cost.simulate import Span, simulate, simulate_interleaved
from mist_ds.cost.candidates import ModelCosts, StageCandidates
from mist_ds.cost.stage import StageTimes, stage_times, tail_s
from mist_ds.cost.stage_memory import StageMemory, stage_memory
from mist_ds.hardware import HardwareModel, hardware_model
from mist_ds.specs import ExecutorCapabilities, Specs, StrategySpec, check_executor
from mist_ds.specs.executors import capabilities_of
from mist_ds.specs.cluster import GIB
from mist_ds.specs.pipeline_order import SPLIT_SCHEDULES, V_SCHEDULES
from mist_ds.specs.placement import node_host_bytes
from mist_ds.symbolic import analyze_model

MEMORY_PARTS = ("weights", "grads", "optimizer", "activations", "transient", "buffers")


@dataclass(frozen=True)
class Prediction:
    """What `mist-ds predict --json` prints (its keys are a public interface). Seconds and bytes."""

    iteration_time_s: float
    iteration_time_closed_form_s: float
    throughput_samples_per_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    stage_stable_s: list[float]
    stage_delta_s: list[float]
    bubble_s: float
    optimizer_s: float
    tail_s: float
    peak_memory_bytes: list[float]
    memory_breakdown: list[dict[str, float]]
    fits: bool
    host_memory_bytes: float
    """Host bytes the fullest node keeps: its ranks of every stage (specs/placement.py)."""
    sources: dict[str, str]
    """Per op class, where its times come from: gemm and attention "profile" (the profile database holds
    every shape the strategy runs), "profile+roofline" (some) or "roofline"; the others name their model."""
    flops_per_rank: list[float] = field(default_factory=list)
    """Per stage, the FLOPs one of its ranks executes in an iteration, recompute included
    (cost/accounting.py)."""
    comm_bytes_per_rank: list[dict[str, float]] | None = None
    """Per stage, "kind/group" -> collective payload bytes one of its ranks moves in an iteration, as
    DeepSpeed runs it (cost/accounting.py); None for executors that do not run on DeepSpeed."""
    model_state_bytes: list[dict[str, float]] = field(default_factory=list)
    """Per stage, one GPU's model states by part (cost/memory.py): weights, grads, optimizer, their own
    buffers (buckets, step gradients, staging) and what is offloaded to the host. What an executor's
    engine census is compared with."""
    warnings: list[str] = field(default_factory=list)
    strategy: dict[str, Any] = field(default_factory=dict)
    """StrategySpec.to_dict() of the priced strategy."""
    host_bytes_per_rank: list[float] = field(default_factory=list)
    """Per stage, the host bytes one of its ranks keeps (offloaded states, offloaded activations in
    flight): what the plan's "mist" block carries for the executor's start-up check."""
    host_memory_rule: str = "per-gpu"
    """tuner.host_memory the fit was checked under: per-gpu (a GPU's share of its node) or per-node."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_costs(specs: Specs, cache_dir: Path | None = None) -> ModelCosts:
    layers = analyze_model(specs.model, specs.train.precision, cache_dir=cache_dir)
    return ModelCosts(specs.model, layers["embedding"], layers["block"], layers["head"])


def stage_candidates(strategy: StrategySpec, seq_len: int) -> StageCandidates:
    par, stages = strategy.parallelism, strategy.stages
    per_stage = lambda attr: np.array([getattr(st, attr) for st in stages], dtype=np.float64)  # noqa: E731
    return StageCandidates.of(
        b=par.micro_batch_size, s=seq_len, t=par.tp, d=par.data_group_size, q=par.sp, pp=par.pp, G=par.grad_accum,
        stage=np.arange(par.pp), layers=per_stage("layers"), recompute=per_stage("ckpt_layers"),
        zero=per_stage("zero_stage"), wo=per_stage("weights_offload"), go=per_stage("grads_offload"),
        oo=per_stage("optimizer_offload"), ao=per_stage("activations_offload"), v=strategy.virtual_stages,
        split=strategy.schedule in SPLIT_SCHEDULES)


@dataclass(frozen=True)
class SimulatedIteration:
    """One iteration as the event simulator runs it (seconds from its start): what the timeline picture
    draws (report/pictures.py) and where predict's iteration time comes from."""

    spans: list[Span] | list[SplitSpan] | list[VSpan]
    """Every forward and backward instruction per stage; a stage's last backward includes its extra
    (the span ends when the stage is free), a stage's first forward starts after its extra."""
    first_fwd_extra_s: list[float]
    """Per stage, the first micro-batch's extra: it runs from the iteration's start, before the first
    forward (it needs no input)."""
    last_bwd_extra_s: list[float]
    """Per stage, the last micro-batch's extra, at the end of its last backward span."""
    end_s: list[float]
    """Per stage, the work after its last backward (gradient reduction, optimizer step)."""
    sync_s: float
    """The gradient-norm sync after every stage's end work (0: none)."""
    micro_batches: int
    chunks: int
    """Model chunks per stage (interleaved schedule); spans carry chunk c micro-batch m as c G + m."""
    iteration_time_s: float
    tail_s: float
    """The iteration's tail after the last backward (cost/stage.py tail_s): the latest end work plus the sync."""


def _simulated_iteration(specs: Specs, hw: HardwareModel, times: StageTimes,
                         weight_grad_s: np.ndarray | None = None,
                         chunk_times: StageTimes | None = None) -> SimulatedIteration:
    """Run the event simulator on specs.strategy's stage times, its tail from cost/stage.py's tail_s;
    `weight_grad_s`: per stage, the W of a schedule that splits the backward (seconds per micro-batch);
    `chunk_times`: under a V schedule, its 2S chunks' (`times` then its ranks')."""
    par = specs.strategy.parallelism
    micro_batches, chunks = par.grad_accum, specs.strategy.virtual_stages
    tail = float(tail_s(hw, specs.train, np.max(times.end_s), par.num_gpus))
    if specs.strategy.schedule in V_SCHEDULES:
        simulated, spans = simulate_dualpipev(chunk_times.fwd_s, chunk_times.bwd_s, micro_batches,
                                              end_s=list(times.last_bwd_extra_s + times.end_s),
                                              start_s=list(times.first_fwd_extra_s))
    elif specs.strategy.schedule in SPLIT_SCHEDULES:
        simulated, spans = simulate_split(times.fwd_s, np.maximum(times.bwd_s - weight_grad_s, 0.0), weight_grad_s,
                                          times.first_fwd_extra_s, times.last_bwd_extra_s, micro_batches,
                                          end_s=list(times.end_s))
    elif chunks > 1:
        # Interleaving runs on Megatron-LM only, which has no first / last micro-batch extras.
        assert not np.any(times.delta_s), "interleaved schedule with micro-batch extras"
        simulated, spans = simulate_interleaved(times.fwd_s, times.bwd_s, micro_batches, chunks,
                                                end_s=list(times.end_s))
    else:
        simulated, spans = simulate(times.fwd_s, times.bwd_s, times.first_fwd_extra_s, times.last_bwd_extra_s,
                                    micro_batches, end_s=list(times.end_s))
    sync = 0.0
    if tail > 0:
        sync = tail - float(np.max(times.end_s))  # the norm sync after every stage's end work
        simulated += sync
    return SimulatedIteration(
        spans=spans, first_fwd_extra_s=[float(x) for x in times.first_fwd_extra_s],
        last_bwd_extra_s=[float(x) for x in times.last_bwd_extra_s], end_s=[float(x) for x in times.end_s],
        sync_s=sync, micro_batches=micro_batches, chunks=chunks, iteration_time_s=simulated, tail_s=tail)


def simulate_iteration(specs: Specs, caps: ExecutorCapabilities | None = None,
                       cache_dir: Path | None = None) -> SimulatedIteration:
    """The event simulation behind predict(specs).iteration_time_s, every instruction's span kept."""
    costs, hw = model_costs(specs, cache_dir), hardware_model(specs.cluster, specs.train.precision)
    caps = checked_caps(specs, caps)
    if specs.strategy.schedule in V_SCHEDULES:
        chunk_times = stage_times(costs, hw, caps, specs.train, chunk_candidates(specs.strategy, specs.model.seq_len))
        return _simulated_iteration(specs, hw, rank_times(chunk_times), chunk_times=chunk_times)
    c = stage_candidates(specs.strategy, specs.model.seq_len)
    return _simulated_iteration(specs, hw, stage_times(costs, hw, caps, specs.train, c),
                                _weight_grad_s(specs, costs, hw, c, caps))


def _weight_grad_s(specs: Specs, costs: ModelCosts, hw: HardwareModel, c: StageCandidates,
                   caps: ExecutorCapabilities) -> np.ndarray | None:
    """Per stage, W's seconds per micro-batch where the schedule splits the backward (else None)."""
    if specs.strategy.schedule not in SPLIT_SCHEDULES:
        return None
    return stage_weight_gradient_s(costs, hw, c, caps.runs_profiled_layers)


def predict_strategy(specs: Specs, costs: ModelCosts, hw: HardwareModel,
                     caps: ExecutorCapabilities | None = None) -> Prediction:
    """Price specs.strategy on `caps` (default: the capabilities of the executor it names)."""
    caps = checked_caps(specs, caps)
    if specs.strategy.schedule in V_SCHEDULES:
        return _dual_pipe_v_prediction(specs, costs, hw, caps)
    c = stage_candidates(specs.strategy, specs.model.seq_len)
    times = stage_times(costs, hw, caps, specs.train, c)
    memory = stage_memory(costs, hw, caps, specs.train, c)
    return prediction_of(specs, costs, hw, caps, c, times, memory, stage_work(costs, c))


def strategy_stage_times(specs: Specs, costs: ModelCosts, hw: HardwareModel,
                         caps: ExecutorCapabilities) -> StageTimes:
    """specs.strategy's times per stage as predict prices them: under a V schedule per rank, its two chunks'."""
    if specs.strategy.schedule in V_SCHEDULES:
        return rank_times(stage_times(costs, hw, caps, specs.train,
                                      chunk_candidates(specs.strategy, specs.model.seq_len)))
    return stage_times(costs, hw, caps, specs.train, stage_candidates(specs.strategy, specs.model.seq_len))


def _dual_pipe_v_prediction(specs: Specs, costs: ModelCosts, hw: HardwareModel,
                            caps: ExecutorCapabilities) -> Prediction:
    """A dualpipev strategy (cost/executors/dual_pipe_v.py): its 2S chunks priced as stages placed on their ranks,
    each rank the sum of its two; the per-stage lists of the Prediction are per rank."""
    chunks = chunk_candidates(specs.strategy, specs.model.seq_len)
    chunk_times = stage_times(costs, hw, caps, specs.train, chunks)
    memory = rank_memory(stage_memory(costs, hw, caps, specs.train, chunks), specs.strategy.parallelism.grad_accum)
    work = stage_work(costs, chunks)
    work = StageWork(flops_per_rank=per_rank(work.flops_per_rank), recompute_flops=per_rank(work.recompute_flops))
    return prediction_of(specs, costs, hw, caps, chunks, rank_times(chunk_times), memory, work, chunk_times)


def checked_caps(specs: Specs, caps: ExecutorCapabilities | None) -> ExecutorCapabilities:
    """`caps` (default: the strategy's executor), the strategy checked against it (ConfigError)."""
    caps = capabilities_of(caps or specs.strategy.runtime)
    check_executor(specs.strategy, caps, specs.model)
    return caps


@dataclass(frozen=True)
class StageWork:
    """Per stage (elementwise over candidates), FLOPs of one rank."""

    flops_per_rank: np.ndarray
    """An iteration's FLOPs, recompute included (cost/accounting.py, stage_flops)."""
    recompute_flops: np.ndarray
    """One micro-batch's recomputed forward FLOPs of the whole TP and sequence group (recompute x a rank's block
    forward x t q)."""


def stage_work(costs: ModelCosts, c: StageCandidates) -> StageWork:
    return StageWork(flops_per_rank=stage_flops(costs, c),
                     recompute_flops=c.recompute * on_rank(costs.block, "fwd_flops", c.b, c.s, c.t, c.q) * c.t * c.q)


def prediction_of(specs: Specs, costs: ModelCosts, hw: HardwareModel, caps: ExecutorCapabilities,
                  c: StageCandidates, times: StageTimes, memory: StageMemory, work: StageWork,
                  chunk_times: StageTimes | None = None) -> Prediction:
    """The Prediction of specs.strategy from its stages' priced times, memory and work (`c`: its stages, [S]; under a
    V schedule `c` and `chunk_times` are its 2S chunks', the rest its ranks')."""
    strategy = specs.strategy
    par = strategy.parallelism
    world = par.num_gpus
    chunks = strategy.virtual_stages
    if strategy.schedule in SPLIT_SCHEDULES:  # deferred W's keep their operands (cost/executors/zero_bubble.py)
        held = deferred_weight_bytes(costs, hw, c, strategy.schedule)
        memory = replace(memory, activations=memory.activations + held, peak_bytes=memory.peak_bytes + held)
    v_schedule = strategy.schedule in V_SCHEDULES
    simulation = _simulated_iteration(specs, hw, times, _weight_grad_s(specs, costs, hw, c, caps), chunk_times)
    simulated, tail = simulation.iteration_time_s, simulation.tail_s
    # DualPipeV has no closed form here (the tuner does not search it): its simulation stands in
    closed = simulated if v_schedule else float(iteration_time_s(times.stable_s, times.delta_s, par.grad_accum,
                                                                  tail, chunks))
    tokens = par.global_batch_size * specs.model.seq_len
    model_flops = specs.model.training_flops_per_token() * tokens
    recompute_flops = float(np.sum(work.recompute_flops)) * par.grad_accum * par.dp
    peak = hw.peak_flops_per_s
    usable = specs.cluster.gpu.usable_memory_bytes
    states = [{"weights": float(memory.weights[i]), "grads": float(memory.grads[i]),
               "optimizer": float(memory.optimizer[i]), "buffers": float(memory.state_buffers[i]),
               "host": float(memory.state_host[i])} for i in range(par.pp)]
    breakdown = [{part: float(getattr(memory, part)[i]) for part in MEMORY_PARTS} | {
        "reserve": float(specs.cluster.gpu.reserve_bytes)} for i in range(par.pp)]
    rule = specs.tuner.host_memory
    host = host_use(specs.cluster, rule, memory.host_bytes, par.stage_width)
    warnings = [f"stage {i} peaks at {peak_i / GIB:.2f} GiB, above the {usable / GIB:.2f} GiB usable per GPU"
                for i, peak_i in enumerate(memory.peak_bytes) if peak_i > usable]
    if not host.fits:
        warnings.append(host.excess_text(rule))
    return Prediction(
        iteration_time_s=simulated, iteration_time_closed_form_s=closed,
        throughput_samples_per_s=par.global_batch_size / simulated, tokens_per_s=tokens / simulated,
        mfu=model_flops / (simulated * world * peak), hfu=(model_flops + recompute_flops) / (simulated * world * peak),
        stage_stable_s=[float(x) for x in times.stable_s], stage_delta_s=[float(x) for x in times.delta_s],
        bubble_s=(pipeline_bubble_s(simulation.spans, times.stable_s, par.grad_accum)
                  if strategy.schedule in SPLIT_SCHEDULES or v_schedule else float(bubble_s(times.stable_s, chunks))),
        optimizer_s=float(np.max(times.optimizer_s)), tail_s=tail,
        peak_memory_bytes=[float(x) for x in memory.peak_bytes], memory_breakdown=breakdown,
        fits=not warnings,
        host_memory_bytes=float(np.max(node_host_bytes(memory.host_bytes, par.stage_width,
                                                       specs.cluster.gpus_per_node))),
        sources={**profile_sources((costs.embedding, costs.block, costs.head), hw, c.b, c.s, c.t, c.q,
                                   caps.runs_profiled_layers),
                 "memory_bound": "hbm-bandwidth", "collectives": "alpha-beta", "host": "pcie+cpu-adam"},
        warnings=warnings, strategy=strategy.to_dict(), model_state_bytes=states,
        host_bytes_per_rank=[float(x) for x in memory.host_bytes], host_memory_rule=rule,
        flops_per_rank=[float(x) for x in work.flops_per_rank],
        # the census of a V's collectives (two chunks per rank, the tied embedding shared on rank 0) is not written
        comm_bytes_per_rank=None if v_schedule else comm_bytes(costs, strategy, specs.train, caps, c,
                                                                hw.dtype_bytes))


def predict(specs: Specs, cache_dir: Path | None = None, caps: ExecutorCapabilities | None = None) -> Prediction:
    return predict_strategy(specs, model_costs(specs, cache_dir), hardware_model(specs.cluster, specs.train.precision),
                            caps)
