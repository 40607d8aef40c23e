"""Inter-stage solver: split L layers over S pipeline stages and pick one intra-stage option per stage.

Stage i (position 0 = first stage) with l layers offers a Pareto set of options k, each with three costs
in seconds: stable T (one steady-state micro-batch), delta D (extra cost of the first/last micro-batch
that is not hidden behind the stages before it) and end E (end-of-iteration tail, e.g. an optimizer step),
and the host bytes H one rank of the stage keeps (offloaded states and activations). For G micro-batches
the iteration time is (docs/design.md, Tuner)

    sum_i T_i + (G - 1) max_i T_i + max(0, max_i (D_i - P_i)) + max_i E_i,   P_i = sum_{j<i} T_j.

The first two terms are the 1F1B pipeline, the third the inter-micro-batch imbalance (switched off for
the Aceso baseline space), the last the tail.

Under a schedule that splits the backward (`split`: ZB-H1, whose stage i has W_i seconds of deferrable weight
gradients per micro-batch, StageOptions.weight_s) the pipeline's terms are ZB-H1's closed form, derived from the
order the event simulator replays (docs/design.md, The `zb-h1` schedule): with m = min(S, G) - 1,

    sum_i (T_i - W_i) + max_i ((G - 1) T_i - (m - 1) W_i)      (G >= 2),
    sum_i (T_i - W_i) + W_0                                    (G = 1: the stages in turn, stage 0's W last),

the imbalance and the tail as above with P_i = sum_{j<i} (T_j - W_j). For equal stages (G >= S) it is
G T + (S - 1)(T - 2 W), the simulator's and the paper's. Both solvers take it in the same shape as 1F1B's: the sums
over F_i = T_i - W_i (stage 0 at G = 1: T_0), the maximum over T'_i = T_i - (m - 1) W_i / (G - 1)
(partition_model.split_terms); within one (stage, layers) W is the same for every option, so the Pareto fronts in
(T, D, E) are fronts in (T', F, D, E). With host memory shared per node (`HostSharing`), the
stages whose ranks share a node must fit in its host memory together: sum_i c[n, i] H_i <= M for node n
holding c[n, i] ranks of stage i.

Two exact solvers, chosen by `solve_partition` (here), on the types of partition_model.py:
- `solve_partition_dp` (mist_ds/tuner/partition_dp.py): fixes thresholds max T <= tau and max E <= eps by
  filtering options, then runs a DP over (stage, layers used). Exactness rests on one identity: with Q_{-1} = 0 and
    Q_i = T_i + max(Q_{i-1}, D_i)
  the last value is Q_{S-1} = sum_i T_i + max(0, max_i (D_i - P_i)) (induction: Q_i = P_{i+1} + max(0,
  max_{j<=i} (D_j - P_j))). Q_i is nondecreasing in Q_{i-1}, so a smaller Q after i stages never hurts
  what follows and the DP keeps one value per (stage, layers used). Under thresholds (tau, eps) the
  objective of the DP's split is at most Q_{S-1} + (G-1) tau + eps, with equality at the optimum's own
  (max T, max E), so the minimum over all pairs is the optimum. The pairs are searched by branch and
  bound on boxes of candidates (Q is nonincreasing in both thresholds), vectorized over pairs with numpy.
  It cannot couple stages, so it never sees the shared host memory.
- `solve_partition_milp` (mist_ds/tuner/milp.py): python-mip / CBC, the general formulation: it also
  takes the shared host memory, and cross-checks the DP. Imported only when called for (CBC is heavy to
  load); it starts from the DP's optimum, so it imports partition_dp.py and this module sits above both.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from mist_ds.tuner.partition_dp import solve_partition_dp
from mist_ds.tuner.partition_model import (HostSharing, Options, Partition, StageOptions, host_of, mapped,
                                           option_list, pareto_front, restricted)

METHODS = ("auto", "dp", "milp")


def _time_front(opt: StageOptions) -> np.ndarray:
    """The (stable, delta, end) front: what the DP needs when the host memory cannot bind."""
    return pareto_front(opt.stable_s, opt.delta_s, opt.end_s)


def host_can_bind(options: Options, S: int, host: HostSharing | None) -> bool:
    """Whether the shared host memory can exclude some choice: a node whose stages' largest options
    together exceed its memory. When none can, it is no constraint and the DP is exact."""
    if host is None or not host.ranks:
        return False
    largest = np.zeros(S)
    for opt in option_list(options):
        if opt.position < S and opt.host_bytes.size:
            largest[opt.position] = max(largest[opt.position], float(opt.host_bytes.max()))
    return not host.fits(largest)


def solve_partition(options: Options, S: int, L: int, G: int, imbalance: bool = True,
                    method: Literal["auto", "dp", "milp"] = "auto", time_limit_s: float = 60.0,
                    layer_bounds: Sequence[tuple[int, int]] | None = None,
                    host: HostSharing | None = None, split: bool = False) -> Partition | None:
    """Best split of L layers over S stages and one option per stage; None when nothing fits.

    options: StageOptions (or a mapping (position, layers) -> StageOptions); a missing or empty
    (i, l) means stage i cannot hold l layers. layer_bounds: optional inclusive (min, max) layers per stage.
    host: the host memory the stages of a node share (None: each option already fits on its own).
    "auto" takes the DP, exact for this objective (module docstring), unless the shared host memory can
    bind: then the DP's optimum without it, if it fits, else the MILP. "dp" refuses a host memory that
    can bind (the DP cannot couple stages); "milp" always runs CBC. split: ZB-H1's closed form (module docstring).
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
                                    layer_bounds=layer_bounds, host=host if coupled else None, split=split)
    if host is not None and not coupled:
        fronts, index = restricted(options, _time_front)
        return mapped(solve_partition_dp(fronts, S, L, G, imbalance=imbalance, time_limit_s=time_limit_s,
                                         layer_bounds=layer_bounds, split=split), index)
    relaxed = solve_partition_dp(options, S, L, G, imbalance=imbalance, time_limit_s=time_limit_s,
                                 layer_bounds=layer_bounds, split=split)
    if not coupled or relaxed is None or host.fits(host_of(options, relaxed)):
        return relaxed  # the optimum without the coupling fits it: optimal with it too
    from mist_ds.tuner.milp import solve_partition_milp

    return solve_partition_milp(options, S, L, G, imbalance=imbalance, time_limit_s=time_limit_s,
                                layer_bounds=layer_bounds, host=host, lower_bound_s=relaxed.bound_s, split=split)


