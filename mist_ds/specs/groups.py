"""The process groups of a layout, by role, and the one name both the cost model's accounting and the
runtime's step census give a group.

Ranks are laid out pipe slowest, then data, then sequence, then tensor (DeepSpeed's
PipeModelDataParallelTopology with axes pipe, data, model; DeepSpeed Ulysses' sequence groups are consecutive
ranks): rank = i (d q t) + j (q t) + m t + k for stage i, data index j, sequence index m, tensor index k.
Roles of a rank: `tensor` (its stage's TP group), `sequence` (same stage, data and TP index: the ranks that share
each sequence), `data` (same stage and TP index: d x q ranks, DeepSpeed's sequence-data-parallel group, which
reduces gradients and shards ZeRO's states; d ranks without sequence parallelism), `pipe` (its pipeline: every
stage, same data, sequence and TP index), `model` (DeepSpeed's model-parallel group, all stages and TP indices of
its data and sequence index: the group of its norm and overflow checks), `tied` (the first and
last stage of its pipeline, when embeddings are tied across stages), `world`. Roles that hold the same
ranks are one group: it is named by the first role in NAME_PRIORITY, and a group of one rank is
`self` (DeepSpeed still issues collectives on it).
"""
from __future__ import annotations

from mist_ds.specs.strategy import Parallelism

NAME_PRIORITY = ("tensor", "sequence", "data", "pipe", "tied", "model", "world")


def group_roles(par: Parallelism, rank: int, tied: bool = False) -> dict[str, frozenset[int]]:
    """Role -> global ranks of each group `rank` belongs to (module docstring)."""
    width, seq = par.stage_width, par.dp * par.sp
    # m: the data-and-sequence index (j q + sequence index), so `data` is every m of the stage's TP index
    stage, m, k = rank // width, (rank % width) // par.tp, rank % par.tp
    at = lambda i, mm, kk: i * width + mm * par.tp + kk  # noqa: E731
    first_of_group = m - m % par.sp
    roles = {
        "tensor": frozenset(at(stage, m, y) for y in range(par.tp)),
        "sequence": frozenset(at(stage, first_of_group + x, k) for x in range(par.sp)),
        "data": frozenset(at(stage, x, k) for x in range(seq)),
        "pipe": frozenset(at(i, m, k) for i in range(par.pp)),
        "model": frozenset(at(i, m, y) for i in range(par.pp) for y in range(par.tp)),
        "world": frozenset(range(par.num_gpus)),
    }
    if tied and par.pp > 1:
        roles["tied"] = frozenset({at(0, m, k), at(par.pp - 1, m, k)})
    return roles


def group_name(roles: dict[str, frozenset[int]], role: str) -> str:
    """The name of the group that plays `role` (module docstring)."""
    ranks = roles[role]
    if len(ranks) == 1:
        return "self"
    return next(r for r in NAME_PRIORITY if r in roles and roles[r] == ranks)


def names_by_ranks(roles: dict[str, frozenset[int]]) -> dict[frozenset[int], str]:
    return {ranks: group_name(roles, role) for role, ranks in roles.items()}


def stage_of(par: Parallelism, rank: int) -> int:
    return rank // par.stage_width
