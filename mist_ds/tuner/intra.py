"""Intra-stage search: for one global point, price every per-stage option of every (stage position,
layer count) in one vectorized pass, drop what does not fit, and keep the full Pareto frontier of
(stable, delta, end) seconds per (position, layer count).

Stage positions that differ only in the activations they hold (micro-batches in flight) share one
time evaluation: the time of a stage depends on its position only through first / last and whether
its pipeline boundaries cross nodes, and its memory is linear in the micro-batches in flight.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mist_ds.cost.stage import (ModelCosts, StageCandidates, in_flight_micro_batches, stage_boundaries_cross_nodes,
                                stage_memory, stage_times)
from mist_ds.hardware import HardwareModel
from mist_ds.specs import RuntimeCapabilities, TrainSpec
from mist_ds.tuner.partition import StageOptions, pareto_front
from mist_ds.tuner.space import OPTION_KEYS, GlobalPoint, OptionGrids, stage_option_grid


@dataclass(frozen=True)
class PricedOptions:
    """Every option of every layer count for one global point, priced at each class of position.

    Arrays are [classes, n] for times and memory at the class's representative position; options
    ([n] each) are concatenated over layer counts (`layers`)."""

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

    @property
    def count(self) -> int:
        return int(self.stable_s.size)


def position_classes(point: GlobalPoint, gpus_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """(class of each position, representative position of each class): positions with equal
    (first, last, previous boundary crosses nodes, next boundary crosses nodes) cost the same time."""
    S = point.pp
    positions = np.arange(S)
    prev, nxt = stage_boundaries_cross_nodes(positions, point.tp * point.dp, gpus_per_node)
    signature = np.stack([positions == 0, positions == S - 1, prev & (positions > 0), nxt & (positions < S - 1)],
                         axis=1).astype(np.int64) @ np.array([8, 4, 2, 1])
    unique, first_index, classes = np.unique(signature, return_index=True, return_inverse=True)
    return classes.reshape(S), positions[first_index]


def price_options(costs: ModelCosts, hw: HardwareModel, caps: RuntimeCapabilities, train: TrainSpec,
                  point: GlobalPoint, space: str, grids: OptionGrids, layer_counts: list[int]) -> PricedOptions:
    grids_by_l = [stage_option_grid(caps, space, grids, l, pipeline=point.pp > 1) for l in layer_counts]
    layers = np.concatenate([np.full(g["ckpt"].size, l, dtype=np.float64) for g, l in zip(grids_by_l, layer_counts)])
    options = {k: np.concatenate([g[k] for g in grids_by_l]) for k in OPTION_KEYS}
    position_class, representatives = position_classes(point, hw.cluster.gpus_per_node)
    stage = representatives.astype(np.float64)[:, None]
    c = StageCandidates.of(b=point.micro_batch_size, s=costs.model.seq_len, t=point.tp, d=point.dp, pp=point.pp,
                           G=point.grad_accum, stage=stage, layers=layers[None, :], ckpt=options["ckpt"][None, :],
                           zero=options["zero"][None, :], wo=options["wo"][None, :], go=options["go"][None, :],
                           oo=options["oo"][None, :], ao=options["ao"][None, :])
    times = stage_times(costs, hw, caps, train, c)
    memory = stage_memory(costs, hw, caps, train, c)
    positions = np.arange(point.pp)
    return PricedOptions(
        layers=layers, options=options, stable_s=times.stable_s, delta_s=times.delta_s, end_s=times.end_s,
        peak_bytes=memory.peak_bytes, activations=memory.activations, host_bytes=memory.host_bytes,
        host_activations=memory.host_activations, class_in_flight=memory.in_flight[:, :1],
        position_class=position_class,
        position_in_flight=in_flight_micro_batches(positions, point.pp, point.grad_accum).astype(np.float64))


def position_memory(priced: PricedOptions, position: int) -> tuple[np.ndarray, np.ndarray]:
    """(peak GPU bytes, host bytes) of every option at `position` (its own micro-batches in flight)."""
    k = priced.position_class[position]
    scale = priced.position_in_flight[position] / priced.class_in_flight[k]
    peak = priced.peak_bytes[k] + (scale - 1) * priced.activations[k]
    host = priced.host_bytes[k] + (scale - 1) * priced.host_activations[k]
    return peak, host


def fits(priced: PricedOptions, position: int, usable_bytes: float, host_bytes_per_gpu: float) -> np.ndarray:
    """Options that fit at `position`: GPU peak within the usable memory, host share within the node's."""
    peak, host = position_memory(priced, position)
    return (peak <= usable_bytes) & (host <= host_bytes_per_gpu)


@dataclass(frozen=True)
class StageFronts:
    """Pareto options per (position, layers) and, for each, the indices into PricedOptions' arrays."""

    options: dict[tuple[int, int], StageOptions]
    indices: dict[tuple[int, int], np.ndarray]


def stage_fronts(priced: PricedOptions, usable_bytes: float, host_bytes_per_gpu: float,
                 allowed: np.ndarray | None = None) -> StageFronts:
    """Full (stable, delta, end) Pareto frontier of the fitting options of each (position, layers);
    `allowed` restricts the options (e.g. one ZeRO stage for runtimes that need it uniform)."""
    by_key: dict[tuple[int, float], dict[int, np.ndarray]] = {}
    options, indices = {}, {}
    for i in range(priced.position_class.size):
        k = int(priced.position_class[i])
        key = (k, float(priced.position_in_flight[i]))
        if key not in by_key:
            ok = fits(priced, i, usable_bytes, host_bytes_per_gpu)
            if allowed is not None:
                ok &= allowed
            fronts = {}
            for l in np.unique(priced.layers):
                candidates = np.flatnonzero(ok & (priced.layers == l))
                if candidates.size:
                    front = pareto_front(priced.stable_s[k, candidates], priced.delta_s[k, candidates],
                                         priced.end_s[k, candidates])
                    fronts[int(l)] = candidates[front]
            by_key[key] = fronts
        for l, chosen in by_key[key].items():
            indices[(i, l)] = chosen
            options[(i, l)] = StageOptions(position=i, layers=l, stable_s=priced.stable_s[k, chosen],
                                           delta_s=priced.delta_s[k, chosen], end_s=priced.end_s[k, chosen])
    return StageFronts(options=options, indices=indices)
