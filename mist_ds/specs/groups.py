"""The process groups of a layout, by role, and the one name both the cost model's accounting and the
runtime's step census give a group.

Ranks are laid out pipe slowest, then data, then tensor (DeepSpeed's PipeModelDataParallelTopology
with axes pipe, data, model): rank = i (d t) + j t + k for stage i, data index j, tensor index k.
Roles of a rank: `tensor` (its stage's TP group), `data` (same stage and TP index), `pipe` (its
pipeline: every stage, same data and TP index), `model` (DeepSpeed's model-parallel group, all stages
and TP indices of its data index: the group of its norm and overflow checks), `tied` (the first and
last stage of its pipeline, when embeddings are tied across stages), `world`. Roles that hold the same
ranks are one group: it is named by the first role in NAME_PRIORITY, and a group of one rank is
`self` (DeepSpeed still issues collectives on it).
"""
from __future__ import annotations

from mist_ds.specs.strategy import Parallelism

NAME_PRIORITY = ("tensor", "data", "pipe", "tied", "model", "world")


def group_roles(par: Parallelism, rank: int, tied: bool = False) -> dict[str, frozenset[int]]:
    """Role -> global ranks of each group `rank` belongs to (module docstring)."""
    width = par.dp * par.tp
    stage, j, k = rank // width, (rank % width) // par.tp, rank % par.tp
    at = lambda i, jj, kk: i * width + jj * par.tp + kk  # noqa: E731
    roles = {
        "tensor": frozenset(at(stage, j, y) for y in range(par.tp)),
        "data": frozenset(at(stage, x, k) for x in range(par.dp)),
        "pipe": frozenset(at(i, j, k) for i in range(par.pp)),
        "model": frozenset(at(i, j, y) for i in range(par.pp) for y in range(par.tp)),
        "world": frozenset(range(par.num_gpus)),
    }
    if tied and par.pp > 1:
        roles["tied"] = frozenset({at(0, j, k), at(par.pp - 1, j, k)})
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
    return rank // (par.dp * par.tp)
