"""The partition MILP (docs/design.md, Tuner): python-mip / CBC, one thread, fixed seed, the DP's optimum
as its MIP start. The general solver: it also couples the host memory of stages sharing a node.

Variables, for stage i, layer count l, option k of the (i, l) front and u layers before stage i:
- a[i, u, l] binary: one unit of flow from node (0, 0) to node (S, L); the arc gives stage i layers
  u+1..u+l (a path polytope: the layer part of the LP relaxation is integral);
- y[i, l, k] binary with sum_k y[i, l, k] = sum_u a[i, u, l]: the option stage i runs;
- T_i = sum T[i, l, k] y[i, l, k], and D_i, E_i, H_i and F_i likewise (linear in y); F is what the sums take, T
  what the maximum takes (both the stable time under 1F1B; under a split schedule ZB-H1's closed form,
  partition.py and partition_model.Choice);
- max T = tau_0 + sum_h (tau_h - tau_{h-1}) v_h over the distinct T levels tau_h above the floor tau_0,
  v_h binary, v_h >= v_{h+1}, v_h >= (the share of stage i on options with T >= tau_h) for every i;
  max E alike;
- dmax >= D_i - sum_{j<i} F_j, dmax >= 0 (the imbalance term);
- sum_i c[n, i] H_i <= M for each node n holding c[n, i] ranks of several stages (HostSharing).
Objective: sum_i F_i + (G - 1) max T + dmax + max E.

What keeps it tight (the LP bound near the optimum, so CBC proves it in few nodes):
1. Bound pruning against the incumbent U (the MIP start). Any split using arc (i, u, l) with option k
   costs at least [least sum of F to reach (i, u)] + F_k + [least sum of F from (i + 1, u + l) to the
   end] + (G - 1) max(least max T of a path to (i, u), T_k, least max T from (i + 1, u + l)) +
   max(E_k and the same min-max bounds of E) + (D_k on stage 0, else stage 0's least D), each term a
   lower bound of its own part of the objective (sums and min-max bounds by a pass over the flow
   network). Options and arcs whose every bound exceeds U go, unreachable nodes with them, until
   nothing changes; the optimum always stays (its bound is at most U).
2. The maxima's floor tau_0 is the least max T any remaining path can have (the min-max bound), not
   the least option: otherwise the LP averages a stage with l + 1 layers against one with l - 1 and
   pays only half of the heaviest stage's level.
3. Only stages whose deficit D_i - P_i can be positive get an imbalance row.
Ties: a split CBC finds is taken only when it is better than the start by more than the gap, so the
plan is the DP's whenever both are optimal.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence

import mip
import numpy as np

from mist_ds.tuner.partition_dp import solve_partition_dp
from mist_ds.tuner.partition_model import (Choice, HostSharing, Options, Partition, by_stage, check_sizes, evaluate,
                                           host_of, mapped, restricted)

log = logging.getLogger(__name__)

# CBC defaults stop at a 1e-4 relative gap: too loose for a solver that must match the DP.
MILP_REL_GAP = 1e-9
MILP_ABS_GAP = 1e-12
MILP_FEAS_TOL = 1e-9
# Pruning rounds: each drops what the previous round's removals make unreachable or too costly; on the
# tune_speed cases nothing changes after the third.
PRUNE_ROUNDS = 8


@dataclasses.dataclass
class _Space:
    """What is left of the problem: per stage the options (`stages`), their indices in the input options
    (`index[i][l]`) and the layers used before the stage on each arc (`arcs[i][l]`)."""

    stages: list[list[Choice]]
    index: list[dict[int, np.ndarray]]
    arcs: list[dict[int, np.ndarray]]

    def size(self) -> int:
        return sum(c.stable_s.size for s in self.stages for c in s)


def _initial_space(stages: list[list[Choice]], L: int) -> _Space:
    arcs = [{c.layers: np.arange(L + 1 - c.layers) for c in s} for s in stages]
    return _connected(_Space(stages, [{c.layers: np.arange(c.stable_s.size) for c in s} for s in stages], arcs), L)


def _connected(space: _Space, L: int) -> _Space:
    """Only arcs on some path from (0, 0) to (S, L), and only (i, l) with arcs left."""
    S = len(space.stages)
    forward = [np.zeros(L + 1, dtype=bool) for _ in range(S + 1)]
    forward[0][0] = True
    for i in range(S):
        for l, us in space.arcs[i].items():
            forward[i + 1][us[forward[i][us]] + l] = True
    backward = [np.zeros(L + 1, dtype=bool) for _ in range(S + 1)]
    backward[S][L] = True
    for i in range(S - 1, -1, -1):
        for l, us in space.arcs[i].items():
            backward[i][us[backward[i + 1][us + l]]] = True
    arcs = [{l: us[forward[i][us] & backward[i + 1][us + l]] for l, us in space.arcs[i].items()} for i in range(S)]
    stages = [[c for c in s if arcs[i][c.layers].size] for i, s in enumerate(space.stages)]
    return _Space(stages, [{c.layers: space.index[i][c.layers] for c in s} for i, s in enumerate(stages)],
                  [{c.layers: arcs[i][c.layers] for c in s} for i, s in enumerate(stages)])


def _path_bounds(space: _Space, L: int, field: str) -> tuple[np.ndarray, ...]:
    """(F, Fm, B, Bm), [S + 1, L + 1] each, over the flow network with each (i, l) at its least `field`:
    F[i, u] the least sum over stages before i of a path reaching (i, u), Fm the least max; B[i, u] and
    Bm the same from (i, u) to (S, L). inf where no path."""
    S = len(space.stages)
    F, Fm, B, Bm = (np.full((S + 1, L + 1), np.inf) for _ in range(4))
    F[0, 0] = Fm[0, 0] = 0.0
    B[S, L] = Bm[S, L] = 0.0
    least = [{c.layers: float(getattr(c, field).min()) for c in s} for s in space.stages]
    for i in range(S):
        for l, us in space.arcs[i].items():
            np.minimum.at(F[i + 1], us + l, F[i, us] + least[i][l])
            np.minimum.at(Fm[i + 1], us + l, np.maximum(Fm[i, us], least[i][l]))
    for i in range(S - 1, -1, -1):
        for l, us in space.arcs[i].items():
            np.minimum.at(B[i], us, B[i + 1, us + l] + least[i][l])
            np.minimum.at(Bm[i], us, np.maximum(Bm[i + 1, us + l], least[i][l]))
    return F, Fm, B, Bm


def _prune(space: _Space, L: int, G: int, upper_s: float) -> _Space:
    """Drop the options and arcs no split costing at most `upper_s` uses (module docstring, 1)."""
    limit = upper_s + MILP_REL_GAP * abs(upper_s) + MILP_ABS_GAP
    for _ in range(PRUNE_ROUNDS):
        F, _, B, _ = _path_bounds(space, L, "fill_s")
        _, Fm, _, Bm = _path_bounds(space, L, "stable_s")
        _, Em, _, EBm = _path_bounds(space, L, "end_s")
        least_first_delta = max(0.0, min(float(c.delta_s.min()) for c in space.stages[0]))
        arcs, index, stages, changed = [], [], [], False
        for i, choices in enumerate(space.stages):
            arcs.append({}), index.append({}), stages.append([])
            for c in choices:
                us = space.arcs[i][c.layers]
                ahead, behind = us + c.layers, us
                sums = F[i, behind] + B[i + 1, ahead]
                most_t = np.maximum(Fm[i, behind], Bm[i + 1, ahead])
                most_e = np.maximum(Em[i, behind], EBm[i + 1, ahead])
                imbalance = np.maximum(c.delta_s, 0.0) if i == 0 else np.full(c.stable_s.size, least_first_delta)
                bound = (sums[:, None] + c.fill_s[None, :] + imbalance[None, :]
                         + (G - 1) * np.maximum(most_t[:, None], c.stable_s[None, :])
                         + np.maximum(most_e[:, None], c.end_s[None, :]))  # [arcs, options]
                ok = bound <= limit
                keep_arc, keep_option = ok.any(axis=1), ok.any(axis=0)
                changed |= not (keep_arc.all() and keep_option.all())
                if keep_arc.any():
                    arcs[i][c.layers] = us[keep_arc]
                    index[i][c.layers] = space.index[i][c.layers][keep_option]
                    stages[i].append(Choice(c.layers, *(getattr(c, f)[keep_option] for f in _COSTS)))
        space = _connected(_Space(stages, index, arcs), L)
        if not changed:
            break
    return space


_COSTS = ("stable_s", "delta_s", "end_s", "host_bytes", "fill_s")


def _new_model() -> mip.Model:
    model = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    model.verbose, model.threads, model.seed = 0, 1, 0
    model.max_mip_gap, model.max_mip_gap_abs = MILP_REL_GAP, MILP_ABS_GAP
    model.infeas_tol = model.integer_tol = MILP_FEAS_TOL
    return model


@dataclasses.dataclass
class _Model:
    """The CBC model and its binaries: arcs a[i, l] (one per u of space.arcs[i][l]), options y[i, l],
    levels of each maximum (with their values, to set a start)."""

    model: mip.Model
    a: dict[tuple[int, int], list[mip.Var]]
    y: dict[tuple[int, int], list[mip.Var]]
    levels: list[tuple[np.ndarray, list[mip.Var], str]]


def _max_by_levels(model: mip.Model, per_stage: list[list[tuple[float, mip.Var]]], floor: float
                   ) -> tuple[mip.LinExpr | float, np.ndarray, list[mip.Var]]:
    """max_i (cost of stage i's option), at least `floor`, as floor + sum_h (c_h - c_{h-1}) v_h over the
    distinct costs c_h above it; v_h >= v_{h+1} and v_h >= the share of each stage on options costing
    >= c_h (running sums u keep it linear in size). Returns (expression, levels, v)."""
    levels = np.unique([floor] + [max(c, floor) for stage in per_stage for c, _ in stage])
    v = [model.add_var(var_type=mip.BINARY) for _ in levels[1:]]
    for h in range(1, len(v)):
        model += v[h - 1] >= v[h]
    for stage in per_stage:
        running: mip.LinExpr | None = None
        for cost in sorted({c for c, _ in stage if c > floor}, reverse=True):
            share = mip.xsum(var for c, var in stage if c == cost)
            running = share if running is None else running + share
            u = model.add_var(lb=0.0, ub=1.0)
            model += u == running
            running = mip.LinExpr([u], [1.0])
            model += v[int(np.searchsorted(levels, cost)) - 1] >= u
    expression = float(levels[0]) + mip.xsum(float(levels[h] - levels[h - 1]) * v[h - 1] for h in range(1, len(levels)))
    return expression, levels, v


def _build(space: _Space, L: int, G: int, scale: float, host: HostSharing | None) -> _Model:
    """The CBC model of the pruned space (module docstring); costs divided by `scale`."""
    model, S = _new_model(), len(space.stages)
    a, y, balance = {}, {}, {}
    for i, choices in enumerate(space.stages):
        for c in choices:
            a[i, c.layers] = [model.add_var(var_type=mip.BINARY) for _ in space.arcs[i][c.layers]]
            y[i, c.layers] = [model.add_var(var_type=mip.BINARY) for _ in range(c.stable_s.size)]
            model += mip.xsum(y[i, c.layers]) == mip.xsum(a[i, c.layers])
            for u, arc in zip(space.arcs[i][c.layers].tolist(), a[i, c.layers]):
                balance.setdefault((i, u), []).append(-arc)
                balance.setdefault((i + 1, u + c.layers), []).append(arc)
    for node, terms in balance.items():
        model += mip.xsum(terms) == (-1 if node == (0, 0) else 1 if node == (S, L) else 0)

    def picked(i: int, field: str) -> list[tuple[float, mip.Var]]:
        return [(float(cost) / scale, var) for c in space.stages[i]
                for cost, var in zip(getattr(c, field), y[i, c.layers])]

    stage_f = [mip.xsum(cost * var for cost, var in picked(i, "fill_s")) for i in range(S)]
    floor_t = _path_bounds(space, L, "stable_s")[1][S, L] / scale
    floor_e = _path_bounds(space, L, "end_s")[1][S, L] / scale
    max_e, levels_e, v_e = _max_by_levels(model, [picked(i, "end_s") for i in range(S)], floor_e)
    objective = mip.xsum(stage_f) + max_e
    levels = [(levels_e, v_e, "end_s")]
    if G > 1:
        max_t, levels_t, v_t = _max_by_levels(model, [picked(i, "stable_s") for i in range(S)], floor_t)
        objective = objective + (G - 1) * max_t
        levels.append((levels_t, v_t, "stable_s"))
    before = _path_bounds(space, L, "fill_s")[0].min(axis=1)  # least P_i over the nodes left
    deficits = [i for i, s in enumerate(space.stages) if max(float(c.delta_s.max()) for c in s) > before[i]]
    if deficits:
        d_max = model.add_var(lb=0.0)
        for i in deficits:
            model += d_max >= mip.xsum(cost * var for cost, var in picked(i, "delta_s")) - mip.xsum(stage_f[:i])
        objective = objective + d_max
    for row in (host.ranks if host is not None else ()):
        most = sum(count * max(float(c.host_bytes.max()) for c in space.stages[i])
                   for i, count in enumerate(row) if count)
        if most > host.capacity_bytes:  # else the node cannot be full whatever its stages pick
            shared = [(count, c, y[i, c.layers]) for i, count in enumerate(row) if count for c in space.stages[i]]
            model += mip.xsum(count * float(h) / host.capacity_bytes * var for count, c, ys in shared
                              for h, var in zip(c.host_bytes, ys)) <= 1.0
    model.objective = mip.minimize(objective)
    return _Model(model, a, y, levels)


def _set_start(built: _Model, space: _Space, start: Partition, scale: float) -> None:
    """The start split as values of every binary (arcs, options, levels)."""
    values, used = [], 0
    chosen = {}
    for i, (l, k) in enumerate(zip(start.layers, start.option)):
        us, index = space.arcs[i][l].tolist(), space.index[i][l].tolist()
        values += [(var, float(u == used)) for u, var in zip(us, built.a[i, l])]
        values += [(var, float(j == k)) for j, var in zip(index, built.y[i, l])]
        chosen[i] = (l, index.index(k))
        used += l
    for (i, l), arcs in built.a.items():
        if chosen[i][0] != l:
            values += [(var, 0.0) for var in arcs + built.y[i, l]]
    for levels, v, field in built.levels:
        top = max(float(getattr(next(c for c in space.stages[i] if c.layers == l), field)[k]) / scale
                  for i, (l, k) in chosen.items())
        values += [(var, float(level <= top)) for level, var in zip(levels[1:], v)]
    built.model.start = values


def _read(built: _Model, space: _Space) -> tuple[tuple[int, ...], tuple[int, ...]]:
    layers, option = [], []
    for i in range(len(space.stages)):
        (l, k), = [(l, k) for (j, l), ys in built.y.items() if j == i for k, var in enumerate(ys) if var.x >= 0.5]
        layers.append(l)
        option.append(int(space.index[i][l][k]))
    return tuple(layers), tuple(option)


def _start(options: Options, S: int, L: int, G: int, imbalance: bool, time_limit_s: float, layer_bounds,
           host: HostSharing | None, split: bool) -> Partition | None:
    """A feasible split to start from: the DP's optimum, within each rank's share when stages share a
    node's host memory (the DP's optimum without the sharing is checked first: if it fits, it is optimal)."""
    best = solve_partition_dp(options, S, L, G, imbalance, time_limit_s=time_limit_s, layer_bounds=layer_bounds,
                              split=split)
    if host is None or best is None or host.fits(host_of(options, best)):
        return best
    within, index = restricted(options, lambda opt: np.flatnonzero(opt.host_bytes <= host.share_bytes))
    return mapped(solve_partition_dp(within, S, L, G, imbalance, time_limit_s=time_limit_s,
                                     layer_bounds=layer_bounds, split=split), index)


def solve_partition_milp(options: Options, S: int, L: int, G: int, imbalance: bool = True,
                         time_limit_s: float = 60.0, layer_bounds: Sequence[tuple[int, int]] | None = None,
                         host: HostSharing | None = None, lower_bound_s: float = 0.0,
                         split: bool = False) -> Partition | None:
    """The MILP of the module docstring on CBC (one thread, fixed seed). None when proven infeasible.
    `split`: ZB-H1's closed form (partition.py), each option's two terms in partition_model.Choice.

    host: the host memory stages on one node share (None: options fit on their own). lower_bound_s: a
    bound already known (e.g. the DP's optimum without the sharing), reported if CBC's is weaker. Raises
    TimeoutError when the limit passes before any feasible split is found.
    """
    check_sizes(S, L, G, layer_bounds)
    begin = time.perf_counter()
    stages = by_stage(options, S, L, imbalance, layer_bounds, G, split)
    if any(not s for s in stages):
        return None
    space = _initial_space(stages, L)
    if any(not s for s in space.stages):
        return None  # no split of L layers exists: CBC would be handed an empty or trivial model
    start = _start(options, S, L, G, imbalance, time_limit_s, layer_bounds, host, split)
    before = space.size()
    if start is not None:  # pruned by the start's own cost, recomputed: the MILP stays a check of the DP
        space = _prune(space, L, G, evaluate(stages, start.layers, start.option, G))
    scale = max(max(float(max(c.stable_s.max(), c.fill_s.max(), c.delta_s.max(), c.end_s.max())) for c in s)
                for s in space.stages)
    scale = scale if scale > 0 else 1.0
    built = _build(space, L, G, scale, host)
    if start is not None:
        _set_start(built, space, start, scale)
    left = max(time_limit_s - (time.perf_counter() - begin), 0.01)
    status = built.model.optimize(max_seconds=left)
    solved = status in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE)
    if not solved and start is None:
        if status in (mip.OptimizationStatus.INFEASIBLE, mip.OptimizationStatus.INT_INFEASIBLE):
            return None
        raise TimeoutError(f"solve_partition_milp: no feasible split within {time_limit_s} s (status {status.name})")
    layers, option = (start.layers, start.option) if start is not None else ((), ())
    objective = evaluate(stages, layers, option, G) if start is not None else math.inf
    if solved:
        found = _read(built, space)
        value = evaluate(stages, *found, G)
        # CBC keeps rows within its feasibility tolerance: a split over a node's memory by that much is refused.
        overflows = host is not None and not host.fits(host_of(options, Partition(*found, value, value, 0.0, "milp")))
        if overflows and start is None:
            raise TimeoutError(f"solve_partition_milp: CBC's split overflows a node by its tolerance and no "
                               f"feasible split was found within {time_limit_s} s")
        if not overflows and (start is None or value < objective - MILP_REL_GAP * abs(objective)):
            layers, option, objective = *found, value
    if status == mip.OptimizationStatus.OPTIMAL:
        bound = objective
    else:
        cbc_bound = built.model.objective_bound * scale if solved else -math.inf
        bound = min(objective, max(lower_bound_s, cbc_bound))
    gap = (objective - bound) / objective if objective > 0 else 0.0
    log.debug("partition milp: S=%d L=%d G=%d, %d of %d options left, %d columns, %s, %.3fs", S, L, G, space.size(),
              before, built.model.num_cols, status.name, time.perf_counter() - begin)
    return Partition(tuple(layers), tuple(option), objective, bound, gap, "milp")
