"""Inter-stage solver: split L layers over S pipeline stages and pick one intra-stage option per stage.

Stage i (position 0 = first stage) with l layers offers a Pareto set of options k, each with three costs
in seconds: stable T (one steady-state micro-batch), delta D (extra cost of the first/last micro-batch
that is not hidden behind the stages before it) and end E (end-of-iteration tail, e.g. an optimizer step).
For G micro-batches the iteration time is (docs/design.md, Tuner)

    sum_i T_i + (G - 1) max_i T_i + max(0, max_i (D_i - P_i)) + max_i E_i,   P_i = sum_{j<i} T_j.

The first two terms are the 1F1B pipeline, the third the inter-micro-batch imbalance (switched off for
the Aceso baseline space), the last the tail.

Two exact solvers:
- `solve_partition_dp`: fixes thresholds max T <= tau and max E <= eps by filtering options, then runs a
  DP over (stage, layers used). Exactness rests on one identity: with Q_{-1} = 0 and
    Q_i = T_i + max(Q_{i-1}, D_i)
  the last value is Q_{S-1} = sum_i T_i + max(0, max_i (D_i - P_i)) (induction: Q_i = P_{i+1} + max(0,
  max_{j<=i} (D_j - P_j))). Q_i is nondecreasing in Q_{i-1}, so a smaller Q after i stages never hurts
  what follows and the DP keeps one value per (stage, layers used). Under thresholds (tau, eps) the
  objective of the DP's split is at most Q_{S-1} + (G-1) tau + eps, with equality at the optimum's own
  (max T, max E), so the minimum over all pairs is the optimum. The pairs are searched by branch and
  bound on boxes of candidates (Q is nonincreasing in both thresholds), vectorized over pairs with numpy.
- `solve_partition_milp`: python-mip / CBC with arc-flow layer variables (the layer part of the LP
  relaxation is then integral) and the maxima written over cost levels; kept as the general formulation
  and as the cross-check of the DP. Much slower than the DP once the imbalance term meets G > 1.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import mip
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
# CBC defaults stop at a 1e-4 relative gap: too loose for a solver that must match the DP.
MILP_REL_GAP = 1e-9
MILP_ABS_GAP = 1e-12
MILP_FEAS_TOL = 1e-9


@dataclasses.dataclass(frozen=True, eq=False)
class StageOptions:
    """The Pareto options of stage `position` holding `layers` layers; costs in seconds, one entry per option."""

    position: int
    layers: int
    stable_s: np.ndarray
    delta_s: np.ndarray
    end_s: np.ndarray | None = None  # None: no tail (all zeros)

    def __post_init__(self) -> None:
        stable = np.array(self.stable_s, dtype=np.float64).reshape(-1)
        end = np.zeros_like(stable) if self.end_s is None else self.end_s
        for name, raw in (("stable_s", stable), ("delta_s", self.delta_s), ("end_s", end)):
            arr = np.array(raw, dtype=np.float64).reshape(-1)
            if arr.shape != stable.shape:
                raise ValueError(f"StageOptions({self.position}, {self.layers}).{name}: {arr.shape[0]} options, "
                                 f"stable_s has {stable.shape[0]}")
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise ValueError(f"StageOptions({self.position}, {self.layers}).{name}: costs must be finite "
                                 f"and >= 0 seconds, got {arr}")
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
class _Choice:
    """Options of one (stage, layer count) after normalization; `delta_s` is zero when imbalance is off."""

    layers: int
    stable_s: np.ndarray
    delta_s: np.ndarray
    end_s: np.ndarray


Options = Mapping[tuple[int, int], StageOptions] | Iterable[StageOptions]


def pareto_front(stable_s, delta_s, end_s=None) -> np.ndarray:
    """Indices of the non-dominated points of (stable, delta, end), all minimized (seconds).

    Order: ascending stable, then delta, then end. Exact duplicates keep their lowest index only.
    After the lexicographic sort only an earlier point can dominate a later one (a later point that is
    <= in every criterion would be a duplicate), and dominance is transitive, so each block of points is
    compared with the front found so far and with the earlier points of its own block.
    """
    stable = np.asarray(stable_s, dtype=np.float64).reshape(-1)
    delta = np.asarray(delta_s, dtype=np.float64).reshape(-1)
    end = np.zeros_like(stable) if end_s is None else np.asarray(end_s, dtype=np.float64).reshape(-1)
    if not stable.shape == delta.shape == end.shape:
        raise ValueError(f"pareto_front: lengths differ: {stable.shape}, {delta.shape}, {end.shape}")
    if np.isnan(stable).any() or np.isnan(delta).any() or np.isnan(end).any():
        raise ValueError("pareto_front: NaN cost")
    order = np.lexsort((end, delta, stable))  # stable sort: ties keep the lower index first
    pts = np.stack([stable[order], delta[order], end[order]], axis=1)
    fresh = np.ones(len(order), dtype=bool)
    fresh[1:] = np.any(pts[1:] != pts[:-1], axis=1)
    order, pts = order[fresh], pts[fresh]
    if np.all(pts[:, 2] == pts[0, 2]) if len(pts) else True:
        # One criterion constant (the common case: a runtime has either deltas or a tail): a point
        # survives iff its delta is below every earlier point's, a sweep of O(n) after the sort.
        best_before = np.minimum.accumulate(np.concatenate([[np.inf], pts[:-1, 1]]))
        return order[pts[:, 1] < best_before].astype(np.int64)
    front_d, front_e, kept = np.empty(0), np.empty(0), []
    for lo in range(0, len(order), PARETO_BLOCK):
        d, e = pts[lo:lo + PARETO_BLOCK, 1], pts[lo:lo + PARETO_BLOCK, 2]
        hit = ((front_d[None, :] <= d[:, None]) & (front_e[None, :] <= e[:, None])).any(axis=1)
        earlier = np.tri(len(d), k=-1, dtype=bool)  # [i, j]: j precedes i
        hit |= ((d[None, :] <= d[:, None]) & (e[None, :] <= e[:, None]) & earlier).any(axis=1)
        front_d, front_e = np.concatenate([front_d, d[~hit]]), np.concatenate([front_e, e[~hit]])
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
        stages[opt.position][opt.layers] = _Choice(opt.layers, opt.stable_s, delta, opt.end_s)
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


# -------------------------------------------------------------------------------------------- MILP


def _reachable(stages: list[list[_Choice]], L: int) -> list[set[int]]:
    """Layers used before stage i (i = 0..S) on some path from 0 to L: the arc-flow network's nodes."""
    fwd = [{0}]
    for s in stages:
        fwd.append({u + c.layers for u in fwd[-1] for c in s if u + c.layers <= L})
    bwd = [{L}]
    for s in reversed(stages):
        bwd.append({u - c.layers for u in bwd[-1] for c in s if u - c.layers >= 0})
    bwd.reverse()
    return [f & b for f, b in zip(fwd, bwd)]


def _new_model() -> mip.Model:
    model = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    model.verbose, model.threads, model.seed = 0, 1, 0
    model.max_mip_gap, model.max_mip_gap_abs = MILP_REL_GAP, MILP_ABS_GAP
    model.infeas_tol = model.integer_tol = MILP_FEAS_TOL
    return model


def _add_layer_flow(model: mip.Model, stages: list[list[_Choice]], L: int) -> dict[tuple[int, int], list]:
    """One unit of flow from (stage 0, 0 layers) to (stage S, L layers); arc (i, u, l): stage i takes
    layers u+1..u+l. Returns y[i, l] = binaries of the options of stage i with l layers, summing to x[i, l],
    the flow on those arcs (a path polytope, so the layer part of the LP relaxation is integral)."""
    nodes = _reachable(stages, L)
    balance: dict[tuple[int, int], list] = {}
    y = {}
    for i, choices in enumerate(stages):
        for c in choices:
            arcs = []
            for u in sorted(nodes[i]):
                if u + c.layers in nodes[i + 1]:
                    arcs.append(model.add_var(var_type=mip.BINARY))
                    balance.setdefault((i, u), []).append(-arcs[-1])
                    balance.setdefault((i + 1, u + c.layers), []).append(arcs[-1])
            if arcs:
                y[i, c.layers] = [model.add_var(var_type=mip.BINARY) for _ in range(c.stable_s.size)]
                model += mip.xsum(y[i, c.layers]) == mip.xsum(arcs)
    source, sink = (0, 0), (len(stages), L)
    for node, terms in balance.items():
        model += mip.xsum(terms) == (-1 if node == source else 1 if node == sink else 0)
    return y


def _max_by_levels(model: mip.Model, per_stage: list[list[tuple[float, mip.Var]]]) -> mip.LinExpr:
    """max_i (cost of stage i's option) as c_0 + sum_h (c_h - c_{h-1}) v_h over the distinct costs c_h.

    v_h = 1 means "the max reaches c_h"; v_h >= (share of stage i on options costing >= c_h), kept
    linear in size by running sums u. Against max >= (cost of stage i) for each i, the LP pays the
    largest share of every level over all stages, and CBC can branch on the max itself (as the DP's
    thresholds do): about 2x faster at S = 16, 20 options, G = 4..64 with the imbalance term.
    """
    levels = np.unique([c for stage in per_stage for c, _ in stage])
    v = [model.add_var(var_type=mip.BINARY) for _ in levels[1:]]
    for h in range(1, len(v)):
        model += v[h - 1] >= v[h]
    for stage in per_stage:
        running: mip.LinExpr | None = None
        for cost in sorted({c for c, _ in stage}, reverse=True):
            share = mip.xsum(var for c, var in stage if c == cost)
            running = share if running is None else running + share
            h = int(np.searchsorted(levels, cost))
            if h > 0:
                u = model.add_var(lb=0.0, ub=1.0)
                model += u == running
                running = mip.LinExpr([u], [1.0])
                model += v[h - 1] >= u
    return float(levels[0]) + mip.xsum(float(levels[h] - levels[h - 1]) * v[h - 1] for h in range(1, len(levels)))


def _terms(stages, y, i: int, field: str, scale: float) -> list[tuple[float, mip.Var]]:
    """(cost / scale, option binary) over every option of stage i that lies on a path of the flow."""
    return [(float(getattr(c, field)[k]) / scale, var) for c in stages[i] if (i, c.layers) in y
            for k, var in enumerate(y[i, c.layers])]


def _build_milp(stages: list[list[_Choice]], L: int, G: int, imbalance: bool, scale: float):
    """CBC model of the inter-stage problem (docs/design.md, Tuner); costs divided by `scale`."""
    model = _new_model()
    y = _add_layer_flow(model, stages, L)
    picked_t, picked_d, picked_e = ([_terms(stages, y, i, field, scale) for i in range(len(stages))]
                                    for field in ("stable_s", "delta_s", "end_s"))
    stage_t = [mip.xsum(c * v for c, v in p) for p in picked_t]
    objective = mip.xsum(stage_t) + _max_by_levels(model, picked_e)
    if G > 1:
        objective = objective + (G - 1) * _max_by_levels(model, picked_t)
    if imbalance:
        d_max = model.add_var(lb=0.0)
        for i, p in enumerate(picked_d):
            model += d_max >= mip.xsum(c * v for c, v in p) - mip.xsum(stage_t[:i])
        objective = objective + d_max
    model.objective = mip.minimize(objective)
    return model, y


def solve_partition_milp(options: Options, S: int, L: int, G: int, imbalance: bool = True,
                         time_limit_s: float = 60.0,
                         layer_bounds: Sequence[tuple[int, int]] | None = None) -> Partition | None:
    """MILP of docs/design.md (Tuner) on CBC (one thread, fixed seed). None when proven infeasible.

    Raises TimeoutError when the limit passes before any feasible split is found.
    """
    _check_sizes(S, L, G, layer_bounds)
    stages = _by_stage(options, S, L, imbalance, layer_bounds)
    if any(not s for s in stages) or not _reachable(stages, L)[-1]:
        return None  # no split of L layers exists: CBC would be handed an empty or trivial model
    # Costs of order 1 keep CBC's absolute tolerances meaningful whatever the time unit of the input.
    scale = max(max(float(max(c.stable_s.max(), c.delta_s.max(), c.end_s.max())) for c in s) for s in stages)
    scale = scale if scale > 0 else 1.0
    model, y = _build_milp(stages, L, G, imbalance, scale)
    status = model.optimize(max_seconds=time_limit_s)
    if status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
        return None
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        raise TimeoutError(f"solve_partition_milp: no feasible split within {time_limit_s} s (status {status.name})")
    layers, option = [], []
    for i in range(S):
        (l, ys), = [(l, ys) for (j, l), ys in y.items() if j == i and any(v.x > 0.5 for v in ys)]
        layers.append(l)
        option.append(next(k for k, v in enumerate(ys) if v.x > 0.5))
    objective = _evaluate(stages, layers, option, G)
    if status == mip.OptimizationStatus.OPTIMAL:
        bound, gap = objective, 0.0
    else:
        bound = min(objective, model.objective_bound * scale)
        gap = (objective - bound) / objective if objective > 0 else 0.0
    return Partition(tuple(layers), tuple(option), objective, bound, gap, "milp")


def solve_partition(options: Options, S: int, L: int, G: int, imbalance: bool = True,
                    method: Literal["auto", "dp", "milp"] = "auto", time_limit_s: float = 60.0,
                    layer_bounds: Sequence[tuple[int, int]] | None = None) -> Partition | None:
    """Best split of L layers over S stages and one option per stage; None when nothing fits.

    options: StageOptions (or a mapping (position, layers) -> StageOptions); a missing or empty
    (i, l) means stage i cannot hold l layers. layer_bounds: optional inclusive (min, max) layers per stage.
    "auto" takes the DP: it is exact for this whole objective (module docstring); the MILP stays the
    general formulation for constraints the thresholds cannot express, and the DP's cross-check.
    """
    if method not in ("auto", "dp", "milp"):
        raise ValueError(f"solve_partition: method {method!r} is not one of 'auto', 'dp', 'milp'")
    solver = solve_partition_milp if method == "milp" else solve_partition_dp
    return solver(options, S, L, G, imbalance=imbalance, time_limit_s=time_limit_s, layer_bounds=layer_bounds)
