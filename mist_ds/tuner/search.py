"""The outer loop: every global point (t, S, d, b, G) of the space, in lower-bound order, pruned when
its bound exceeds the best plan found; per point the intra-stage fronts and the partition solver
(free-stage spaces) or a direct vectorized evaluation (fixed-partition spaces).

Determinism: points are priced in fixed rounds of fixed chunks, whatever the worker count; a point is
pruned only when its bound is strictly above the best time, so pruning never changes the optimum, and
ties are broken by the point's order.
"""
from __future__ import annotations

import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mist_ds.cost.layer_time import layer_times
from mist_ds.cost.predict import model_costs
from mist_ds.cost.stage import ModelCosts, StageCandidates, stage_memory, stage_times, tail_s
from mist_ds.cost.iteration import iteration_time_s
from mist_ds.hardware import HardwareModel, hardware_model
from mist_ds.specs import Parallelism, RuntimeCapabilities, Specs, StageStrategy, StrategySpec
from mist_ds.specs.runtime import allowed_stage_options, capabilities_of
from mist_ds.specs.strategy import partition_uniform
from mist_ds.tuner.intra import position_memory, price_options, stage_fronts
from mist_ds.tuner.partition import solve_partition
from mist_ds.tuner.space import (FREE_STAGE_SPACES, OPTION_KEYS, GlobalPoint, OptionGrids, fixed_partitions,
                                 global_points, layer_counts, stage_option_grid, tuner_runtime)

CHUNK_POINTS = 4
CHUNKS_PER_ROUND = 4


@dataclass(frozen=True)
class SearchContext:
    """What every worker needs; rebuilt in each process from the specs (the analysis is cached on disk)."""

    specs: Specs
    space: str
    caps: RuntimeCapabilities
    cache_dir: Path | None = None

    @property
    def runtime(self) -> str:
        return self.caps.name


@dataclass(frozen=True)
class PointResult:
    """The best strategy of one global point (None when nothing fits) and what pricing it took."""

    point: GlobalPoint
    variant: tuple[tuple[str, int], ...]
    """Uniform choices the runtime imposes, fixed per run of the solver (e.g. (("zero", 1),))."""
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


def option_grids(specs: Specs) -> OptionGrids:
    tuner = specs.tuner
    return OptionGrids(weights=tuner.weights_offload_ratios, grads=tuner.grads_offload_ratios,
                       optimizer=tuner.optimizer_offload_ratios, activations=tuner.activations_offload_ratios)


# --- lower bound ---------------------------------------------------------------------------------------

def lower_bounds_s(costs: ModelCosts, hw: HardwareModel, points: list[GlobalPoint], fused: bool,
                   max_chunks=None) -> np.ndarray:
    """No plan of a point is faster than its bound (seconds; one array call for all points): every
    stage's stable time is at least its compute and TP time, so sum_i T_i >= L m + embedding + head,
    and max_i T_i >= sum_i T_i / S; G max T + (sum T - max T) / v >= sum T (G + (S - 1) / v) / S.
    fused: the runtime's RuntimeCapabilities.fused_kernels; max_chunks: per point, the most chunks
    per stage its plans may interleave (None: 1)."""
    if not points:
        return np.zeros(0)
    b = np.array([p.micro_batch_size for p in points], dtype=np.float64)
    t = np.array([p.tp for p in points], dtype=np.float64)
    s = np.full_like(b, costs.model.seq_len)
    serial = [x.fwd_compute_s + x.bwd_compute_s + x.fwd_tp_s + x.bwd_tp_s
              for x in (layer_times(cost, hw, b, s, t, fused) for cost in (costs.embedding, costs.block, costs.head))]
    total = costs.model.num_layers * serial[1] + serial[0] + serial[2]
    chunks = np.ones(len(points)) if max_chunks is None else np.asarray(max_chunks, dtype=np.float64)
    factor = np.array([(p.grad_accum + (p.pp - 1) / v) / p.pp for p, v in zip(points, chunks)])
    return total * factor


def lower_bound_s(costs: ModelCosts, hw: HardwareModel, point: GlobalPoint, fused: bool, max_chunks: int = 1) -> float:
    return float(lower_bounds_s(costs, hw, [point], fused, [max_chunks])[0])


# --- one point -------------------------------------------------------------------------------------------

def _variants(caps: RuntimeCapabilities, grid_zero: np.ndarray, point: GlobalPoint,
              min_layers: int) -> list[tuple[tuple[str, int], ...]]:
    """Choices a runtime forces to be equal on every stage, enumerated outside the partition solver."""
    zeros = sorted({int(z) for z in grid_zero}) if caps.uniform_zero and point.pp > 1 else [None]
    ckpts = list(range(min_layers + 1)) if caps.uniform_ckpt and point.pp > 1 else [None]
    out = []
    for z in zeros:
        for k in ckpts:
            out.append(tuple((name, v) for name, v in (("zero", z), ("ckpt", k)) if v is not None))
    return out


def _stage_strategy(options: dict[str, np.ndarray], k: int, layers: int, ckpt: float) -> StageStrategy:
    """Stage of `layers` blocks with option k of `options` (recompute count given: the fixed-partition
    spaces keep it apart from the other options)."""
    return StageStrategy(layers=int(layers), ckpt_layers=int(ckpt), zero_stage=int(options["zero"][k]),
                         weights_offload=float(options["wo"][k]), grads_offload=float(options["go"][k]),
                         optimizer_offload=float(options["oo"][k]), activations_offload=float(options["ao"][k]))


def _stage_strategies(options: dict[str, np.ndarray], layers: list[int], chosen: list[int]) -> tuple[StageStrategy, ...]:
    return tuple(_stage_strategy(options, k, l, options["ckpt"][k]) for l, k in zip(layers, chosen))


def _strategy(runtime: str, point: GlobalPoint, stages: tuple[StageStrategy, ...], chunks: int = 1) -> StrategySpec:
    par = Parallelism(tp=point.tp, pp=point.pp, dp=point.dp, micro_batch_size=point.micro_batch_size,
                      grad_accum=point.grad_accum)
    return StrategySpec(runtime=runtime, parallelism=par, stages=stages,
                        schedule="interleaved" if chunks > 1 else "1f1b", virtual_stages=chunks)


def _memory_limits(specs: Specs) -> tuple[float, float]:
    cluster = specs.cluster
    return cluster.gpu.usable_memory_bytes, cluster.host_bytes_per_gpu


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


def _free_point(ctx: SearchContext, costs: ModelCosts, hw: HardwareModel, caps: RuntimeCapabilities,
                point: GlobalPoint, bound: float) -> list[PointResult]:
    specs = ctx.specs
    L = specs.model.num_layers
    counts = layer_counts(L, point.pp, specs.tuner.layer_slack)
    priced = price_options(costs, hw, caps, specs.train, point, ctx.space, option_grids(specs), counts)
    usable, host = _memory_limits(specs)
    uniform = partition_uniform(L, point.pp)
    least, nearest = _least_peak(priced, uniform)
    closest = _strategy(ctx.runtime, point, _stage_strategies(priced.options, list(uniform), nearest))
    world = point.tp * point.pp * point.dp
    results = []
    for variant in _variants(caps, priced.options["zero"], point, min(counts)):
        allowed = np.ones(priced.layers.size, dtype=bool)
        for name, value in variant:
            allowed &= priced.options[name] == value
        fronts = stage_fronts(priced, usable, host, allowed)
        partition = solve_partition(fronts.options, point.pp, L, point.grad_accum,
                                    imbalance=ctx.space != "aceso", time_limit_s=specs.tuner.milp_time_limit_s)
        if partition is None:
            results.append(PointResult(point, variant, bound, None, None, priced.count, least_peak_bytes=least,
                                       closest=closest))
            continue
        chosen = [int(fronts.indices[(i, l)][k]) for i, (l, k) in enumerate(zip(partition.layers, partition.option))]
        strategy = _strategy(ctx.runtime, point, _stage_strategies(priced.options, list(partition.layers), chosen))
        # The partition's objective holds the slowest end work; the tail adds the norm sync after it.
        end_max = max(float(priced.end_s[priced.position_class[i], j]) for i, j in enumerate(chosen))
        objective = partition.objective_s - end_max + float(tail_s(hw, specs.train, end_max, world))
        results.append(PointResult(point, variant, bound, objective, strategy, priced.count, gap=partition.gap,
                                   solver=partition.solver, least_peak_bytes=least, closest=closest))
    return results


def ckpt_choices(layers: tuple[int, ...], space: str) -> np.ndarray:
    """[choices, S] recompute counts for spaces with one option on every stage: the same count k on
    every stage (Megatron's uniform recompute), or every layer of every stage ("full")."""
    if space == "deepspeed":
        return np.zeros((1, len(layers)))
    uniform = np.repeat(np.arange(min(layers) + 1, dtype=np.float64)[:, None], len(layers), axis=1)
    full = np.array(layers, dtype=np.float64)[None, :]
    return np.unique(np.concatenate([uniform, full]), axis=0)


def _fixed_candidates(caps: RuntimeCapabilities, space: str, grids: OptionGrids, layers: tuple[int, ...],
                      pipeline: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(ckpt [n, S], other options [n] each) every stage of the partition can run."""
    others = stage_option_grid(caps, space, grids, 1, pipeline)
    keys = [k for k in OPTION_KEYS if k != "ckpt"]
    rows = np.unique(np.stack([others[k] for k in keys], axis=1), axis=0)
    ckpt = ckpt_choices(layers, space)
    pick_ckpt, pick_row = (a.ravel() for a in np.meshgrid(np.arange(len(ckpt)), np.arange(len(rows)), indexing="ij"))
    ckpt, options = ckpt[pick_ckpt], {k: rows[pick_row, j] for j, k in enumerate(keys)}
    ok = np.ones(len(ckpt), dtype=bool)
    for i, l in enumerate(layers):
        ok &= allowed_stage_options(caps, l, pipeline, ckpt=ckpt[:, i], **options)
    return ckpt[ok], {k: v[ok] for k, v in options.items()}


def _fixed_point(ctx: SearchContext, costs: ModelCosts, hw: HardwareModel, caps: RuntimeCapabilities,
                 point: GlobalPoint, bound: float) -> list[PointResult]:
    """Spaces with a fixed partition and one option for every stage: price [candidates, S] directly."""
    specs = ctx.specs
    usable, host = _memory_limits(specs)
    S, L = point.pp, specs.model.num_layers
    world = point.tp * S * point.dp
    best, closest, count = None, None, 0
    for layers, chunks in _partitions_and_chunks(ctx, caps, point):
        ckpt, opts = _fixed_candidates(caps, ctx.space, option_grids(specs), layers, S > 1)
        if not len(ckpt):
            continue
        column = {k: v[:, None] for k, v in opts.items()}
        c = StageCandidates.of(b=point.micro_batch_size, s=specs.model.seq_len, t=point.tp, d=point.dp, pp=S,
                               G=point.grad_accum, stage=np.arange(S)[None, :], layers=np.array(layers)[None, :],
                               ckpt=ckpt, v=chunks, **column)
        times = stage_times(costs, hw, caps, specs.train, c)
        memory = stage_memory(costs, hw, caps, specs.train, c)
        count += times.stable_s.size
        worst_peak = np.max(memory.peak_bytes, axis=1)
        j = int(np.argmin(worst_peak))
        if closest is None or worst_peak[j] < closest[0]:
            closest = (float(worst_peak[j]), _strategy(ctx.runtime, point, _uniform_stages(layers, ckpt[j], opts, j),
                                                       chunks))
        tail = tail_s(hw, specs.train, np.max(times.end_s, axis=1), world)
        total = iteration_time_s(times.stable_s, times.delta_s, point.grad_accum, tail, chunks)
        ok = np.all(memory.peak_bytes <= usable, axis=1) & np.all(memory.host_bytes <= host, axis=1)
        if ok.any():
            j = int(np.flatnonzero(ok)[np.argmin(total[ok])])
            if best is None or total[j] < best[0]:
                best = (float(total[j]), _strategy(ctx.runtime, point, _uniform_stages(layers, ckpt[j], opts, j),
                                                   chunks))
    least, near = closest if closest else (math.inf, None)
    if best is None:
        return [PointResult(point, (), bound, None, None, count, least_peak_bytes=least, closest=near)]
    return [PointResult(point, (), bound, best[0], best[1], count, solver="direct", least_peak_bytes=least,
                        closest=near)]


def _partitions_and_chunks(ctx: SearchContext, caps: RuntimeCapabilities, point: GlobalPoint):
    """(layers per stage, chunks per stage) the fixed-partition space prices: each partition with
    plain 1F1B, and, where the runtime interleaves, each uniform one with every chunk count that
    divides its stages (Megatron-LM's rule: micro-batches a multiple of the stages)."""
    for layers in fixed_partitions(ctx.specs.model.num_layers, point.pp, ctx.space, ctx.specs.tuner.layer_slack):
        yield layers, 1
        if _interleaves(caps, ctx.space, point) and len(set(layers)) == 1:
            for chunks in range(2, layers[0] + 1):
                if layers[0] % chunks == 0:
                    yield layers, chunks


def _interleaves(caps: RuntimeCapabilities, space: str, point: GlobalPoint) -> bool:
    return ("interleaved" in caps.schedules and space == "megatron" and point.pp > 1
            and point.grad_accum % point.pp == 0)


def _uniform_stages(layers, ckpt_row, opts, j) -> tuple[StageStrategy, ...]:
    return tuple(_stage_strategy(opts, j, l, c) for l, c in zip(layers, ckpt_row))


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


def search(specs: Specs, space: str | None = None, runtime: str | RuntimeCapabilities | None = None,
           cache_dir: Path | None = None, progress: bool | None = None) -> SearchResult:
    """Best strategy of `space` (default specs.tuner.space) on `runtime`, a name or a capability value
    (default: the tuner's)."""
    start = time.perf_counter()
    space = space or specs.tuner.space
    caps = capabilities_of(runtime or tuner_runtime(specs.tuner), "tuner.runtime")
    ctx = SearchContext(specs=specs, space=space, caps=caps, cache_dir=cache_dir)
    state = _state(ctx)
    costs, hw, caps = state
    points = global_points(specs.model, specs.cluster, specs.train, specs.tuner, space, caps)
    chunks = [specs.model.num_layers // p.pp if _interleaves(caps, space, p) else 1 for p in points]
    bounds = lower_bounds_s(costs, hw, points, caps.fused_kernels, chunks)
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
            limit = math.inf if best is None else best.objective_s
            for chunk in chunks[r:r + CHUNKS_PER_ROUND]:
                keep = [(p, b) for p, b in chunk if b <= limit]
                pruned.extend((p, b) for p, b in chunk if b > limit)
                if keep:
                    todo.append(keep)
            priced = pool.map(price_points, [ctx] * len(todo), todo) if pool else (price_points(ctx, c, state) for c in todo)
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
