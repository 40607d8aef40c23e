"""The threshold DP of the inter-stage problem (mist_ds/tuner/partition.py states the problem and why the DP
is exact): fixes max T <= tau and max E <= eps, runs a DP over (stage, layers used) per pair, and searches
the pairs by branch and bound on boxes of candidates.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from mist_ds.tuner.partition_model import Choice, Options, Partition, by_stage, check_sizes, evaluate

log = logging.getLogger(__name__)

# Threshold search: each box of (max T, max E) candidates is halved along both axes per round. Measured
# at S = 32 with 3000 x 3000 candidate pairs: halving evaluates 1.6-3.2k pairs, cutting in 8 evaluates
# 9-12k (4x slower); with a handful of E values both take < 0.15 s. The pairs of one vectorized DP pass
# are capped to bound memory (pairs x (L + 1) floats per stage).
BOX_FANOUT = 2
MAX_CHUNK_PAIRS = 4096


def _transition(q: np.ndarray, c: Choice, tau: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """min_k F_k + max(q, D_k) over options with T_k <= tau and E_k <= eps; q (P, U), tau and eps (P, 1). T is
    the maximum's term of an option, F its sums' (both its stable time under 1F1B; Choice).

    Split at q: options with D_k <= q cost q + F_k (prefix minimum of F in D order), the others
    F_k + D_k (suffix minimum). Both are the same float operations as F_k + max(q, D_k).
    """
    by_d = np.argsort(c.delta_s, kind="stable")
    t, f, d, e = c.stable_s[by_d], c.fill_s[by_d], c.delta_s[by_d], c.end_s[by_d]
    ok = (t[None, :] <= tau) & (e[None, :] <= eps)  # (P, K)
    pre = np.full((ok.shape[0], len(t) + 1), np.inf)
    pre[:, 1:] = np.minimum.accumulate(np.where(ok, f, np.inf), axis=1)
    suf = np.full_like(pre, np.inf)
    suf[:, :-1] = np.minimum.accumulate(np.where(ok, f + d, np.inf)[:, ::-1], axis=1)[:, ::-1]
    idx = np.searchsorted(d, q, side="right")  # options with D_k <= q
    return np.minimum(q + np.take_along_axis(pre, idx, axis=1), np.take_along_axis(suf, idx, axis=1))


def _dp_values(stages: list[list[Choice]], L: int, tau: np.ndarray, eps: np.ndarray) -> list[np.ndarray]:
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


def _dp_assignment(stages: list[list[Choice]], L: int, tau: float, eps: float):
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
            cost = np.where((c.stable_s <= tau) & (c.end_s <= eps), c.fill_s + np.maximum(q, c.delta_s), np.inf)
            k = int(np.argmin(cost))
            if cost[k] == values[i][used]:
                layers.append(c.layers)
                option.append(k)
                used -= c.layers
                break
        else:  # the forward pass reached this state, so some choice must reproduce it
            raise AssertionError(f"DP backtrack found no choice at stage {i}, {used} layers")
    return tuple(reversed(layers)), tuple(reversed(option))


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
                       time_limit_s: float = 60.0, layer_bounds: Sequence[tuple[int, int]] | None = None,
                       split: bool = False) -> Partition | None:
    """Exact threshold DP (module docstring). None when no split fits. `split`: ZB-H1's closed form
    (partition.py), each option's two terms in Choice.

    After `time_limit_s` the best split so far comes back with bound_s = the smallest bound of the
    threshold boxes not yet settled.
    """
    check_sizes(S, L, G, layer_bounds)
    stages = by_stage(options, S, L, imbalance, layer_bounds, G, split)
    if any(not s for s in stages):
        return None
    start = time.perf_counter()
    found = _dp_assignment(stages, L, math.inf, math.inf)  # no threshold: an upper bound to prune with
    if found is None:
        return None
    first = evaluate(stages, *found, G)
    best, pair, bound = _search_thresholds(stages, L, G, first, start + time_limit_s)
    layers, option = found if pair is None else _dp_assignment(stages, L, *pair)
    objective = evaluate(stages, layers, option, G)
    bound = min(bound, objective)
    gap = (objective - bound) / objective if objective > 0 else 0.0
    log.debug("partition dp: S=%d L=%d G=%d %.3fs", S, L, G, time.perf_counter() - start)
    return Partition(layers, option, objective, bound, gap, "dp")


