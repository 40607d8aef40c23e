"""The outer loop: every global point (t, S, d, b, G) of the space, in lower-bound order, pruned when
its bound exceeds the best plan found; per point the intra-stage fronts and the partition solver
(free-stage spaces) or a direct vectorized evaluation (fixed-partition spaces). A grid finer than the
default (tuner.grid=mist) is searched after the default one, whose best plan then bounds both the points
and, at each point, which fine options are priced at all (_price_by_bound).

Schedules (tuner.schedules): a pipeline point of a free-stage space is searched once per listed schedule its
executor runs and that composes with the point (1f1b always; zb-h1 where executor_rules.check_schedule_built lets
it); a split schedule prices its options' memory with their deferred W's and leaves out what it does not compose
with (activation offload), so the plan it finds fits as ZB-H1 runs it. The partition solvers minimize the schedule's
closed form (1F1B's, or ZB-H1's: tuner/partition.py); a zb-h1 plan's objective is its split's 1F1B closed form less
the bubble the event simulation says ZB-H1 saves on its stages (`_split_saving_s`), so both schedules' plans compete
in one frame (docs/design.md, Tuner, Schedules).

Determinism: points are priced in fixed rounds of fixed chunks, whatever the worker count; a point is
pruned only when its bound is strictly above the best time, so pruning never changes the optimum, and
ties are broken by the point's order.
"""
from __future__ import annotations

import dataclasses
import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from mist_ds.cost.host import host_fits, position_host_limits, shared_nodes
from mist_ds.cost.layer_time import layer_times
from mist_ds.cost.executors.zero_bubble import simulate_split, stage_weight_gradient_s
from mist_ds.cost.predict import model_costs, stage_candidates
from mist_ds.cost.simulate import simulate
from mist_ds.cost.candidates import ModelCosts, StageCandidates
from mist_ds.cost.stage import stage_times, tail_s
from mist_ds.cost.stage_memory import stage_memory
from mist_ds.cost.iteration import iteration_time_s
from mist_ds.hardware import HardwareModel, hardware_model
from mist_ds.hardware.interference import monotone_envelope
from mist_ds.specs import ConfigError, Parallelism, ExecutorCapabilities, Specs, StageStrategy, StrategySpec
from mist_ds.specs.executors import capabilities_of
from mist_ds.specs.executor_rules import allowed_stage_options, check_schedule_built
from mist_ds.specs.pipeline_order import SPLIT_SCHEDULES
from mist_ds.specs.strategy import degrees_text, partition_uniform
from mist_ds.specs.targets import TargetCapabilities
from mist_ds.specs.tuner import DEFAULT_OFFLOAD_RATIOS
from mist_ds.tuner.intra import (PointPricer, coarse_options, floor_stable_s, most_host_bytes, position_memory,
                                 stage_fronts)
from mist_ds.tuner.partition import solve_partition
from mist_ds.tuner.partition_model import HostSharing, Partition, host_of, partition_objective, split_terms
from mist_ds.tuner.space import (FREE_STAGE_SPACES, OPTION_KEYS, GlobalPoint, OptionGrids, fixed_partitions,
                                 global_points, layer_counts, stage_option_grid, tuner_executor)

CHUNK_POINTS = 4
CHUNKS_PER_ROUND = 4
# Relative slack of the fine-grid bound (docs/design.md, Tuner): G x (floor's stable time) above the coarse
# plan's objective by more than float noise excludes an option.
PRUNE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class SearchContext:
    """What every worker needs; rebuilt in each process from the specs (the analysis is cached on disk)."""

    specs: Specs
    space: str
    caps: ExecutorCapabilities
    cache_dir: Path | None = None
    incumbent_s: float = math.inf
    """The objective of a plan of this space already found (the default grid's best, when the grid is
    finer): no plan worth finding is slower."""
    coarse_objectives: dict | None = None
    """(point, variant) -> the objective of its best plan with the default grid (None where it has none),
    when the grid is finer and the default one was searched first."""

    @property
    def runtime(self) -> str:
        return self.caps.name

    @property
    def target(self) -> TargetCapabilities:
        """What consumes the plans (tuner.target): the stage options it cannot run are never priced."""
        return self.specs.tuner.target_row


@dataclass(frozen=True)
class PointResult:
    """The best strategy of one global point (None when nothing fits) and what pricing it took."""

    point: GlobalPoint
    variant: tuple[tuple[str, int | str], ...]
    """Uniform choices the runtime imposes, fixed per run of the solver (e.g. (("zero", 1),)), and the schedule
    where it is not 1F1B's order (("schedule", "zb-h1"))."""
    lower_bound_s: float
    objective_s: float | None
    strategy: StrategySpec | None
    candidates: int
    gap: float = 0.0
    solver: str = ""
    least_peak_bytes: float = math.inf
    """The least GPU peak any option of this point needs on its most loaded stage (bytes)."""
    closest: StrategySpec | None = None
    """The strategy of this point that comes closest to fitting (for the no-fit explanation)."""


@dataclass(frozen=True)
class SearchResult:
    space: str
    runtime: str
    best: PointResult | None
    points: tuple[PointResult, ...]
    pruned: tuple[tuple[GlobalPoint, float], ...]
    seconds: float

    @property
    def candidates(self) -> int:
        return sum(p.candidates for p in self.points)


def _refines_default_grid(specs: Specs, space: str, caps: ExecutorCapabilities) -> bool:
    """The space's per-stage options hold the default grid's and more (tuner.grid=mist on a runtime that
    offloads fractions): searched with the default grid first, for a bound."""
    grids = option_grids(specs)
    if space not in FREE_STAGE_SPACES:
        return False
    if not all(set(DEFAULT_OFFLOAD_RATIOS) <= set(g) for g in dataclasses.astuple(grids)):
        return False
    return any(not coarse_options(stage_option_grid(caps, space, grids, 1, pipeline, specs.tuner.target_row),
                                  DEFAULT_OFFLOAD_RATIOS).all() for pipeline in (False, True))


def _default_grid(specs: Specs) -> Specs:
    """The specs with the default offload grids (a subset of every grid that contains them)."""
    kinds = ("weights", "grads", "optimizer", "activations")
    tuner = dataclasses.replace(specs.tuner, grid="default",
                                **{f"{k}_offload_ratios": DEFAULT_OFFLOAD_RATIOS for k in kinds})
    return dataclasses.replace(specs, tuner=tuner)


def option_grids(specs: Specs) -> OptionGrids:
    tuner = specs.tuner
    return OptionGrids(weights=tuner.offload_ratios("weights"), grads=tuner.offload_ratios("grads"),
                       optimizer=tuner.offload_ratios("optimizer"), activations=tuner.offload_ratios("activations"))


# --- lower bound ---------------------------------------------------------------------------------------

def lower_bounds_s(costs: ModelCosts, hw: HardwareModel, points: list[GlobalPoint], fused: bool,
                   max_chunks=None, split=None, measured: bool = False) -> np.ndarray:
    """No plan of a point is faster than its bound (seconds; one array call for all points): every
    stage's stable time is at least its compute and TP time, so sum_i T_i >= L m + embedding + head,
    and max_i T_i >= sum_i T_i / S; G max T + (sum T - max T) / v >= sum T (G + (S - 1) / v) / S.
    fused: the runtime's ExecutorCapabilities.fused_kernels; max_chunks: per point, the most chunks
    per stage its plans may interleave (None: 1); split: per point, whether a schedule that splits the
    backward is searched there (None: nowhere): its bubble has no such bound, only G max T >= G sum T / S;
    measured: the runtime's ExecutorCapabilities.runs_profiled_layers (its layers priced as the stages price them)."""
    if not points:
        return np.zeros(0)
    b = np.array([p.micro_batch_size for p in points], dtype=np.float64)
    t = np.array([p.tp for p in points], dtype=np.float64)
    q = np.array([p.sp for p in points], dtype=np.float64)  # a rank's share of each sequence (its all-to-alls: >= 0)
    s = np.full_like(b, costs.model.seq_len)
    serial = [x.fwd_compute_s + x.bwd_compute_s + x.fwd_tp_s + x.bwd_tp_s
              for x in (layer_times(cost, hw, b, s, t, fused, q, measured)
                        for cost in (costs.embedding, costs.block, costs.head))]
    total = costs.model.num_layers * serial[1] + serial[0] + serial[2]
    chunks = np.ones(len(points)) if max_chunks is None else np.asarray(max_chunks, dtype=np.float64)
    splits = np.zeros(len(points), dtype=bool) if split is None else np.asarray(split, dtype=bool)
    factor = np.array([(p.grad_accum + (p.pp - 1) / v * (not z)) / p.pp for p, v, z in zip(points, chunks, splits)])
    return total * factor


def lower_bound_s(costs: ModelCosts, hw: HardwareModel, point: GlobalPoint, fused: bool, max_chunks: int = 1) -> float:
    return float(lower_bounds_s(costs, hw, [point], fused, [max_chunks])[0])


# --- one point -------------------------------------------------------------------------------------------

def _variants(caps: ExecutorCapabilities, grid_zero: np.ndarray, point: GlobalPoint,
              min_layers: int) -> list[tuple[tuple[str, int], ...]]:
    """Choices a runtime forces to be equal on every stage, enumerated outside the partition solver."""
    zeros = sorted({int(z) for z in grid_zero}) if caps.uniform_zero and point.pp > 1 else [None]
    recompute_counts = list(range(min_layers + 1)) if caps.uniform_recompute and point.pp > 1 else [None]
    out = []
    for z in zeros:
        for k in recompute_counts:
            out.append(tuple((name, v) for name, v in (("zero", z), ("recompute", k)) if v is not None))
    return out


def _stage_strategy(options: dict[str, np.ndarray], k: int, layers: int, recompute: float) -> StageStrategy:
    """Stage of `layers` blocks with option k of `options` (recompute count given: the fixed-partition
    spaces keep it apart from the other options)."""
    return StageStrategy(layers=int(layers), ckpt_layers=int(recompute), zero_stage=int(options["zero"][k]),
                         weights_offload=float(options["wo"][k]), grads_offload=float(options["go"][k]),
                         optimizer_offload=float(options["oo"][k]), activations_offload=float(options["ao"][k]))


def _stage_strategies(options: dict[str, np.ndarray], layers: list[int],
                      chosen: list[int]) -> tuple[StageStrategy, ...]:
    return tuple(_stage_strategy(options, k, l, options["recompute"][k]) for l, k in zip(layers, chosen))


def _strategy(runtime: str, point: GlobalPoint, stages: tuple[StageStrategy, ...], chunks: int = 1,
              schedule: str = "1f1b") -> StrategySpec:
    par = Parallelism(tp=point.tp, pp=point.pp, dp=point.dp, micro_batch_size=point.micro_batch_size,
                      grad_accum=point.grad_accum, sp=point.sp)
    return StrategySpec(runtime=runtime, parallelism=par, stages=stages,
                        schedule="interleaved" if chunks > 1 else schedule, virtual_stages=chunks)


def point_schedules(specs: Specs, caps: ExecutorCapabilities, point: GlobalPoint) -> tuple[str, ...]:
    """The schedules (tuner.schedules) a point is searched with on `caps`: 1f1b, and each other one the executor
    runs that composes with the point (executor_rules.check_schedule_built, on a probe of its layout without
    activation offload, which the search then leaves out); a single stage has no order to choose."""
    if point.pp == 1:
        return ("1f1b",)
    probe = _strategy(caps.name, point, tuple(StageStrategy(layers=l, ckpt_layers=0, zero_stage=0)
                                              for l in partition_uniform(specs.model.num_layers, point.pp)))
    out = []
    for schedule in specs.tuner.schedules:
        if schedule != "1f1b" and schedule not in caps.built_schedules:
            continue
        try:
            check_schedule_built(dataclasses.replace(probe, schedule=schedule), caps, specs.train.precision,
                                 specs.model)
        except ConfigError:
            continue
        out.append(schedule)
    return tuple(out)


def _schedule_variant(variant: tuple, schedule: str) -> tuple:
    """A solver variant with its schedule: 1F1B's order adds nothing (the variants of a search without one)."""
    return variant if schedule == "1f1b" else (*variant, ("schedule", schedule))


def _split_saving_s(specs: Specs, costs: ModelCosts, hw: HardwareModel, caps: ExecutorCapabilities,
                    strategy: StrategySpec) -> float:
    """Seconds the event simulation of `strategy`'s stages takes off 1F1B's when its schedule splits the backward
    (cost/executors/zero_bubble.py simulate_split, cost/simulate.py simulate): what a split schedule's objective
    subtracts from the 1F1B closed form."""
    c = stage_candidates(strategy, specs.model.seq_len)
    times = stage_times(costs, hw, caps, specs.train, c)
    weight_s = stage_weight_gradient_s(costs, hw, c, caps.runs_profiled_layers)
    G, end = strategy.parallelism.grad_accum, list(times.end_s)
    one_f_one_b, _ = simulate(times.fwd_s, times.bwd_s, times.first_fwd_extra_s, times.last_bwd_extra_s, G, end)
    split, _ = simulate_split(times.fwd_s, times.bwd_s - weight_s, weight_s, times.first_fwd_extra_s,
                              times.last_bwd_extra_s, G, end)
    return one_f_one_b - split


def _one_f_one_b_closed_form_s(options, partition: Partition, G: int, imbalance: bool) -> float:
    """The 1F1B closed form (seconds, tuner/partition.py) of a split the solver chose in another schedule's."""
    picked = [(options[i, l], k) for i, (l, k) in enumerate(zip(partition.layers, partition.option))]
    return partition_objective(*([getattr(o, name)[k] for o, k in picked] for name in ("stable_s", "delta_s", "end_s")),
                               G, imbalance)


def _host_limits(specs: Specs, point: GlobalPoint) -> tuple[np.ndarray, HostSharing | None]:
    """(the most host bytes one rank of each position may keep, the nodes whose stages share host memory):
    tuner.host_memory's rule on the point's placement (cost/host.py)."""
    cluster, rule, width = specs.cluster, specs.tuner.host_memory, point.stage_width
    rows = shared_nodes(cluster, rule, point.pp, width)
    sharing = HostSharing(rows, cluster.cpu_memory_bytes) if rows else None
    return position_host_limits(cluster, rule, point.pp, width), sharing


def _least_peak(priced, layers: tuple[int, ...]) -> tuple[float, list[int]]:
    """(the largest over positions of the least peak any option needs there, bytes; per position the
    option of least peak among those holding layers[i] blocks): no plan of the point needs less, and
    the options picked form the plan that comes closest to fitting."""
    worst, chosen = 0.0, []
    for i, l in enumerate(layers):
        peak, _ = position_memory(priced, i)
        worst = max(worst, float(np.min(peak)))
        chosen.append(int(np.argmin(np.where(priced.layers == l, peak, np.inf))))
    return worst, chosen


def _solve_variant(ctx: SearchContext, point: GlobalPoint, host_limits: np.ndarray, sharing: HostSharing | None,
                   priced, variant, allowed: np.ndarray | None = None):
    """(fronts, best split or None) of the point's options under a variant's uniform choices (and `allowed`).
    With host memory shared by the stages of a node, tuner.partition_solver=auto first solves without the
    coupling on the (stable, delta, end) fronts: when that optimum fits the nodes it is the optimum, and the
    fronts with host bytes as a fourth criterion, larger, are never built."""
    specs = ctx.specs
    allowed = np.ones(priced.layers.size, dtype=bool) if allowed is None else allowed.copy()
    for name, value in variant:
        if name == "schedule":  # a split schedule keeps to what it composes with (executor_rules)
            if value in SPLIT_SCHEDULES and not ctx.caps.split_backward.activations_offload:
                allowed &= priced.options["ao"] == 0
            continue
        allowed &= priced.options[name] == value
    usable = specs.cluster.gpu.usable_memory_bytes
    split = any(name == "schedule" and value in SPLIT_SCHEDULES for name, value in variant)

    def solve(fronts, method, host):
        try:
            return solve_partition(fronts.options, point.pp, specs.model.num_layers, point.grad_accum,
                                   imbalance=ctx.space != "aceso", method=method,
                                   time_limit_s=specs.tuner.milp_time_limit_s, host=host, split=split)
        except TimeoutError as timeout:
            raise ConfigError("tuner.milp_time_limit_s", specs.tuner.milp_time_limit_s,
                              f"the partition MILP found no split of {degrees_text(point)} within it: raise it, or use "
                              "tuner.host_memory=per-gpu (solved by the DP)") from timeout

    if sharing is not None and specs.tuner.partition_solver == "auto":
        fronts = stage_fronts(priced, usable, host_limits, allowed)
        relaxed = solve(fronts, "dp", None)
        if relaxed is None or sharing.fits(host_of(fronts.options, relaxed)):
            return fronts, relaxed
    fronts = stage_fronts(priced, usable, host_limits, allowed, host_criterion=sharing is not None)
    return fronts, solve(fronts, specs.tuner.partition_solver, sharing)


def _price_by_bound(pricer: PointPricer, priced, coarse: np.ndarray, coarse_plans, incumbent_s: float,
                    grids: OptionGrids):
    """A grid finer than the default (tuner.grid=mist): price the coarse options (every offload fraction
    in the default grid) first, memory and times of all of them. Their best plan (`coarse_plans(priced)`:
    its objective per variant, None where none fits) is a plan of the fine grid too, and a plan with an
    option of stable time T costs at least G T plus the other S - 1 stages' least stable time: no option
    of the point's best plan exceeds that plan's objective, nor (in a plan better than the search's
    incumbent) `incumbent_s`: call the smaller U. An option's stable time is at least its floor's
    (floor_stable_s), so only the options whose bound with the floor is within U are priced further
    (docs/design.md, Tuner, Grids). A point that cannot beat the incumbent keeps a plan no better than
    its own best, never a faster one. Under a split schedule the coarse plans' objectives are ZB-H1's closed
    form (partition.py), and so is the bound: the option's terms of its maximum and its sums with the floor's
    stable time and the most W of its layer count, and the other S - 1 stages' least term of the sums."""
    priced = pricer.times(pricer.memory(priced, coarse), coarse)
    upper = min(incumbent_s, max(math.inf if s is None else s for s in coarse_plans(priced)))
    bounding = _monotone_times(pricer, priced, coarse)
    floor = floor_stable_s(bounding, DEFAULT_OFFLOAD_RATIOS, grids)
    S, G = pricer.point.pp, pricer.point.grad_accum
    if pricer.schedule in SPLIT_SCHEDULES:  # position 1: the least terms wherever the stage is (split_terms)
        peak, fill = split_terms(floor, np.max(priced.weight_s, axis=0), 1, S, G)
        least_fill = split_terms(bounding.stable_s[:, coarse], bounding.weight_s[:, coarse], 1, S, G)[1]
        least = (G - 1) * peak + fill + (S - 1) * float(np.min(least_fill))
    else:
        # The other S - 1 stages take at least the least stable time of all: an option without offload.
        least = G * floor + (S - 1) * float(np.min(bounding.stable_s[:, coarse]))
    fast = least <= upper * (1 + PRUNE_TOLERANCE)
    priced = pricer.memory(priced, fast)
    return pricer.times(priced, priced.fits & fast)


def _monotone_times(pricer: PointPricer, priced, coarse: np.ndarray):
    """`priced`, or where the cluster's interference table is not monotone a copy whose coarse options are
    timed under its monotone envelope: stable times that never fall when an offload fraction rises and
    never exceed the real ones, so that a floor's bounds every option above it (docs/design.md, Tuner,
    Grids)."""
    table = pricer.hw.interference_table
    envelope = monotone_envelope(table)
    if np.array_equal(envelope, table):
        return priced
    lower = dataclasses.replace(pricer, hw=dataclasses.replace(pricer.hw, interference_table=envelope))
    copy = dataclasses.replace(priced, stable_s=priced.stable_s.copy(), delta_s=priced.delta_s.copy(),
                               end_s=priced.end_s.copy(), timed=priced.timed & ~coarse)
    return lower.times(copy, coarse)


def _coarse_plans(ctx: SearchContext, point: GlobalPoint, variants, solve, coarse: np.ndarray, priced) -> list:
    """Per variant, the objective of the point's best plan with the default grid: as the search that ran first
    found it (its final objective, at least the partition's), else solved on the coarse options."""
    if ctx.coarse_objectives is not None and all((point, v) in ctx.coarse_objectives for v in variants):
        return [ctx.coarse_objectives[point, v] for v in variants]
    return [None if p is None else p.objective_s for p in (solve(priced, v, coarse)[1] for v in variants)]


def _free_point(ctx: SearchContext, costs: ModelCosts, hw: HardwareModel, caps: ExecutorCapabilities,
                point: GlobalPoint, bound: float) -> list[PointResult]:
    """The point's best plan per solver variant and schedule (point_schedules)."""
    return [r for schedule in point_schedules(ctx.specs, caps, point)
            for r in _free_point_scheduled(ctx, costs, hw, caps, point, bound, schedule)]


def _free_point_scheduled(ctx: SearchContext, costs: ModelCosts, hw: HardwareModel, caps: ExecutorCapabilities,
                          point: GlobalPoint, bound: float, schedule: str) -> list[PointResult]:
    specs = ctx.specs
    L = specs.model.num_layers
    counts = layer_counts(L, point.pp, specs.tuner.layer_slack)
    host_limits, sharing = _host_limits(specs, point)
    pricer = PointPricer(costs, hw, caps, specs.train, point, specs.cluster.gpu.usable_memory_bytes, host_limits,
                         ctx.target, schedule)
    priced = pricer.options(ctx.space, option_grids(specs), counts)
    variants = [_schedule_variant(v, schedule) for v in _variants(caps, priced.options["zero"], point, min(counts))]
    solve = partial(_solve_variant, ctx, point, host_limits, sharing)
    coarse = coarse_options(priced.options, DEFAULT_OFFLOAD_RATIOS)
    if coarse.all():
        priced = pricer.memory(priced)
        priced = pricer.times(priced, priced.fits)
    else:
        priced = _price_by_bound(pricer, priced, coarse, partial(_coarse_plans, ctx, point, variants, solve, coarse),
                                 ctx.incumbent_s, option_grids(specs))
    if sharing is not None and sharing.fits(most_host_bytes(priced, pricer.usable_bytes, host_limits)):
        sharing = None  # no node can overflow, whatever its stages pick: each position's limit is all there is
        solve = partial(_solve_variant, ctx, point, host_limits, sharing)
    uniform = partition_uniform(L, point.pp)
    least, nearest = _least_peak(priced, uniform)
    closest = _strategy(ctx.runtime, point, _stage_strategies(priced.options, list(uniform), nearest))
    world = point.num_gpus
    results = []
    for variant in variants:
        fronts, partition = solve(priced, variant)
        if partition is None:
            results.append(PointResult(point, variant, bound, None, None, priced.count, least_peak_bytes=least,
                                       closest=closest))
            continue
        chosen = [int(fronts.indices[(i, l)][k]) for i, (l, k) in enumerate(zip(partition.layers, partition.option))]
        strategy = _strategy(ctx.runtime, point, _stage_strategies(priced.options, list(partition.layers), chosen),
                             schedule=schedule)
        # The partition's objective holds the slowest end work; the tail adds the norm sync after it.
        end_max = max(float(priced.end_s[priced.position_class[i], j]) for i, j in enumerate(chosen))
        closed = partition.objective_s
        if schedule in SPLIT_SCHEDULES:  # solved in ZB-H1's closed form, ranked in 1F1B's frame (module docstring)
            closed = _one_f_one_b_closed_form_s(fronts.options, partition, point.grad_accum, ctx.space != "aceso")
        objective = closed - end_max + float(tail_s(hw, specs.train, end_max, world))
        if schedule in SPLIT_SCHEDULES:
            objective -= _split_saving_s(specs, costs, hw, caps, strategy)
        results.append(PointResult(point, variant, bound, objective, strategy, priced.count, gap=partition.gap,
                                   solver=partition.solver, least_peak_bytes=least, closest=closest))
    return results


def recompute_choices(layers: tuple[int, ...], space: str) -> np.ndarray:
    """[choices, S] recompute counts for spaces with one option on every stage: the same count k on
    every stage (Megatron's uniform recompute), or every layer of every stage ("full")."""
    if space == "deepspeed":
        return np.zeros((1, len(layers)))
    uniform = np.repeat(np.arange(min(layers) + 1, dtype=np.float64)[:, None], len(layers), axis=1)
    full = np.array(layers, dtype=np.float64)[None, :]
    return np.unique(np.concatenate([uniform, full]), axis=0)


def _fixed_candidates(caps: ExecutorCapabilities, space: str, grids: OptionGrids, layers: tuple[int, ...],
                      pipeline: bool, target: TargetCapabilities) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(recompute [n, S], other options [n] each) every stage of the partition can run."""
    others = stage_option_grid(caps, space, grids, 1, pipeline, target)
    keys = [k for k in OPTION_KEYS if k != "recompute"]
    rows = np.unique(np.stack([others[k] for k in keys], axis=1), axis=0)
    recompute = recompute_choices(layers, space)
    pick_recompute, pick_row = (a.ravel() for a in np.meshgrid(np.arange(len(recompute)), np.arange(len(rows)),
                                                               indexing="ij"))
    recompute, options = recompute[pick_recompute], {k: rows[pick_row, j] for j, k in enumerate(keys)}
    ok = np.ones(len(recompute), dtype=bool)
    for i, l in enumerate(layers):
        ok &= allowed_stage_options(caps, l, pipeline, recompute=recompute[:, i], **options, target=target)
    return recompute[ok], {k: v[ok] for k, v in options.items()}


def _fixed_point(ctx: SearchContext, costs: ModelCosts, hw: HardwareModel, caps: ExecutorCapabilities,
                 point: GlobalPoint, bound: float) -> list[PointResult]:
    """Spaces with a fixed partition and one option for every stage: price [candidates, S] directly."""
    specs = ctx.specs
    usable = specs.cluster.gpu.usable_memory_bytes
    S, L = point.pp, specs.model.num_layers
    world = point.num_gpus
    best, closest, count = None, None, 0
    for layers, chunks in _partitions_and_chunks(ctx, caps, point):
        recompute, opts = _fixed_candidates(caps, ctx.space, option_grids(specs), layers, S > 1, ctx.target)
        if not len(recompute):
            continue
        column = {k: v[:, None] for k, v in opts.items()}
        c = StageCandidates.of(b=point.micro_batch_size, s=specs.model.seq_len, t=point.tp, d=point.data_group_size,
                               q=point.sp, pp=S,
                               G=point.grad_accum, stage=np.arange(S)[None, :], layers=np.array(layers)[None, :],
                               recompute=recompute, v=chunks, **column)
        times = stage_times(costs, hw, caps, specs.train, c)
        memory = stage_memory(costs, hw, caps, specs.train, c)
        count += times.stable_s.size
        worst_peak = np.max(memory.peak_bytes, axis=1)
        j = int(np.argmin(worst_peak))
        if closest is None or worst_peak[j] < closest[0]:
            stages = _uniform_stages(layers, recompute[j], opts, j)
            closest = (float(worst_peak[j]), _strategy(ctx.runtime, point, stages, chunks))
        tail = tail_s(hw, specs.train, np.max(times.end_s, axis=1), world)
        total = iteration_time_s(times.stable_s, times.delta_s, point.grad_accum, tail, chunks)
        ok = np.all(memory.peak_bytes <= usable, axis=1) & host_fits(specs.cluster, specs.tuner.host_memory,
                                                                      memory.host_bytes, point.stage_width)
        if ok.any():
            j = int(np.flatnonzero(ok)[np.argmin(total[ok])])
            if best is None or total[j] < best[0]:
                best = (float(total[j]), _strategy(ctx.runtime, point, _uniform_stages(layers, recompute[j], opts, j),
                                                   chunks))
    least, near = closest if closest else (math.inf, None)
    if best is None:
        return [PointResult(point, (), bound, None, None, count, least_peak_bytes=least, closest=near)]
    return [PointResult(point, (), bound, best[0], best[1], count, solver="direct", least_peak_bytes=least,
                        closest=near)]


def _partitions_and_chunks(ctx: SearchContext, caps: ExecutorCapabilities, point: GlobalPoint):
    """(layers per stage, chunks per stage) the fixed-partition space prices: each partition with
    plain 1F1B, and, where the runtime interleaves, each uniform one with every chunk count that
    divides its stages (Megatron-LM's rule: micro-batches a multiple of the stages)."""
    for layers in fixed_partitions(ctx.specs.model.num_layers, point.pp, ctx.space, ctx.specs.tuner.layer_slack):
        yield layers, 1
        if _interleaves(caps, ctx.space, point) and len(set(layers)) == 1:
            for chunks in range(2, layers[0] + 1):
                if layers[0] % chunks == 0:
                    yield layers, chunks


def _interleaves(caps: ExecutorCapabilities, space: str, point: GlobalPoint) -> bool:
    return ("interleaved" in caps.schedules and space == "megatron" and point.pp > 1
            and point.grad_accum % point.pp == 0)


def _uniform_stages(layers, recompute_row, opts, j) -> tuple[StageStrategy, ...]:
    return tuple(_stage_strategy(opts, j, l, c) for l, c in zip(layers, recompute_row))


# --- workers ------------------------------------------------------------------------------------------------

def _state(ctx: SearchContext) -> tuple:
    """(costs, hardware, capabilities): the analysis loads from the disk cache in milliseconds."""
    costs = model_costs(ctx.specs, ctx.cache_dir)
    hw = hardware_model(ctx.specs.cluster, ctx.specs.train.precision)
    return costs, hw, ctx.caps


def price_points(ctx: SearchContext, chunk: list[tuple[GlobalPoint, float]], state: tuple | None = None
                 ) -> list[PointResult]:
    costs, hw, caps = state or _state(ctx)
    price = _free_point if ctx.space in FREE_STAGE_SPACES else _fixed_point
    out = []
    for point, bound in chunk:
        out.extend(price(ctx, costs, hw, caps, point, bound))
    return out


def _best(results) -> PointResult | None:
    feasible = [r for r in results if r.objective_s is not None]
    return min(feasible, key=lambda r: (r.objective_s, r.point, r.variant)) if feasible else None


def search(specs: Specs, space: str | None = None, runtime: str | ExecutorCapabilities | None = None,
           cache_dir: Path | None = None, progress: bool | None = None) -> SearchResult:
    """Best strategy of `space` (default specs.tuner.space) on `runtime`, a name or a capability value
    (default: the tuner's)."""
    start = time.perf_counter()
    space = space or specs.tuner.space
    caps = capabilities_of(runtime or tuner_executor(specs.tuner), "tuner.runtime")
    incumbent, coarse = math.inf, None
    if _refines_default_grid(specs, space, caps):
        # Its best plan with the default grid, a part of this one, bounds the search (docs/design.md, Tuner, Grids).
        warm = search(_default_grid(specs), space, caps, cache_dir, progress=False)
        incumbent = warm.best.objective_s if warm.best is not None else math.inf
        # A split schedule's plan objective (1F1B's frame less the simulated saving) is no bound of its partition's
        # (ZB-H1's closed form): those points are bounded by their coarse plans' closed form, solved again
        # (_coarse_plans).
        coarse = {(p.point, p.variant): p.objective_s for p in warm.points
                  if not any(name == "schedule" for name, _ in p.variant)}
    ctx = SearchContext(specs=specs, space=space, caps=caps, cache_dir=cache_dir, incumbent_s=incumbent,
                        coarse_objectives=coarse)
    state = _state(ctx)
    costs, hw, caps = state
    points = global_points(specs.model, specs.cluster, specs.train, specs.tuner, space, caps)
    chunks = [specs.model.num_layers // p.pp if _interleaves(caps, space, p) else 1 for p in points]
    split = [space in FREE_STAGE_SPACES and any(s in SPLIT_SCHEDULES for s in point_schedules(specs, caps, p))
             for p in points]
    bounds = lower_bounds_s(costs, hw, points, caps.fused_kernels, chunks, split, caps.runs_profiled_layers)
    ordered = sorted(((p, float(b)) for p, b in zip(points, bounds)), key=lambda pb: (pb[1], pb[0]))
    results: list[PointResult] = []
    pruned: list[tuple[GlobalPoint, float]] = []
    chunks = [ordered[i:i + CHUNK_POINTS] for i in range(0, len(ordered), CHUNK_POINTS)]
    show = sys.stderr.isatty() if progress is None else progress
    bar = _progress_bar(len(ordered), show)
    pool = (ProcessPoolExecutor(specs.tuner.workers, mp_context=multiprocessing.get_context("spawn"))
            if specs.tuner.workers > 1 and len(chunks) > 1 else None)
    try:
        for r in range(0, len(chunks), CHUNKS_PER_ROUND):
            best = _best(results)
            todo = []
            limit = min(incumbent, math.inf if best is None else best.objective_s)
            for chunk in chunks[r:r + CHUNKS_PER_ROUND]:
                keep = [(p, b) for p, b in chunk if b <= limit]
                pruned.extend((p, b) for p, b in chunk if b > limit)
                if keep:
                    todo.append(keep)
            priced = (pool.map(price_points, [ctx] * len(todo), todo) if pool
                      else (price_points(ctx, c, state) for c in todo))
            for chunk_results in priced:
                results.extend(chunk_results)
            if bar is not None:
                bar.update(sum(len(c) for c in chunks[r:r + CHUNKS_PER_ROUND]))
    finally:
        if pool is not None:
            pool.shutdown()
        if bar is not None:
            bar.close()
    return SearchResult(space=space, runtime=caps.name, best=_best(results), points=tuple(results),
                        pruned=tuple(pruned), seconds=time.perf_counter() - start)


def _progress_bar(total: int, show: bool):
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="point", desc="tuning", leave=False, file=sys.stderr)


__all__ = ["PointResult", "SearchContext", "SearchResult", "lower_bound_s", "lower_bounds_s", "option_grids",
           "price_points", "search"]
