"""Inter-stage solver: the threshold DP and the MILP against brute force, each other, and hand-made cases."""
from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mist_ds.specs.placement import stage_ranks_per_node
from mist_ds.tuner.milp import solve_partition_milp
from mist_ds.tuner.partition import solve_partition
from mist_ds.tuner.partition_dp import solve_partition_dp
from mist_ds.tuner.partition_model import HostSharing, Partition, StageOptions, pareto_front, partition_objective

REL_TOL = 1e-9  # DP and brute force do the same float operations up to summation order
MILP_REL_TOL = 1e-6  # CBC works to feasibility tolerances, on costs scaled to at most 1


def brute_force_partition(options: list[StageOptions], S: int, L: int, G: int, imbalance: bool = True,
                          host: HostSharing | None = None, split: bool = False):
    """(objective_s, layers, option) of the best split by enumeration, with the objective written the
    way docs/design.md (Tuner) states it (prefix sums), not through the DP's recurrence; None when nothing fits.
    host: each node's ranks of each stage times the stage's host bytes, summed, within its capacity. split:
    ZB-H1's closed form as tuner/partition.py states it (the sums over T - W, stage 0 keeping its W at G = 1; the
    maximum over (G - 1) T - (min(S, G) - 2) W), not through partition_model.split_terms."""
    table = {(o.position, o.layers): o for o in options if o.stable_s.size}
    best = None
    for layers in itertools.product(range(1, L + 1), repeat=S):
        if sum(layers) != L or any((i, l) not in table for i, l in enumerate(layers)):
            continue
        picked = [table[i, l] for i, l in enumerate(layers)]
        for option in itertools.product(*[range(o.stable_s.size) for o in picked]):
            if host is not None and any(sum(n * float(o.host_bytes[k]) for n, o, k in zip(row, picked, option))
                                        > host.capacity_bytes for row in host.ranks):
                continue
            t = np.array([o.stable_s[k] for o, k in zip(picked, option)])
            d = np.array([o.delta_s[k] for o, k in zip(picked, option)])
            e = np.array([o.end_s[k] for o, k in zip(picked, option)])
            f, most = t, (G - 1) * t.max()
            if split:
                w = np.array([o.weight_s for o in picked])
                f = t - w * ((np.arange(S) > 0) | (G > 1))
                most = float(np.max((G - 1) * t - (min(S, G) - 2) * w)) if G > 1 else 0.0
            prefix = np.concatenate([[0.0], np.cumsum(f)[:-1]])
            deficit = max(0.0, float(np.max(d - prefix))) if imbalance else 0.0
            objective = float(f.sum() + most + deficit + e.max())
            if best is None or objective < best[0]:
                best = (objective, layers, option)
    return best


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(1.0, abs(a), abs(b))


def _check_consistent(p: Partition, options: list[StageOptions], L: int, G: int, imbalance: bool,
                      split: bool = False) -> None:
    """A returned split is well formed and its objective_s is what its choice costs."""
    table = {(o.position, o.layers): o for o in options}
    assert sum(p.layers) == L and len(p.layers) == len(p.option)
    picked = [(table[i, l], k) for i, (l, k) in enumerate(zip(p.layers, p.option))]
    assert p.objective_s == partition_objective([o.stable_s[k] for o, k in picked], [o.delta_s[k] for o, k in picked],
                                                [o.end_s[k] for o, k in picked], G, imbalance,
                                                [o.weight_s for o, _ in picked] if split else None)
    assert p.bound_s <= p.objective_s


@st.composite
def instances(draw, max_stages: int = 4):
    """Small random problems: sparse (some (i, l) with no option), costs on a coarse grid for ties."""
    S = draw(st.integers(1, max_stages))
    L = draw(st.integers(S, S + 4))
    grid = st.integers(0, 40).map(lambda n: n / 8)
    options = []
    for i in range(S):
        for l in range(1, L - S + 2):
            K = draw(st.integers(0, 3))
            options.append(StageOptions(i, l, np.array(draw(st.lists(grid, min_size=K, max_size=K))) * l,
                                        draw(st.lists(grid, min_size=K, max_size=K)),
                                        draw(st.lists(st.one_of(st.just(0.0), grid), min_size=K, max_size=K))))
    G = draw(st.sampled_from([1, 2, 3, 8, 64]))
    return options, S, L, G, draw(st.booleans())


@settings(derandomize=True, deadline=None, max_examples=50)
@given(instances())
def test_dp_and_milp_match_brute_force(case):
    options, S, L, G, imbalance = case
    expected = brute_force_partition(options, S, L, G, imbalance)
    dp = solve_partition(options, S, L, G, imbalance, method="dp")
    milp = solve_partition(options, S, L, G, imbalance, method="milp")
    if expected is None:
        assert dp is None and milp is None
        return
    assert dp.solver == "dp" and milp.solver == "milp" and dp.gap == 0.0 and milp.gap == 0.0
    assert _close(dp.objective_s, expected[0], REL_TOL)
    assert _close(milp.objective_s, expected[0], MILP_REL_TOL)
    _check_consistent(dp, options, L, G, imbalance)
    _check_consistent(milp, options, L, G, imbalance)


@st.composite
def split_instances(draw):
    """instances() with a W per (stage, layers), at most its least stable time (ZB-H1's deferrable weight
    gradients)."""
    options, S, L, G, imbalance = draw(instances())
    weighted = [StageOptions(o.position, o.layers, o.stable_s, o.delta_s, o.end_s, None,
                             float(o.stable_s.min()) * draw(st.sampled_from([0.0, 0.25, 0.4, 0.5])) if o.stable_s.size
                             else 0.0) for o in options]
    return weighted, S, L, G, imbalance


@settings(derandomize=True, deadline=None, max_examples=50)
@given(split_instances())
def test_dp_and_milp_match_brute_force_in_zb_h1_s_closed_form(case):
    """Under a split schedule (ZB-H1's closed form, tuner/partition.py) both solvers find the enumeration's optimum
    and agree."""
    options, S, L, G, imbalance = case
    expected = brute_force_partition(options, S, L, G, imbalance, split=True)
    dp = solve_partition(options, S, L, G, imbalance, method="dp", split=True)
    milp = solve_partition(options, S, L, G, imbalance, method="milp", split=True)
    if expected is None:
        assert dp is None and milp is None
        return
    assert dp.gap == 0.0 and milp.gap == 0.0
    assert _close(dp.objective_s, expected[0], REL_TOL) and _close(milp.objective_s, expected[0], MILP_REL_TOL)
    _check_consistent(dp, options, L, G, imbalance, split=True)
    _check_consistent(milp, options, L, G, imbalance, split=True)


@st.composite
def shared_instances(draw):
    """instances() with host bytes per option and the nodes of a pipeline of S stages, w ranks each, g per
    node (g divides S w), the nodes holding several stages sharing a capacity."""
    options, S, L, G, imbalance = draw(instances())
    w = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([d for d in range(2, S * w + 1) if S * w % d == 0] or [S * w]))
    rows = tuple(tuple(int(c) for c in row) for row in stage_ranks_per_node(S, w, g) if (row > 0).sum() > 1)
    hosted = [StageOptions(o.position, o.layers, o.stable_s, o.delta_s, o.end_s,
                           draw(st.lists(st.integers(0, 4), min_size=o.stable_s.size, max_size=o.stable_s.size)))
              for o in options]
    return hosted, S, L, G, imbalance, HostSharing(rows, draw(st.integers(1, 12)))


@settings(derandomize=True, deadline=None, max_examples=60)
@given(shared_instances())
def test_shared_host_memory_milp_and_auto_match_brute_force(case):
    options, S, L, G, imbalance, host = case
    expected = brute_force_partition(options, S, L, G, imbalance, host)
    milp = solve_partition_milp(options, S, L, G, imbalance, host=host)
    auto = solve_partition(options, S, L, G, imbalance, host=host)
    if expected is None:
        assert milp is None and auto is None
        return
    for p in (milp, auto):
        assert p.gap == 0.0 and _close(p.objective_s, expected[0], MILP_REL_TOL)
        _check_consistent(p, options, L, G, imbalance)
        table = {(o.position, o.layers): o for o in options}
        assert host.fits([table[i, l].host_bytes[k] for i, (l, k) in enumerate(zip(p.layers, p.option))])


def test_shared_host_memory_binds_and_beats_the_per_gpu_share():
    """Two stages on one node of 2 ranks, 4 bytes of host: each stage runs fast by keeping 3 bytes on the
    host, or slow keeping none. Alone each fits (3 <= 4), together not (6 > 4): one stage goes fast. Each
    rank's share (2 bytes) admits neither fast option."""
    options = [StageOptions(i, 1, [1.0, 2.0], [0.0, 0.0], None, [3.0, 0.0]) for i in range(2)]
    host = HostSharing(((1, 1),), 4.0)
    relaxed = solve_partition(options, 2, 2, 4)
    shared = {m: solve_partition(options, 2, 2, 4, method=m, host=host) for m in ("auto", "milp")}
    share = solve_partition([StageOptions(i, 1, [2.0], [0.0]) for i in range(2)], 2, 2, 4, method="dp")
    assert relaxed.objective_s == 1 + 1 + 3 * 1
    assert shared["auto"].solver == shared["milp"].solver == "milp"
    assert shared["auto"].objective_s == shared["milp"].objective_s == 1 + 2 + 3 * 2
    assert sorted(shared["milp"].option) == [0, 1] and share.objective_s == 2 + 2 + 3 * 2
    with pytest.raises(ValueError, match="cannot couple"):
        solve_partition(options, 2, 2, 4, method="dp", host=host)
    roomy = HostSharing(((1, 1),), 6.0)  # cannot bind: the DP, exact, without the host criterion
    assert solve_partition(options, 2, 2, 4, host=roomy).solver == "dp"


def _random_pareto_options(S: int, per_stage: int, K: int, seed: int, end_levels: int | None = 1,
                           weights: bool = False):
    """Stages of per_stage +- 2 layers with K options on a (stable, delta) trade-off, stage 0's delta largest;
    end_levels distinct tails (1: none), None for a continuous tail; `weights`: a W of 0.03 s a layer (and 0.01 s
    more on the last stage, the head's), below every option's stable time. Returns (options, L)."""
    rng = np.random.default_rng(seed)
    options = []
    for i in range(S):
        for l in range(max(1, per_stage - 2), per_stage + 3):
            stable = np.sort(l * (0.1 + 0.05 * rng.random(K)) + 0.02 * (i == S - 1))
            delta = np.sort(rng.random(K) * 0.5 * l * (S - i) / S)[::-1]
            end = rng.random(K) * 0.3 if end_levels is None else rng.integers(0, end_levels, K) * 0.01
            weight = (0.03 * l + 0.01 * (i == S - 1)) * weights
            options.append(StageOptions(i, l, stable, delta, end, weight_s=weight))
    return options, S * per_stage


@pytest.mark.parametrize("G, imbalance, end_levels, split",
                         [(1, True, 1, False), (4, True, 3, False), (16, False, 1, False), (64, True, 2, False),
                          (8, True, None, False), (1, True, 1, True), (4, True, 3, True), (16, False, 1, True),
                          (64, True, 2, True), (8, True, None, True)])
def test_milp_equals_dp_on_mid_size(G, imbalance, end_levels, split):
    options, L = _random_pareto_options(6, 3, 6, seed=G, end_levels=end_levels, weights=split)
    dp = solve_partition_dp(options, 6, L, G, imbalance, split=split)
    milp = solve_partition_milp(options, 6, L, G, imbalance, split=split)
    assert milp.gap == 0.0 and _close(dp.objective_s, milp.objective_s, MILP_REL_TOL)
    _check_consistent(dp, options, L, G, imbalance, split)


def test_uneven_layers_are_optimal():
    """A heavy last stage (the head): with many micro-batches the max stage time rules, so it gets fewer layers."""
    S, L, G = 3, 9, 32
    options = [StageOptions(i, l, [l + (2.5 if i == S - 1 else 0.0)], [0.0]) for i in range(S) for l in range(1, L)]
    for method in ("dp", "milp"):  # (4, 4, 1): stage times 4, 4, 3.5; any other split has a max >= 4.5
        p = solve_partition(options, S, L, G, method=method)
        assert p.layers == (4, 4, 1) and p.objective_s == 11.5 + 31 * 4
    assert brute_force_partition(options, S, L, G)[1] == (4, 4, 1)


def test_imbalance_term_binds_on_an_unhidden_first_stage():
    """Stage 0's delta has no earlier stage to hide behind; stage 1's is hidden by stage 0's stable time."""
    options = [StageOptions(0, 1, [1.0, 2.5], [3.0, 0.0]), StageOptions(1, 1, [1.0], [2.0])]
    on = solve_partition(options, 2, 2, 1, imbalance=True)
    off = solve_partition(options, 2, 2, 1, imbalance=False)
    assert on.option == (1, 0) and on.objective_s == 3.5  # 2.5 + 1, stage 1's delta 2 <= 2.5 hidden
    assert off.option == (0, 0) and off.objective_s == 2.0  # the Aceso space ignores the 3 s delta
    assert solve_partition(options, 2, 2, 1, imbalance=True, method="milp").option == (1, 0)


def test_optimum_off_the_convex_hull_is_found():
    """Option B = (6, 6) of stage 1 lies above the segment from A = (1, 12) to C = (10, 1): no weighted sum
    of (stable, delta) ever picks it (Mist's sampling of the hull), yet it is the unique optimum."""
    stable, delta = np.array([1.0, 6.0, 10.0]), np.array([12.0, 6.0, 1.0])
    weights = np.linspace(0.0, 1.0, 2001)
    picked = np.argmin(weights[:, None] * stable + (1 - weights[:, None]) * delta, axis=1)
    assert 1 not in set(picked.tolist())
    assert set(pareto_front(stable, delta).tolist()) == {0, 1, 2}
    options = [StageOptions(0, 1, [6.0], [0.0]), StageOptions(1, 1, stable, delta)]
    G = 10  # A: 6 + 1 + 9*6 + (12 - 6) = 67, B: 6 + 6 + 54 + 0 = 66, C: 6 + 10 + 90 = 106
    for method in ("dp", "milp"):
        p = solve_partition(options, 2, 2, G, method=method)
        assert p.option == (0, 1) and p.objective_s == 66.0
    hull_only = [options[0], StageOptions(1, 1, stable[[0, 2]], delta[[0, 2]])]
    assert solve_partition(hull_only, 2, 2, G).objective_s == 67.0


def test_end_term_is_the_max_over_stages():
    options = [StageOptions(0, 1, [1.0, 2.0], [0.0, 0.0], [5.0, 0.0]), StageOptions(1, 1, [1.0], [0.0], [1.0])]
    for method in ("dp", "milp"):
        p = solve_partition(options, 2, 2, 1, method=method)
        assert p.option == (1, 0) and p.objective_s == 2.0 + 1.0 + 1.0


def test_infeasible_positions_and_layer_bounds():
    # stage 1 cannot hold 1 layer (nothing fits in memory), so 3 layers must go 1 + 2
    options = [StageOptions(0, 1, [5.0], [0.0]), StageOptions(0, 2, [1.0], [0.0]),
               StageOptions(1, 1, np.array([]), np.array([])), StageOptions(1, 2, [1.0], [0.0])]
    for method in ("dp", "milp"):
        assert solve_partition(options, 2, 3, 1, method=method).layers == (1, 2)
        assert solve_partition(options, 2, 4, 1, method=method).layers == (2, 2)
        assert solve_partition(options, 2, 2, 1, method=method) is None
        assert solve_partition(options, 2, 4, 1, method=method, layer_bounds=[(1, 1), (1, 3)]) is None
        assert solve_partition(options, 3, 4, 1, method=method) is None  # stage 2 has no options at all


def test_mapping_input_and_determinism():
    options, L = _random_pareto_options(5, 3, 6, seed=7, end_levels=2)
    by_key = {(o.position, o.layers): o for o in reversed(options)}
    for method in ("dp", "milp"):
        first = solve_partition(options, 5, L, 8, method=method)
        again = solve_partition([StageOptions(o.position, o.layers, o.stable_s.copy(), o.delta_s.copy(),
                                              o.end_s.copy()) for o in options], 5, L, 8, method=method)
        assert first == again
        assert solve_partition(by_key, 5, L, 8, method=method) == first
    with pytest.raises(ValueError, match="key"):
        solve_partition({(5, 5): options[0]}, 1, 2, 1)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="stable_s"):
        StageOptions(0, 1, [1.0, 2.0], [0.0])
    with pytest.raises(ValueError, match=">= 0"):
        StageOptions(0, 1, [-1.0], [0.0])
    with pytest.raises(ValueError, match="L >= S"):
        solve_partition([], 3, 2, 1)
    with pytest.raises(ValueError, match="method"):
        solve_partition([], 1, 1, 1, method="simplex")


def test_dp_time_limit_returns_a_valid_bound():
    options, L = _random_pareto_options(16, 4, 20, seed=3, end_levels=3)
    exact = solve_partition_dp(options, 16, L, 8)
    early = solve_partition_dp(options, 16, L, 8, time_limit_s=0.0)
    assert early.bound_s <= exact.objective_s <= early.objective_s
    assert early.gap == pytest.approx((early.objective_s - early.bound_s) / early.objective_s)


def test_milp_time_limit_reports_gap_or_timeout():
    options, L = _random_pareto_options(16, 4, 20, seed=1616, end_levels=1)
    exact = solve_partition_dp(options, 16, L, 16)
    try:
        p = solve_partition_milp(options, 16, L, 16, time_limit_s=0.5)
    except TimeoutError:
        return
    assert p.bound_s <= exact.objective_s * (1 + MILP_REL_TOL) and p.objective_s >= exact.objective_s * (1 - REL_TOL)
    assert p.gap == 0.0 or p.gap == pytest.approx((p.objective_s - p.bound_s) / p.objective_s)


@pytest.mark.parametrize("S", [16, 32])
def test_dp_scale(S):
    """S stages, 4 +- 2 layers each, 20 options per (stage, layers): the DP proves its optimum (its speed at
    the tuner's sizes: benchmarks/results/partition_solvers.md)."""
    for G, end_levels in ((1, 3), (4, 3), (64, 3), (8, None)):
        options, L = _random_pareto_options(S, 4, 20, seed=S * 100 + G, end_levels=end_levels)
        p = solve_partition(options, S, L, G)
        assert p.solver == "dp" and p.gap == 0.0
        _check_consistent(p, options, L, G, True)


@pytest.mark.parametrize("G, imbalance, split", [(16, False, False), (1, True, False), (4, True, False),
                                                 (32, True, True)])
def test_milp_scale_cross_check(G, imbalance, split):
    """S = 16, 20 options per (stage, layers): CBC proves the DP's optimum, the imbalance term with G > 1
    included (it took ~20 s before the bound pruning and min-max floors of tuner/milp.py), and in ZB-H1's closed
    form."""
    options, L = _random_pareto_options(16, 4, 20, seed=1600 + G, end_levels=1, weights=split)
    dp = solve_partition_dp(options, 16, L, G, imbalance, split=split)
    milp = solve_partition_milp(options, 16, L, G, imbalance, time_limit_s=120, split=split)
    assert milp.gap == 0.0 and _close(dp.objective_s, milp.objective_s, MILP_REL_TOL)


# ------------------------------------------------------------------------------------------ pareto_front


def _pareto_reference(points: np.ndarray) -> set[tuple[float, ...]]:
    """Distinct non-dominated points by the O(n^2) definition."""
    front = set()
    for p in points:
        dominated = any(np.all(q <= p) and np.any(q < p) for q in points)
        if not dominated:
            front.add(tuple(p))
    return front


@settings(derandomize=True, deadline=None, max_examples=40)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 2)), max_size=60))
def test_pareto_front_matches_definition(rows):
    points = np.array(rows, dtype=float).reshape(-1, 3)
    idx = pareto_front(points[:, 0], points[:, 1], points[:, 2])
    assert {tuple(points[i]) for i in idx} == _pareto_reference(points)
    assert len(idx) == len({tuple(points[i]) for i in idx})  # duplicates collapsed
    for i in idx:  # the kept copy of a duplicate is its lowest index
        assert i == min(j for j in range(len(points)) if tuple(points[j]) == tuple(points[i]))
    keys = [tuple(points[i]) for i in idx]
    assert keys == sorted(keys)


def test_pareto_front_two_criteria_order_and_empty():
    stable, delta = [3.0, 1.0, 2.0, 2.0, 1.0, 4.0], [1.0, 5.0, 2.0, 2.0, 6.0, 1.0]
    assert pareto_front(stable, delta).tolist() == [1, 2, 0]
    assert pareto_front([], []).tolist() == []
    with pytest.raises(ValueError, match="NaN"):
        pareto_front([np.nan], [0.0])


def test_pareto_front_is_exact_on_a_big_grid():
    """Blocks of a large input (its speed is the tuner's, measured in benchmarks/results/tune_speed.md)."""
    rng = np.random.default_rng(0)
    stable = rng.random(30000)
    delta = (1 - stable) + 0.3 * rng.random(30000)
    end = rng.integers(0, 4, 30000) * 0.1
    idx = pareto_front(stable, delta, end)
    sample = rng.choice(30000, 400, replace=False)
    points = np.stack([stable, delta, end], axis=1)
    front = points[idx]
    for i in sample:  # a point off the front is dominated by some front point, one on it by none
        dominated = np.any(np.all(front <= points[i], axis=1) & np.any(front < points[i], axis=1))
        assert dominated != (i in set(idx.tolist()))
