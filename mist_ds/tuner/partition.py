"""Inter-stage solver: split L layers over S pipeline stages and pick one intra-stage option per stage.

Stage i (position 0 = first stage) with l layers offers a Pareto set of options k, each with three costs
in seconds: stable T (one steady-state micro-batch), delta D (extra cost of the first/last micro-batch
that is not hidden behind the stages before it) and end E (end-of-iteration tail, e.g. an optimizer step),
and the host bytes H one rank of the stage keeps (offloaded states and activations). For G micro-batches
the iteration time is (docs/design.md, Tuner)

    sum_i T_i + (G - 1) max_i T_i + max(0, max_i (D_i - P_i)) + max_i E_i,   P_i = sum_{j<i} T_j.

The first two terms are the 1F1B pipeline, the third the inter-micro-batch imbalance (switched off for
the Aceso baseline space), the last the tail. With host memory shared per node (`HostSharing`), the
stages whose ranks share a node must fit in its host memory together: sum_i c[n, i] H_i <= M for node n
holding c[n, i] ranks of stage i.

Two exact solvers, chosen by `solve_partition`:
- `solve_partition_dp` (here): fixes thresholds max T <= tau and max E <= eps by filtering options, then
  runs a DP over (stage, layers used). Exactness rests on one identity: with Q_{-1} = 0 and
    Q_i = T_i + max(Q_{i-1}, D_i)
  the last value is Q_{S-1} = sum_i T_i + max(0, max_i (D_i - P_i)) (induction: Q_i = P_{i+1} + max(0,
  max_{j<=i} (D_j - P_j))). Q_i is nondecreasing in Q_{i-1}, so a smaller Q after i stages never hurts
  what follows and the DP keeps one value per (stage, layers used). Under thresholds (tau, eps) the
  objective of the DP's split is at most Q_{S-1} + (G-1) tau + eps, with equality at the optimum's own
  (max T, max E), so the minimum over all pairs is the optimum. The pairs are searched by branch and
  bound on boxes of candidates (Q is nonincreasing in both thresholds), vectorized over pairs with numpy.
  It cannot couple stages, so it never sees the shared host memory.
- `solve_partition_milp` (mist_ds/tuner/milp.py): python-mip / CBC, the general formulation: it also
  takes the shared host memory, and cross-checks the DP.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import numpy as np

log = logging.getLogger(__name__)

# Threshold search: each box of (max T, max E) candidates is halved along both axes per round. Measured
# at S = 32 with 3000 x 3000 candidate pairs: halving evaluates 1.6-3.2k pairs, cutting in 8 evaluates
# 9-12k (4x slower); with a handful of E values both take < 0.15 s. The pairs of one vectorized DP pass
# are capped to bound memory (pairs x (L + 1) floats per stage).
BOX_FANOUT = 2
MAX_CHUNK_PAIRS = 4096
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
class _Choice:
    """Options of one (stage, layer count) after normalization; `delta_s` is zero when imbalance is off."""

    layers: int
    stable_s: np.ndarray
    delta_s: np.ndarray
    end_s: np.ndarray
    host_bytes: np.ndarray


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


def partition_objective(stable_s: Sequence[float], delta_s: Sequence[float], end_s: Sequence[float],
                        G: int, imbalance: bool = True) -> float:
    """Iteration time (seconds) of per-stage costs, via Q_i = T_i + max(Q_{i-1}, D_i) (module docstring)."""
    q = 0.0
    for t, d in zip(stable_s, delta_s):
        q = t + max(q, d if imbalance else 0.0)
    return q + (G - 1) * max(stable_s) + max(end_s)


def _by_stage(options: Options, S: int, L: int, imbalance: bool,
              layer_bounds: Sequence[tuple[int, int]] | None) -> list[list[_Choice]]:
    """Options grouped per stage, sorted by layer count, empty sets and out-of-range counts dropped."""
    if isinstance(options, Mapping):
        for key, opt in options.items():
            if tuple(key) != (opt.position, opt.layers):
                raise ValueError(f"options: key {key} holds StageOptions({opt.position}, {opt.layers})")
        options = options.values()
    stages: list[dict[int, _Choice]] = [{} for _ in range(S)]
    for opt in options:
        if opt.position >= S or opt.layers > L or opt.stable_s.size == 0:
            continue
        low, high = layer_bounds[opt.position] if layer_bounds is not None else (1, L)
        if not low <= opt.layers <= high:
            continue
        if opt.layers in stages[opt.position]:
            raise ValueError(f"options: stage {opt.position} with {opt.layers} layers given twice")
        delta = opt.delta_s if imbalance else np.zeros_like(opt.stable_s)
        stages[opt.position][opt.layers] = _Choice(opt.layers, opt.stable_s, delta, opt.end_s, opt.host_bytes)
    return [[s[l] for l in sorted(s)] for s in stages]


def _check_sizes(S: int, L: int, G: int, layer_bounds) -> None:
    if S < 1 or L < S or G < 1:
        raise ValueError(f"solve_partition: need S >= 1, L >= S, G >= 1; got S={S}, L={L}, G={G}")
    if layer_bounds is not None and len(layer_bounds) != S:
        raise ValueError(f"solve_partition: layer_bounds has {len(layer_bounds)} entries for S={S} stages")


# ---------------------------------------------------------------------------------------------- DP


def _transition(q: np.ndarray, c: _Choice, tau: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """min_k T_k + max(q, D_k) over options with T_k <= tau and E_k <= eps; q (P, U), tau and eps (P, 1).

    Split at q: options with D_k <= q cost q + T_k (prefix minimum of T in D order), the others
    T_k + D_k (suffix minimum). Both are the same float operations as T_k + max(q, D_k).
    """
    by_d = np.argsort(c.delta_s, kind="stable")
    t, d, e = c.stable_s[by_d], c.delta_s[by_d], c.end_s[by_d]
    ok = (t[None, :] <= tau) & (e[None, :] <= eps)  # (P, K)
    pre = np.full((ok.shape[0], len(t) + 1), np.inf)
    pre[:, 1:] = np.minimum.accumulate(np.where(ok, t, np.inf), axis=1)
    suf = np.full_like(pre, np.inf)
    suf[:, :-1] = np.minimum.accumulate(np.where(ok, t + d, np.inf)[:, ::-1], axis=1)[:, ::-1]
    idx = np.searchsorted(d, q, side="right")  # options with D_k <= q
    return np.minimum(q + np.take_along_axis(pre, idx, axis=1), np.take_along_axis(suf, idx, axis=1))


def _dp_values(stages: list[list[_Choice]], L: int, tau: np.ndarray, eps: np.ndarray) -> list[np.ndarray]:
    """Q after each stage for every threshold pair: a list of S arrays (P, L + 1), inf where unreachable."""
    q = np.full((len(tau), L + 1), np.inf)
    q[:, 0] = 0.0
    out = []
    for choices in stages:
        nxt = np.full_like(q, np.inf)
        for c in choices:
            nxt[:, c.layers:] = np.minimum(nxt[:, c.layers:], _transition(q[:, :L + 1 - c.layers], c, tau, eps))
        q = nxt
        out.append(q)
    return out


def _dp_assignment(stages: list[list[_Choice]], L: int, tau: float, eps: float):
    """Backtrack the DP at one threshold pair: (layers, option) with the smallest l, then k, among ties."""
    t_arr, e_arr = np.array([[tau]]), np.array([[eps]])
    values = [v[0] for v in _dp_values(stages, L, t_arr, e_arr)]
    if not np.isfinite(values[-1][L]):
        return None
    layers, option, used = [], [], L
    for i in range(len(stages) - 1, -1, -1):
        before = values[i - 1] if i > 0 else np.where(np.arange(L + 1) == 0, 0.0, np.inf)
        for c in stages[i]:
            if c.layers > used or not np.isfinite(before[used - c.layers]):
                continue
            q = before[used - c.layers]
            cost = np.where((c.stable_s <= tau) & (c.end_s <= eps), c.stable_s + np.maximum(q, c.delta_s), np.inf)
            k = int(np.argmin(cost))
            if cost[k] == values[i][used]:
                layers.append(c.layers)
                option.append(k)
                used -= c.layers
                break
        else:  # the forward pass reached this state, so some choice must reproduce it
            raise AssertionError(f"DP backtrack found no choice at stage {i}, {used} layers")
    return tuple(reversed(layers)), tuple(reversed(option))


def _evaluate(stages, layers, option, G: int) -> float:
    """objective_s of an assignment; stages already carry zero deltas when imbalance is off."""
    picked = [next(c for c in stages[i] if c.layers == l) for i, l in enumerate(layers)]
    return partition_objective([c.stable_s[k] for c, k in zip(picked, option)],
                               [c.delta_s[k] for c, k in zip(picked, option)],
                               [c.end_s[k] for c, k in zip(picked, option)], G)


def _thresholds(stages, G: int) -> tuple[np.ndarray, np.ndarray]:
    """Candidate max T (tau) and max E (eps) values, ascending.

    Each stage must take some option, so tau >= max_i min T and eps >= max_i min E. With G = 1 the max T
    term vanishes and the largest T is the only tau worth trying.
    """
    all_t = np.concatenate([c.stable_s for s in stages for c in s])
    all_e = np.concatenate([c.end_s for s in stages for c in s])
    tau_lo = max(min(float(c.stable_s.min()) for c in s) for s in stages)
    eps_lo = max(min(float(c.end_s.min()) for c in s) for s in stages)
    taus = np.unique(all_t[all_t >= tau_lo]) if G > 1 else np.array([all_t.max()])
    return taus, np.unique(all_e[all_e >= eps_lo])


def _split(lo: int, hi: int) -> list[tuple[int, int]]:
    """Inclusive index range cut into at most BOX_FANOUT consecutive pieces."""
    return [(int(p[0]), int(p[-1])) for p in np.array_split(np.arange(lo, hi + 1), min(BOX_FANOUT, hi - lo + 1))]


def _search_thresholds(stages, L: int, G: int, best: float, deadline: float):
    """Branch and bound over boxes of (tau, eps) index ranges; returns (best, pair or None, bound).

    Q(tau, eps) is nonincreasing in both thresholds (a larger threshold only adds options), so every pair
    of a box [a0, a1] x [b0, b1] is worth at least (G-1) tau[a0] + eps[b0] + Q(tau[a1], eps[b1]): a box
    whose bound reaches `best` is dropped, the others are cut into sub-boxes. The upper corners of one
    round are evaluated together in one vectorized DP.
    """
    taus, epss = _thresholds(stages, G)
    q: dict[tuple[int, int], float] = {}
    boxes, pair = [(0, len(taus) - 1, 0, len(epss) - 1)], None
    while boxes:
        corners = sorted({(a1, b1) for _, a1, _, b1 in boxes} - q.keys())
        for lo in range(0, len(corners), MAX_CHUNK_PAIRS):
            if time.perf_counter() > deadline:
                bound = min([best] + [(G - 1) * taus[a0] + epss[b0] + q.get((a1, b1), 0.0) for a0, a1, b0, b1 in boxes])
                return best, pair, float(bound)
            ab = np.array(corners[lo:lo + MAX_CHUNK_PAIRS])
            tau, eps = taus[ab[:, 0]], epss[ab[:, 1]]
            q_end = _dp_values(stages, L, tau[:, None], eps[:, None])[-1][:, L]
            value = q_end + (G - 1) * tau + eps
            j = int(np.argmin(value))
            if value[j] < best:
                best, pair = float(value[j]), (float(tau[j]), float(eps[j]))
            q.update(zip(map(tuple, ab.tolist()), q_end.tolist()))
        boxes = [(c0, c1, d0, d1) for a0, a1, b0, b1 in boxes
                 if (a0, b0) != (a1, b1) and (G - 1) * taus[a0] + epss[b0] + q[a1, b1] < best
                 for c0, c1 in _split(a0, a1) for d0, d1 in _split(b0, b1)]
    return best, pair, best


def solve_partition_dp(options: Options, S: int, L: int, G: int, imbalance: bool = True,
                       time_limit_s: float = 60.0,
                       layer_bounds: Sequence[tuple[int, int]] | None = None) -> Partition | None:
    """Exact threshold DP (module docstring). None when no split fits.

    After `time_limit_s` the best split so far comes back with bound_s = the smallest bound of the
    threshold boxes not yet settled.
    """
    _check_sizes(S, L, G, layer_bounds)
    stages = _by_stage(options, S, L, imbalance, layer_bounds)
    if any(not s for s in stages):
        return None
    start = time.perf_counter()
    found = _dp_assignment(stages, L, math.inf, math.inf)  # no threshold: an upper bound to prune with
    if found is None:
        return None
    first = _evaluate(stages, *found, G)
    best, pair, bound = _search_thresholds(stages, L, G, first, start + time_limit_s)
    layers, option = found if pair is None else _dp_assignment(stages, L, *pair)
    objective = _evaluate(stages, layers, option, G)
    bound = min(bound, objective)
    gap = (objective - bound) / objective if objective > 0 else 0.0
    log.debug("partition dp: S=%d L=%d G=%d %.3fs", S, L, G, time.perf_counter() - start)
    return Partition(layers, option, objective, bound, gap, "dp")


# ------------------------------------------------------------------------------------------- choice

METHODS = ("auto", "dp", "milp")


def _option_list(options: Options) -> list[StageOptions]:
    return list(options.values() if isinstance(options, Mapping) else options)


def restricted(options: Options, keep) -> tuple[list[StageOptions], dict[tuple[int, int], np.ndarray]]:
    """(the options `keep` (StageOptions -> indices) leaves, host criterion included, and per (position,
    layers) the input index of each): solve on the first, map the split back with `mapped`."""
    out, index = [], {}
    for opt in _option_list(options):
        k = np.asarray(keep(opt), dtype=np.int64)
        out.append(StageOptions(opt.position, opt.layers, opt.stable_s[k], opt.delta_s[k], opt.end_s[k],
                                opt.host_bytes[k]))
        index[opt.position, opt.layers] = k
    return out, index


def mapped(partition: Partition | None, index: dict[tuple[int, int], np.ndarray]) -> Partition | None:
    """A split found on restricted options, with option indices of the input options."""
    if partition is None:
        return None
    option = tuple(int(index[i, l][k]) for i, (l, k) in enumerate(zip(partition.layers, partition.option)))
    return dataclasses.replace(partition, option=option)


def _time_front(opt: StageOptions) -> np.ndarray:
    """The (stable, delta, end) front: what the DP needs when the host memory cannot bind."""
    return pareto_front(opt.stable_s, opt.delta_s, opt.end_s)


def host_can_bind(options: Options, S: int, host: HostSharing | None) -> bool:
    """Whether the shared host memory can exclude some choice: a node whose stages' largest options
    together exceed its memory. When none can, it is no constraint and the DP is exact."""
    if host is None or not host.ranks:
        return False
    largest = np.zeros(S)
    for opt in _option_list(options):
        if opt.position < S and opt.host_bytes.size:
            largest[opt.position] = max(largest[opt.position], float(opt.host_bytes.max()))
    return not host.fits(largest)


def solve_partition(options: Options, S: int, L: int, G: int, imbalance: bool = True,
                    method: Literal["auto", "dp", "milp"] = "auto", time_limit_s: float = 60.0,
                    layer_bounds: Sequence[tuple[int, int]] | None = None,
                    host: HostSharing | None = None) -> Partition | None:
    """Best split of L layers over S stages and one option per stage; None when nothing fits.

    options: StageOptions (or a mapping (position, layers) -> StageOptions); a missing or empty
    (i, l) means stage i cannot hold l layers. layer_bounds: optional inclusive (min, max) layers per stage.
    host: the host memory the stages of a node share (None: each option already fits on its own).
    "auto" takes the DP, exact for this objective (module docstring), unless the shared host memory can
    bind: then the DP's optimum without it, if it fits, else the MILP. "dp" refuses a host memory that
    can bind (the DP cannot couple stages); "milp" always runs CBC.
    """
    if method not in METHODS:
        raise ValueError(f"solve_partition: method {method!r} is not one of {', '.join(map(repr, METHODS))}")
    coupled = host_can_bind(options, S, host)
    if method == "dp" and coupled:
        raise ValueError("solve_partition: the DP cannot couple the host memory of stages sharing a node; "
                         "use method 'milp' or 'auto'")
    if method == "milp":
        from mist_ds.tuner.milp import solve_partition_milp  # loads CBC only when asked for

        return solve_partition_milp(options, S, L, G, imbalance=imbalance, time_limit_s=time_limit_s,
                                    layer_bounds=layer_bounds, host=host if coupled else None)
    if host is not None and not coupled:
        fronts, index = restricted(options, _time_front)
        return mapped(solve_partition_dp(fronts, S, L, G, imbalance=imbalance, time_limit_s=time_limit_s,
                                         layer_bounds=layer_bounds), index)
    relaxed = solve_partition_dp(options, S, L, G, imbalance=imbalance, time_limit_s=time_limit_s,
                                 layer_bounds=layer_bounds)
    if not coupled or relaxed is None or host.fits(host_of(options, relaxed)):
        return relaxed  # the optimum without the coupling fits it: optimal with it too
    from mist_ds.tuner.milp import solve_partition_milp

    return solve_partition_milp(options, S, L, G, imbalance=imbalance, time_limit_s=time_limit_s,
                                layer_bounds=layer_bounds, host=host, lower_bound_s=relaxed.bound_s)


def host_of(options: Options, partition: Partition) -> list[float]:
    """Host bytes per rank of each stage of a split."""
    table = {(o.position, o.layers): o for o in _option_list(options)}
    return [float(table[i, l].host_bytes[k]) for i, (l, k) in enumerate(zip(partition.layers, partition.option))]
