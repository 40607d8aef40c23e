"""DeepSpeed's PipelineModule with the plan's exact stage boundaries and the zoo model's tied weights.

DeepSpeed partitions layers only by 'uniform', 'parameters' or 'type:' (deepspeed/runtime/pipe/
module.py:396-447); `PlannedPipelineModule` overrides that private `_partition_layers` to apply the
plan's boundaries as given, through the private `_set_bounds` (module.py:545). Both are checked
against the DeepSpeed versions of mist_ds/runtime/versions.py at start-up.

Tied embeddings: the first stage's token weight and the last stage's LM-head weight are two
parameters, initialized equal (and made equal at build by a broadcast from the first stage, as DeepSpeed's
`_synchronize_tied_weights` does for TiedLayerSpec, pipe/module.py:472: a user's model may come to each rank
otherwise), whose gradients are summed over a group of the two stages before the
step, as DeepSpeed's ReduceTiedGrads does for TiedLayerSpec (it calls the public
`get_tied_weights_and_groups`, pipe/engine.py:281). The last stage's copy is marked
`ds_pipe_replicated`, so the gradient norm counts it once (deepspeed/runtime/utils.py:517).
"""
from __future__ import annotations

from typing import Sequence

import torch.nn as nn
from deepspeed import comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule

from mist_ds.runtime.layers import EMBEDDING, HEAD, PlannedLayer, tied_weight


def layer_boundaries(layers_per_stage: Sequence[int]) -> list[int]:
    """Indices into [embedding, block_0 .. block_{L-1}, head] where each stage starts, plus the end.

    Example: 8 blocks as (3, 5) -> [0, 4, 10]: stage 0 runs the embedding and blocks 0-2, stage 1
    blocks 3-7 and the head.
    """
    bounds, start = [0], 1
    for count in layers_per_stage:
        start += count
        bounds.append(start)
    bounds[-1] += 1  # the head
    return bounds


class PlannedPipelineModule(PipelineModule):
    """A PipelineModule whose stage i holds exactly the layers the plan gives it (module docstring)."""

    def __init__(self, layers: list[LayerSpec], layers_per_stage: Sequence[int], *, tie_embeddings: bool,
                 **kwargs) -> None:
        # Read by _partition_layers, which PipelineModule.__init__ calls before it returns.
        object.__setattr__(self, "_planned_parts", layer_boundaries(layers_per_stage))
        if len(layers) != self._planned_parts[-1]:
            raise ValueError(f"{len(layers)} layers for boundaries {self._planned_parts}")
        super().__init__(layers=layers, num_stages=len(layers_per_stage), **kwargs)
        self.planned_ties = self._tie_embeddings() if tie_embeddings else []

    def _partition_layers(self, method: str = "planned") -> None:  # noqa: ARG002 (DeepSpeed's signature)
        self.parts = list(self._planned_parts)
        stage = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    def local_layers(self) -> list[PlannedLayer]:
        return [f for f in self.forward_funcs if isinstance(f, PlannedLayer)]

    def _tie_embeddings(self) -> list[tuple[nn.Parameter, object]]:
        """One group per (data, model) coordinate holding its first- and last-stage ranks; every rank
        creates every group in the same order (new_group is collective)."""
        grid, last = self._grid, self.num_stages - 1
        ties = []
        for dp in range(grid.data_parallel_size):
            for mp in range(grid.get_slice_parallel_world_size()):
                ranks = [grid.stage_to_global(stage_id=s, data=dp, model=mp) for s in (0, last)]
                group = dist.new_group(ranks=ranks)
                if self.global_rank in ranks:
                    kind = EMBEDDING if self.stage_id == 0 else HEAD
                    layer = next(f for f in self.local_layers() if f.kind == kind)
                    weight = tied_weight(layer)
                    if self.stage_id == last:
                        weight.ds_pipe_replicated = True
                    dist.broadcast(weight.data, src=ranks[0], group=group)
                    ties.append((weight, group))
        return ties

    def get_tied_weights_and_groups(self):
        return list(self.planned_ties)

    def allreduce_tied_weight_gradients(self) -> None:
        for weight, group in self.planned_ties:
            if weight.grad is not None:
                dist.all_reduce(weight.grad, group=group)
