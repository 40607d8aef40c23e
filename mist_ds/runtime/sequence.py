"""Sequence parallelism at run time (DeepSpeed Ulysses; docs/design.md, Glossary, sequence parallel): the groups,
DeepSpeed's view of them, the slice of every sequence a rank is fed and the share of the loss it backpropagates.

Ranks lie as mist_ds/specs/groups.py lays them out: the d q ranks of a stage's TP index are DeepSpeed's data axis
(PipeModelDataParallelTopology with num_dp = d q), a sequence group is q consecutive ones of them. DeepSpeed's
engine and ZeRO read the groups from the mpu (deepspeed/utils/groups.py `_get_sequence_data_parallel_group`,
`_get_sequence_parallel_world_size`): `SequenceParallelMpu` answers the sequence-data-parallel group (d q ranks:
ZeRO shards and gradients are reduced over it), the sequence group (q ranks), and a data-parallel size d, which
DeepSpeed's batch rule takes (train_batch_size = b G d); DeepSpeed averages the gradients summed over d q ranks by
d (deepspeed/runtime/engine.py `_reduce_non_expert_gradients`, zero/stage_1_and_2.py divide by d q / q), except
ZeRO-3's reduce-scatter, which divides by d q (zero/stage3.py `__avg_scatter_grads` through
`reduce_scatter_coalesced`'s pre-division by the group's size). Each rank's loss is its slice's mean token loss / q,
so the slices' losses summed over a sequence group are the whole sequence's mean (`SequenceGroups.loss_share`); it
backpropagates that, or, under ZeRO-3, q times it (`backward_share`), so every ZeRO stage's gradients are those of
the whole sequences' mean over the d data-parallel ranks: what a gradient clip reads.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from mist_ds.models.sequence import SequenceParallel
from mist_ds.specs.strategy import Parallelism
from mist_ds.specs.versions import release

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SequenceGroups:
    """This rank's sequence group (a process group of torch.distributed) and where it lies."""

    layers: SequenceParallel
    """What the zoo's layers are built with: the sequence group's name, this rank's slice index, q."""
    sequence: Any
    """The q ranks sharing each sequence."""
    data_index: int
    """j: which of the d sequence groups of its stage and TP index this rank's is (the samples it reads)."""
    dp: int
    """d."""

    @property
    def loss_share(self) -> float:
        """What a rank's slice mean is scaled by: 1 / q (module docstring)."""
        return 1.0 / self.layers.size

    def backward_share(self, zero_stage: int) -> float:
        """What a rank's slice mean is scaled by before its backward: the loss share, times q under ZeRO-3, whose
        reduce-scatter averages over the d q ranks where the other stages average over d (module docstring)."""
        import deepspeed

        return self.loss_share * zero3_gradient_scale(zero_stage, self.layers.size, deepspeed.__version__)


ZERO3_SUMS_SEQUENCE_GRADIENTS_FROM = "0.20.2"
"""The DeepSpeed version from which ZeRO-3's reduce-scatter divides by d, not d q, as its other paths do
(deepspeedai/DeepSpeed#8854, as transformers' deepspeed_sp_compute_loss cites it; module docstring)."""


def zero3_gradient_scale(zero_stage: int, q: int, deepspeed_version: str) -> int:
    """What a sequence-parallel rank's loss share is multiplied by before its backward: q under ZeRO-3 of a DeepSpeed
    before ZERO3_SUMS_SEQUENCE_GRADIENTS_FROM (its reduce-scatter averages the gradients over d q), else 1."""
    fixed = release(deepspeed_version) >= release(ZERO3_SUMS_SEQUENCE_GRADIENTS_FROM)
    return q if zero_stage == 3 and not fixed else 1


def sequence_rank_lists(par: Parallelism) -> list[list[int]]:
    """Every sequence group, in rank order: rank = i (d q t) + j (q t) + m t + k for stage i, data index j, sequence
    index m, tensor index k (mist_ds/specs/groups.py)."""
    width, q, t = par.stage_width, par.sp, par.tp
    return [[i * width + j * q * t + m * t + k for m in range(q)]
            for i in range(par.pp) for j in range(par.dp) for k in range(t)]


def apply_sequence_parallel(par: Parallelism, rank: int) -> SequenceGroups | None:
    """Sequence parallelism (q = par.sp > 1): every rank creates every sequence group (collective, the same order
    everywhere); this rank's SequenceGroups, or None at q = 1."""
    from deepspeed import comm as dist

    if par.sp == 1:
        return None
    mine = None
    for ranks in sequence_rank_lists(par):
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = (group, ranks)
    group, ranks = mine
    layers = SequenceParallel(group.group_name, ranks.index(rank), par.sp)
    data_index = (rank % par.stage_width) // (par.sp * par.tp)
    log.info("sequence parallel: q %d over ranks %s (this rank's slice %d, data index %d); gradients and ZeRO over "
             "d q = %d ranks, DeepSpeed's batch rule over d = %d", par.sp, ranks, layers.rank, data_index,
             par.data_group_size, par.dp)
    return SequenceGroups(layers, group, data_index, par.dp)


class SequenceParallelMpu:
    """DeepSpeed's mpu under sequence parallelism (module docstring), over the PipelineParallelGrid whose data axis
    holds the d q ranks. Its data-parallel group is those d q ranks: ZeRO-3 partitions its parameters over
    `get_data_parallel_group()` (deepspeed/runtime/zero/parameter_offload.py `_convert_to_zero_parameters`), not over
    the sequence-data group; its data-parallel size and rank are d and j, which DeepSpeed's batch rule
    (runtime/config.py, train_batch_size = b G d) and its data loader (engine.deepspeed_io: a sequence group reads
    the same samples) read. The model, tensor and pipe groups are the grid's."""

    def __init__(self, grid: Any, groups: SequenceGroups) -> None:
        self.grid, self.groups = grid, groups

    def __getattr__(self, name: str) -> Any:  # the grid's model, tensor, slice and pipe groups
        if name in ("grid", "groups"):  # not set yet (a copy): no recursion through the grid
            raise AttributeError(name)
        return getattr(self.grid, name)

    def get_data_parallel_group(self):
        return self.grid.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return self.groups.dp

    def get_data_parallel_rank(self) -> int:
        return self.groups.data_index

    def get_sequence_parallel_group(self):
        return self.groups.sequence

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.layers.size

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.layers.rank

    def get_sequence_data_parallel_group(self):
        return self.grid.get_data_parallel_group()

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.grid.get_data_parallel_world_size()

    def get_sequence_data_parallel_rank(self) -> int:
        return self.grid.get_data_parallel_rank()
