"""The inter-stage problem shared by its two solvers (mist_ds/tuner/partition.py states it): the stage
options, the chosen split, the host memory stages share, Pareto fronts, and the objective.

Its own module so that the DP (partition_dp.py), the MILP (milp.py) and the choice between them
(partition.py) all import it and none imports another in a circle.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

# Points compared at once by pareto_front: a block x block boolean matrix stays small.
PARETO_BLOCK = 256


@dataclasses.dataclass(frozen=True, eq=False)
class StageOptions:
    """The Pareto options of stage `position` holding `layers` layers; costs in seconds, one entry per option."""

    position: int
    layers: int
    stable_s: np.ndarray
    delta_s: np.ndarray
    end_s: np.ndarray | None = None  # None: no tail (all zeros)
    host_bytes: np.ndarray | None = None
    """Host bytes one rank of the stage keeps; read only when host memory is shared (None: all zeros)."""
    weight_s: float = 0.0
    """Seconds per micro-batch of the stage's W (its deferrable weight gradients, part of every option's stable time,
    the same for all of them: cost/executors/zero_bubble.py); read only when a split schedule is priced (`split`)."""

    def __post_init__(self) -> None:
        stable = np.array(self.stable_s, dtype=np.float64).reshape(-1)
        end = np.zeros_like(stable) if self.end_s is None else self.end_s
        host = np.zeros_like(stable) if self.host_bytes is None else self.host_bytes
        for name, raw in (("stable_s", stable), ("delta_s", self.delta_s), ("end_s", end), ("host_bytes", host)):
            arr = np.array(raw, dtype=np.float64).reshape(-1)
            if arr.shape != stable.shape:
                raise ValueError(f"StageOptions({self.position}, {self.layers}).{name}: {arr.shape[0]} options, "
                                 f"stable_s has {stable.shape[0]}")
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise ValueError(f"StageOptions({self.position}, {self.layers}).{name}: costs must be finite "
                                 f"and >= 0, got {arr}")
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)
        if not 0.0 <= self.weight_s <= (float(self.stable_s.min()) if self.stable_s.size else math.inf):
            raise ValueError(f"StageOptions({self.position}, {self.layers}).weight_s: {self.weight_s} s, outside "
                             "[0, the least stable_s]: W is part of every option's stable time")
        if self.position < 0 or self.layers < 1:
            raise ValueError(f"StageOptions: position {self.position} must be >= 0 and layers {self.layers} >= 1")


@dataclasses.dataclass(frozen=True)
class Partition:
    """A chosen split: layers and option index per stage, iteration time and the solver's proof of quality.

    `objective_s` is recomputed from the choice by `partition_objective`; `bound_s` is a lower bound on
    the optimum; `gap` = (objective_s - bound_s) / objective_s, 0 when proven optimal.
    """

    layers: tuple[int, ...]
    option: tuple[int, ...]
    objective_s: float
    bound_s: float
    gap: float
    solver: str


@dataclasses.dataclass(frozen=True)
class HostSharing:
    """Host memory shared by the ranks of a node: `ranks[n][i]` ranks of stage i on node n (only nodes
    holding ranks of several stages: a node of one stage is a bound on that stage's options alone),
    `capacity_bytes` the host memory of a node. Every node holds the same number of ranks."""

    ranks: tuple[tuple[int, ...], ...]
    capacity_bytes: float

    def __post_init__(self) -> None:
        per_node = {sum(row) for row in self.ranks}
        if len(per_node) > 1 or self.capacity_bytes <= 0:
            raise ValueError(f"HostSharing: nodes hold {sorted(per_node)} ranks (one count expected), capacity "
                             f"{self.capacity_bytes} bytes (> 0 expected)")

    @property
    def share_bytes(self) -> float:
        """One rank's share of its node (the per-GPU rule): plans within it fit however stages share."""
        return self.capacity_bytes / sum(self.ranks[0]) if self.ranks else math.inf

    def node_bytes(self, host_per_stage: Sequence[float]) -> np.ndarray:
        """Host bytes each shared node holds when stage i's ranks keep host_per_stage[i] each."""
        return np.array(self.ranks, dtype=np.float64).reshape(-1, len(host_per_stage)) @ np.asarray(host_per_stage)

    def fits(self, host_per_stage: Sequence[float]) -> bool:
        return bool(np.all(self.node_bytes(host_per_stage) <= self.capacity_bytes))


@dataclasses.dataclass(frozen=True)
class Choice:
    """Options of one (stage, layer count) after normalization; `delta_s` is zero when imbalance is off. The
    objective's two uses of a stage's time apart (`split_terms`): `stable_s` what its maximum takes, `fill_s` what
    its sums take (both the stable time under 1F1B)."""

    layers: int
    stable_s: np.ndarray
    delta_s: np.ndarray
    end_s: np.ndarray
    host_bytes: np.ndarray
    fill_s: np.ndarray


Options = Mapping[tuple[int, int], StageOptions] | Iterable[StageOptions]


def pareto_front(stable_s, delta_s, end_s=None, host_bytes=None) -> np.ndarray:
    """Indices of the non-dominated points of (stable, delta, end[, host]), all minimized.

    Order: ascending stable, then delta, then end, then host. Exact duplicates keep their lowest index
    only. After the lexicographic sort only an earlier point can dominate a later one (a later point that
    is <= in every criterion would be a duplicate), and dominance is transitive, so each block of points
    is compared with the front found so far and with the earlier points of its own block.
    """
    columns = pareto_columns(stable_s, delta_s, end_s, host_bytes)
    return front_of_sorted(columns, np.lexsort(columns[::-1]))  # stable sort: ties keep the lower index first


def pareto_columns(stable_s, delta_s, end_s=None, host_bytes=None) -> list[np.ndarray]:
    """The criteria of pareto_front as float arrays of one length, checked."""
    stable = np.asarray(stable_s, dtype=np.float64).reshape(-1)
    columns = [stable, np.asarray(delta_s, dtype=np.float64).reshape(-1)]
    columns += [np.zeros_like(stable) if end_s is None else np.asarray(end_s, dtype=np.float64).reshape(-1)]
    if host_bytes is not None:
        columns.append(np.asarray(host_bytes, dtype=np.float64).reshape(-1))
    if len({c.shape for c in columns}) > 1:
        raise ValueError(f"pareto_front: lengths differ: {[c.shape for c in columns]}")
    if any(np.isnan(c).any() for c in columns):
        raise ValueError("pareto_front: NaN cost")
    # A constant criterion after delta changes neither the order nor dominance: leave it out.
    return columns[:2] + [c for c in columns[2:] if c.size and np.any(c != c[0])]


def front_of_sorted(columns: list[np.ndarray], order: np.ndarray) -> np.ndarray:
    """pareto_front of the points `order` lists, given in lexicographic order of `columns` (a subset of a
    sorted list, order kept, is sorted: several subsets can share one sort)."""
    pts = np.stack([c[order] for c in columns], axis=1)
    fresh = np.ones(len(order), dtype=bool)
    fresh[1:] = np.any(pts[1:] != pts[:-1], axis=1)
    order, pts = order[fresh], pts[fresh]
    if np.all(pts[:, 2:] == pts[:1, 2:]) if len(pts) else True:
        # The criteria after delta constant (the common case: a runtime has either deltas or a tail):
        # a point survives iff its delta is below every earlier point's, a sweep of O(n) after the sort.
        best_before = np.minimum.accumulate(np.concatenate([[np.inf], pts[:-1, 1]]))
        return order[pts[:, 1] < best_before].astype(np.int64)
    front, kept = pts[:0, 1:], []
    for lo in range(0, len(order), PARETO_BLOCK):
        block = pts[lo:lo + PARETO_BLOCK, 1:]  # criteria after stable
        hit = np.all(front[None, :, :] <= block[:, None, :], axis=2).any(axis=1)
        earlier = np.tri(len(block), k=-1, dtype=bool)  # [i, j]: j precedes i
        hit |= (np.all(block[None, :, :] <= block[:, None, :], axis=2) & earlier).any(axis=1)
        front = np.concatenate([front, block[~hit]])
        kept.append(order[lo:lo + PARETO_BLOCK][~hit])
    return np.concatenate(kept).astype(np.int64) if kept else np.empty(0, dtype=np.int64)


def split_terms(stable_s, weight_s, position: int, S: int, G: int) -> tuple[np.ndarray, np.ndarray]:
    """(the term of the maximum, the term of the sums) of options of stable time T (`stable_s`) whose stage at
    `position` of S has W seconds (`weight_s`) per micro-batch, in ZB-H1's closed form (partition.py; the
    derivation: docs/design.md, The `zb-h1` schedule): the sums take T - W (a stage's W's fill its waits, off the
    fill and drain), the maximum T - (m - 1) W / (G - 1) with m = min(S, G) - 1 (the bottleneck's W's that fill
    its own fill and drain). G = 1 has no maximum: the stages run once in turn, the first stage's W last."""
    stable, weight = np.asarray(stable_s, dtype=np.float64), np.asarray(weight_s, dtype=np.float64)
    if G == 1:
        return stable, stable - weight * (position > 0)
    return stable - (min(S, G) - 2) / (G - 1) * weight, stable - weight


def partition_objective(stable_s: Sequence[float], delta_s: Sequence[float], end_s: Sequence[float],
                        G: int, imbalance: bool = True, weight_s: Sequence[float] | None = None) -> float:
    """Iteration time (seconds) of per-stage costs, via Q_i = T_i + max(Q_{i-1}, D_i) (module docstring);
    `weight_s`: per stage, W's seconds per micro-batch of a split schedule (ZB-H1's closed form, `split_terms`)."""
    if weight_s is None:
        return _objective(stable_s, stable_s, delta_s, end_s, G, imbalance)
    S = len(stable_s)
    terms = [split_terms(t, w, i, S, G) for i, (t, w) in enumerate(zip(stable_s, weight_s))]
    return _objective([float(p) for p, _ in terms], [float(f) for _, f in terms], delta_s, end_s, G, imbalance)


def _objective(peak_s, fill_s, delta_s, end_s, G: int, imbalance: bool) -> float:
    """sum of `fill_s` with the imbalance (Q_i = F_i + max(Q_{i-1}, D_i)) + (G - 1) max `peak_s` + max `end_s`."""
    q = 0.0
    for f, d in zip(fill_s, delta_s):
        q = f + max(q, d if imbalance else 0.0)
    return q + (G - 1) * max(peak_s) + max(end_s)


def by_stage(options: Options, S: int, L: int, imbalance: bool, layer_bounds: Sequence[tuple[int, int]] | None,
             G: int = 1, split: bool = False) -> list[list[Choice]]:
    """Options grouped per stage, sorted by layer count, empty sets and out-of-range counts dropped; `split`: their
    terms in ZB-H1's closed form (`split_terms`, at G micro-batches), else 1F1B's."""
    if isinstance(options, Mapping):
        for key, opt in options.items():
            if tuple(key) != (opt.position, opt.layers):
                raise ValueError(f"options: key {key} holds StageOptions({opt.position}, {opt.layers})")
        options = options.values()
    stages: list[dict[int, Choice]] = [{} for _ in range(S)]
    for opt in options:
        if opt.position >= S or opt.layers > L or opt.stable_s.size == 0:
            continue
        low, high = layer_bounds[opt.position] if layer_bounds is not None else (1, L)
        if not low <= opt.layers <= high:
            continue
        if opt.layers in stages[opt.position]:
            raise ValueError(f"options: stage {opt.position} with {opt.layers} layers given twice")
        delta = opt.delta_s if imbalance else np.zeros_like(opt.stable_s)
        peak, fill = split_terms(opt.stable_s, opt.weight_s, opt.position, S, G) if split else (opt.stable_s,) * 2
        stages[opt.position][opt.layers] = Choice(opt.layers, peak, delta, opt.end_s, opt.host_bytes, fill)
    return [[s[l] for l in sorted(s)] for s in stages]


def check_sizes(S: int, L: int, G: int, layer_bounds) -> None:
    if S < 1 or L < S or G < 1:
        raise ValueError(f"solve_partition: need S >= 1, L >= S, G >= 1; got S={S}, L={L}, G={G}")
    if layer_bounds is not None and len(layer_bounds) != S:
        raise ValueError(f"solve_partition: layer_bounds has {len(layer_bounds)} entries for S={S} stages")



def evaluate(stages, layers, option, G: int) -> float:
    """objective_s of an assignment; stages already carry zero deltas when imbalance is off."""
    picked = [next(c for c in stages[i] if c.layers == l) for i, l in enumerate(layers)]
    return _objective([c.stable_s[k] for c, k in zip(picked, option)], [c.fill_s[k] for c, k in zip(picked, option)],
                      [c.delta_s[k] for c, k in zip(picked, option)], [c.end_s[k] for c, k in zip(picked, option)],
                      G, True)



def option_list(options: Options) -> list[StageOptions]:
    return list(options.values() if isinstance(options, Mapping) else options)


def restricted(options: Options, keep) -> tuple[list[StageOptions], dict[tuple[int, int], np.ndarray]]:
    """(the options `keep` (StageOptions -> indices) leaves, host criterion included, and per (position,
    layers) the input index of each): solve on the first, map the split back with `mapped`."""
    out, index = [], {}
    for opt in option_list(options):
        k = np.asarray(keep(opt), dtype=np.int64)
        out.append(StageOptions(opt.position, opt.layers, opt.stable_s[k], opt.delta_s[k], opt.end_s[k],
                                opt.host_bytes[k], opt.weight_s))
        index[opt.position, opt.layers] = k
    return out, index


def mapped(partition: Partition | None, index: dict[tuple[int, int], np.ndarray]) -> Partition | None:
    """A split found on restricted options, with option indices of the input options."""
    if partition is None:
        return None
    option = tuple(int(index[i, l][k]) for i, (l, k) in enumerate(zip(partition.layers, partition.option)))
    return dataclasses.replace(partition, option=option)




def host_of(options: Options, partition: Partition) -> list[float]:
    """Host bytes per rank of each stage of a split."""
    table = {(o.position, o.layers): o for o in option_list(options)}
    return [float(table[i, l].host_bytes[k]) for i, (l, k) in enumerate(zip(partition.layers, partition.option))]
