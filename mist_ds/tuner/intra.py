"""Intra-stage search: for one global point, price every per-stage option of every (stage position,
layer count) in one vectorized pass, drop what does not fit, and keep the full Pareto frontier of
(stable, delta, end) seconds per (position, layer count).

Stage positions that differ only in the activations they hold (micro-batches in flight) share one
time evaluation: the time of a stage depends on its position only through first / last and whether
its pipeline boundaries cross nodes, and its memory is linear in the micro-batches in flight and, under a
schedule that splits the backward (zb-h1), in the deferred W's it holds (cost/executors/zero_bubble.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from mist_ds.cost.candidates import ModelCosts, StageCandidates
from mist_ds.cost.executors.zero_bubble import held_weight_passes, stage_weight_gradient_s, stage_weight_operand_bytes
from mist_ds.cost.stage import stage_boundaries_cross_nodes, stage_times
from mist_ds.cost.stage_memory import in_flight_micro_batches, stage_memory
from mist_ds.hardware import HardwareModel
from mist_ds.specs import ExecutorCapabilities, TrainSpec
from mist_ds.specs.pipeline_order import SPLIT_SCHEDULES
from mist_ds.specs.targets import DEFAULT_TARGET, TargetCapabilities
from mist_ds.tuner.partition_model import StageOptions, front_of_sorted, pareto_columns, pareto_front
from mist_ds.tuner.space import OPTION_KEYS, GlobalPoint, OptionGrids, stage_option_grid


@dataclass(frozen=True)
class PricedOptions:
    """Every option of every layer count for one global point, priced at each class of position.

    Arrays are [classes, n] for times and memory at the class's representative position; options
    ([n] each) are concatenated over layer counts (`layers`). PointPricer fills them in place, memory
    first, times of what may matter; what is not priced stays inf."""

    layers: np.ndarray
    options: dict[str, np.ndarray]
    stable_s: np.ndarray
    delta_s: np.ndarray
    end_s: np.ndarray
    peak_bytes: np.ndarray
    activations: np.ndarray
    host_bytes: np.ndarray
    host_activations: np.ndarray
    class_in_flight: np.ndarray
    position_class: np.ndarray
    """[S] the class of each stage position."""
    position_in_flight: np.ndarray
    deferred_bytes: np.ndarray
    """[classes, n] the bytes one deferred W keeps (0 where the schedule does not split the backward)."""
    position_deferred: np.ndarray
    """[S] the deferred W's each position holds at its peak beyond 1F1B's (zero_bubble.held_weight_passes)."""
    weight_s: np.ndarray
    """[classes, n] seconds of W per micro-batch (zero_bubble.stage_weight_gradient_s: the layers' weight-gradient
    GEMMs, the same for every option of one layer count) where the schedule splits the backward, else 0."""
    fits: np.ndarray
    """[n] fits at some position (GPU peak and host bytes); only these can be in a plan."""
    sized: np.ndarray
    """[n] memory priced (the others' memory is inf: they fit nowhere)."""
    timed: np.ndarray
    """[n] times priced (the others' times are inf)."""

    @property
    def count(self) -> int:
        return int(self.stable_s.size)


def position_classes(point: GlobalPoint, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """(class of each position, representative position of each class): positions with equal
    (first, last, previous boundary crosses nodes, next boundary crosses nodes) cost the same time."""
    S = point.pp
    positions = np.arange(S)
    prev, nxt = stage_boundaries_cross_nodes(positions, point.stage_width, gpus_per_node)
    signature = np.stack([positions == 0, positions == S - 1, prev & (positions > 0), nxt & (positions < S - 1)],
                         axis=1).astype(np.int64) @ np.array([8, 4, 2, 1])
    unique, first_index, classes = np.unique(signature, return_index=True, return_inverse=True)
    return classes.reshape(S), positions[first_index]


def price_options(costs: ModelCosts, hw: HardwareModel, caps: ExecutorCapabilities, train: TrainSpec,
                  point: GlobalPoint, space: str, grids: OptionGrids, layer_counts: list[int],
                  usable_bytes: float = np.inf, host_limits_bytes: np.ndarray | None = None) -> PricedOptions:
    """Memory of every option, then times of those that fit at some position."""
    pricer = PointPricer(costs, hw, caps, train, point, usable_bytes, host_limits_bytes)
    priced = pricer.memory(pricer.options(space, grids, layer_counts))
    return pricer.times(priced, priced.fits)


@dataclass(frozen=True)
class PointPricer:
    """Prices the options of one global point on demand, memory before times: an option that fits at no
    position (GPU peak within `usable_bytes`, host bytes within the position's `host_limits_bytes`) is in
    no plan, and pricing its times would be wasted."""

    costs: ModelCosts
    hw: HardwareModel
    caps: ExecutorCapabilities
    train: TrainSpec
    point: GlobalPoint
    usable_bytes: float = np.inf
    host_limits_bytes: np.ndarray | None = None
    target: TargetCapabilities | str = DEFAULT_TARGET
    """What consumes the plans (tuner.target): options it cannot run are not among the point's options."""
    schedule: str = "1f1b"
    """The pipeline order the options are priced for: a split one (zb-h1) adds its deferred W's to the memory."""

    def options(self, space: str, grids: OptionGrids, layer_counts: list[int]) -> PricedOptions:
        """Every option of the space for these layer counts, nothing priced yet (inf)."""
        point = self.point
        grids_by_l = [stage_option_grid(self.caps, space, grids, l, point.pp > 1, self.target) for l in layer_counts]
        layers = np.concatenate([np.full(g["recompute"].size, l, dtype=np.float64)
                                 for g, l in zip(grids_by_l, layer_counts)])
        position_class, representatives = position_classes(point, self.hw.cluster.gpus_per_node)
        shape = (representatives.size, layers.size)
        inf = {k: np.full(shape, np.inf) for k in ("stable_s", "delta_s", "end_s", "peak_bytes", "host_bytes")}
        priced = PricedOptions(
            layers=layers, options={k: np.concatenate([g[k] for g in grids_by_l]) for k in OPTION_KEYS}, **inf,
            activations=np.zeros(shape), host_activations=np.zeros(shape), deferred_bytes=np.zeros(shape),
            weight_s=np.zeros(shape),
            position_deferred=held_weight_passes(self.schedule, np.arange(point.pp), point.pp, point.grad_accum),
            class_in_flight=in_flight_micro_batches(representatives, point.pp, point.grad_accum)[:, None],
            position_class=position_class, fits=np.zeros(layers.size, dtype=bool),
            sized=np.zeros(layers.size, dtype=bool), timed=np.zeros(layers.size, dtype=bool),
            position_in_flight=in_flight_micro_batches(np.arange(point.pp), point.pp, point.grad_accum))
        if self.schedule in SPLIT_SCHEDULES:
            priced.weight_s[:] = stage_weight_gradient_s(self.costs, self.hw,
                                                         self._candidates(priced, np.ones(layers.size, dtype=bool)),
                                                         self.caps.runs_profiled_layers)
        return priced

    def _candidates(self, priced: PricedOptions, pick: np.ndarray) -> StageCandidates:
        """The options `pick` selects, [classes, picked], at each class's representative position."""
        point = self.point
        representatives = position_classes(point, self.hw.cluster.gpus_per_node)[1].astype(np.float64)[:, None]
        return StageCandidates.of(b=point.micro_batch_size, s=self.costs.model.seq_len, t=point.tp,
                                  d=point.data_group_size, q=point.sp, pp=point.pp, G=point.grad_accum,
                                  stage=representatives, layers=priced.layers[None, pick],
                                  split=self.schedule in SPLIT_SCHEDULES,
                                  **{k: priced.options[k][None, pick] for k in OPTION_KEYS})

    def memory(self, priced: PricedOptions, pick: np.ndarray | None = None) -> PricedOptions:
        """Prices, in `priced`'s own arrays, the memory of the options `pick` selects ([n] bool; None: all)
        and marks where they fit."""
        pick = np.flatnonzero(~priced.sized if pick is None else pick & ~priced.sized)
        if not pick.size:
            return priced
        memory = stage_memory(self.costs, self.hw, self.caps, self.train, self._candidates(priced, pick))
        for name in ("peak_bytes", "activations", "host_bytes", "host_activations"):
            getattr(priced, name)[:, pick] = getattr(memory, name)
        if np.any(priced.position_deferred):
            priced.deferred_bytes[:, pick] = stage_weight_operand_bytes(self.costs, self.hw,
                                                                        self._candidates(priced, pick))
        priced.sized[pick] = True
        limits = np.full(self.point.pp, np.inf) if self.host_limits_bytes is None else self.host_limits_bytes
        keys = np.stack([priced.position_class, priced.position_in_flight, priced.position_deferred, limits], axis=1)
        for i in np.unique(keys, axis=0, return_index=True)[1]:  # one position per (class, in flight, W's, limit)
            peak, host = position_memory(priced, int(i), pick)
            priced.fits[pick] |= (peak <= self.usable_bytes) & (host <= limits[i])
        return priced

    def times(self, priced: PricedOptions, pick: np.ndarray) -> PricedOptions:
        """Prices, in `priced`'s own arrays, the times of the options `pick` selects ([n] bool)."""
        pick = np.flatnonzero(pick & ~priced.timed)
        if not pick.size:
            return priced
        times = stage_times(self.costs, self.hw, self.caps, self.train, self._candidates(priced, pick))
        for name in ("stable_s", "delta_s", "end_s"):
            getattr(priced, name)[:, pick] = getattr(times, name)
        priced.timed[pick] = True
        return priced


def coarse_options(options: dict[str, np.ndarray], coarse: tuple[float, ...]) -> np.ndarray:
    """[n] True where every offload fraction of the option is one of `coarse`."""
    return np.all([np.isin(options[k], coarse) for k in ("wo", "go", "oo", "ao")], axis=0)


def floor_stable_s(priced: PricedOptions, coarse: tuple[float, ...], grids: OptionGrids) -> np.ndarray:
    """[n] the least stable time over classes of each option's floor: the option with every offload
    fraction rounded down to `coarse` (the rest equal), which must be timed; 0 where the grid has no such
    option (a runtime rule excludes it). A lower bound of the option's own stable time wherever stable
    time is nondecreasing in each offload fraction, as it is under a monotone interference table
    (docs/design.md, Tuner, Grids; tests/test_tuner.py checks it). `grids`: the ratios the options were
    drawn from."""
    ratios = dict(zip(("wo", "go", "oo", "ao"), (grids.weights, grids.grads, grids.optimizer, grids.activations)))
    # Mixed-radix codes: layers, recompute and ZeRO are small integers, the fractions indices into their grid.
    first = priced.layers.min()
    code = ((priced.layers - first) * (priced.options["recompute"].max() + 1) + priced.options["recompute"]) * 4
    code = (code + priced.options["zero"]).astype(np.int64)
    floor = code.copy()
    for k, grid in ratios.items():
        values = np.array(sorted(set(grid)))
        kept = np.array(sorted(set(coarse) & set(grid)))
        column = np.searchsorted(values, priced.options[k])
        down = np.searchsorted(values, kept)[np.searchsorted(kept, values, side="right") - 1]  # per grid value
        code, floor = code * values.size + column, floor * values.size + down[column]
    table = np.full(int(code.max()) + 1, -1, dtype=np.int64)  # code -> option; the grid is a product of few values
    table[code] = np.arange(code.size)
    at = table[floor]
    return np.where(at >= 0, np.min(priced.stable_s, axis=0)[np.maximum(at, 0)], 0.0)


def position_memory(priced: PricedOptions, position: int, pick=slice(None)) -> tuple[np.ndarray, np.ndarray]:
    """(peak GPU bytes, host bytes) of every option (or those `pick` selects) at `position` (its own
    micro-batches in flight and deferred W's)."""
    k = priced.position_class[position]
    scale = priced.position_in_flight[position] / priced.class_in_flight[k]
    peak = (priced.peak_bytes[k, pick] + (scale - 1) * priced.activations[k, pick]
            + priced.position_deferred[position] * priced.deferred_bytes[k, pick])
    host = priced.host_bytes[k, pick] + (scale - 1) * priced.host_activations[k, pick]
    return peak, host


@dataclass(frozen=True)
class StageFronts:
    """Pareto options per (position, layers) and, for each, the indices into PricedOptions' arrays."""

    options: dict[tuple[int, int], StageOptions]
    indices: dict[tuple[int, int], np.ndarray]


def most_host_bytes(priced: PricedOptions, usable_bytes: float, host_limits_bytes: np.ndarray) -> np.ndarray:
    """[S] the most host bytes an option that fits at each position keeps (0 where none fits)."""
    timed = np.flatnonzero(priced.timed)
    most = np.zeros(priced.position_class.size)
    for i in range(most.size):
        peak, host = position_memory(priced, i, timed)
        host = host[(peak <= usable_bytes) & (host <= host_limits_bytes[i])]
        most[i] = host.max() if host.size else 0.0
    return most


def _sorted_times(priced: PricedOptions, k: int, l: float) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """(the options of `l` layers priced at class k, their (stable, delta, end) columns, their lexicographic
    order): what pareto_front sorts, shared by every position of the class."""
    candidates = np.flatnonzero((priced.layers == l) & priced.timed)
    columns = pareto_columns(priced.stable_s[k, candidates], priced.delta_s[k, candidates], priced.end_s[k, candidates])
    return candidates, columns, np.lexsort(columns[::-1])


def stage_fronts(priced: PricedOptions, usable_bytes: float, host_limits_bytes: np.ndarray,
                 allowed: np.ndarray | None = None, host_criterion: bool = False) -> StageFronts:
    """Full Pareto frontier of the fitting options of each (position, layers) in (stable, delta, end), and
    host bytes when `host_criterion` (stages share a node's host memory: an option that offloads less may
    be what lets a neighbour offload more). An option fits when its GPU peak is within `usable_bytes` and
    its host bytes within the position's `host_limits_bytes` [S] (cost/host.py, position_host_limits);
    `allowed` restricts the options (e.g. one ZeRO stage for runtimes that need it uniform)."""
    by_key: dict[tuple[int, float, float, float], tuple[dict[int, np.ndarray], np.ndarray]] = {}
    sorted_by_class: dict[tuple[int, int], tuple[np.ndarray, list[np.ndarray], np.ndarray]] = {}
    options, indices = {}, {}
    for i in range(priced.position_class.size):
        k = int(priced.position_class[i])
        key = (k, float(priced.position_in_flight[i]), float(priced.position_deferred[i]),
               float(host_limits_bytes[i]))
        if key not in by_key:
            ok, host = np.zeros(priced.layers.size, dtype=bool), np.zeros(priced.layers.size)
            timed = np.flatnonzero(priced.timed)
            peak, host[timed] = position_memory(priced, i, timed)
            ok[timed] = (peak <= usable_bytes) & (host[timed] <= host_limits_bytes[i])
            if allowed is not None:
                ok &= allowed
            fronts = {}
            for l in np.unique(priced.layers):
                if host_criterion:  # host bytes differ by position: a sort of its own
                    candidates = np.flatnonzero(ok & (priced.layers == l))
                    front = pareto_front(priced.stable_s[k, candidates], priced.delta_s[k, candidates],
                                         priced.end_s[k, candidates], host[candidates])
                else:  # positions of one class share times: sort their options once
                    if (k, l) not in sorted_by_class:
                        sorted_by_class[k, l] = _sorted_times(priced, k, l)
                    candidates, columns, order = sorted_by_class[k, l]
                    front = front_of_sorted(columns, order[ok[candidates][order]])
                if front.size:
                    fronts[int(l)] = candidates[front]
            by_key[key] = fronts, host
        fronts, host = by_key[key]
        for l, chosen in fronts.items():
            indices[(i, l)] = chosen
            options[(i, l)] = StageOptions(position=i, layers=l, stable_s=priced.stable_s[k, chosen],
                                           delta_s=priced.delta_s[k, chosen], end_s=priced.end_s[k, chosen],
                                           host_bytes=host[chosen], weight_s=float(priced.weight_s[k, chosen[0]]))
    return StageFronts(options=options, indices=indices)
